"""One measurement for benchmarks/test_knobs.py, run in a fresh process per knob so peaks do not mix:
``python benchmarks/knob_probe.py NAME SHAPE override ...`` prints one JSON line.

The real DeepSpeed actor (rlprof_train's ActorWorker) runs two passes over one ragged mini-batch on a small Llama of
one of two shapes (``SHAPES``): ``head`` (6 layers, hidden 256, vocabulary 8192: the LM head and the logits dominate
memory) or ``deep`` (8 layers, hidden 384, vocabulary 512: the layers' activations dominate). The update pass
(forward + backward of the actor loss, no optimizer step) and the log-prob pass (no grad, with entropies, as for
old_log_prob; measured first). Measured after a warm-up: wall time (best of 2), real tokens per second, and the peak
of the process's resident memory above its level before the pass (rlprof's host-memory high-water mark, reset before
each pass, after freed memory went back to the OS), plus the token positions the model computed (padding included).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import tempfile
import time

import torch

from rlprof.metrics import MetricAggregator
from rlprof.tools.host_memory import read_rss, reset_peak
from rlprof_train.batch import MicroBatching, RolloutBatch
from rlprof_train.config.load import load_trainer_config
from rlprof_train.workers.actor import ActorWorker
from rlprof_train.workers.engine import init_distributed

ROWS, PROMPT, RESPONSE = 16, 64, 192
SHAPES = {
    "head": dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4),
    "deep": dict(vocab_size=512, hidden_size=384, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=6),
}


def small_model(path: str, shape: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dims = SHAPES[shape]
    config = LlamaConfig(
        **dims, num_key_value_heads=dims["num_attention_heads"], head_dim=64, max_position_embeddings=512
    )
    LlamaForCausalLM(config).save_pretrained(path)


def ragged_batch(vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(8, PROMPT + 1, (ROWS,), generator=g)
    response_lengths = torch.randint(8, RESPONSE + 1, (ROWS,), generator=g)
    ids = torch.randint(3, vocab, (ROWS, PROMPT + RESPONSE), generator=g)
    mask = torch.zeros_like(ids)
    for r in range(ROWS):
        mask[r, PROMPT - prompt_lengths[r] : PROMPT + response_lengths[r]] = 1
    response_mask = mask[:, PROMPT:]
    zeros = torch.zeros(ROWS, RESPONSE)
    return RolloutBatch(
        ids * mask,
        mask,
        response_mask,
        PROMPT,
        uid=list(range(ROWS)),
        data_source=["b"] * ROWS,
        ground_truth=["0"] * ROWS,
        old_log_probs=zeros - 9.0,
        ref_log_probs=zeros - 9.0,
        advantages=torch.randn(ROWS, RESPONSE, generator=g) * response_mask,
    )


def computed_positions(worker, batch: RolloutBatch) -> int:
    """Token positions the update's forward passes run on (padding included): the input ids the model embeds."""
    fed: list[int] = []
    embeddings = worker.module.get_input_embeddings()
    hook = embeddings.register_forward_hook(lambda _module, args, _out: fed.append(args[0].numel()))
    worker.accumulate_gradients(batch, MetricAggregator())
    hook.remove()
    worker.engine.zero_grad()
    return sum(fed)


def main(name: str, shape: str, overrides: list[str]) -> None:
    env = init_distributed("cpu")
    with tempfile.TemporaryDirectory() as path:
        small_model(path, shape)
        cfg = load_trainer_config(
            [
                "--config-name=demo",
                f"actor_rollout_ref.model.path={path}",
                "actor_rollout_ref.actor.zero_stage=0",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                *overrides,
            ]
        )
        worker = ActorWorker(cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model, path, env)
    rollout = cfg.actor_rollout_ref.rollout
    log_prob_batching = MicroBatching(
        rollout.log_prob_micro_batch_size_per_gpu,
        rollout.log_prob_use_dynamic_bsz,
        rollout.log_prob_max_token_len_per_gpu,
        cfg.actor_rollout_ref.model.use_remove_padding,
    )
    batch = ragged_batch(SHAPES[shape]["vocab_size"])
    log_prob = measure(
        lambda: worker.compute_log_prob(batch, log_prob_batching), worker
    )  # first: its peak is not raised by the update's
    update = measure(lambda: worker.accumulate_gradients(batch, MetricAggregator()), worker)
    real = int(batch.attention_mask.sum())
    print(
        json.dumps(
            {
                "knob": name,
                "shape": shape,
                "update_tokens_per_s": real / update[0],
                "update_peak_mb": update[1],
                "log_prob_tokens_per_s": real / log_prob[0],
                "log_prob_peak_mb": log_prob[1],
                "computed_positions": computed_positions(worker, batch),
                "real_tokens": real,
            }
        )
    )


def release_free_memory() -> None:
    """Hand memory the allocator keeps from earlier passes back to the OS, so RSS is the live set (glibc)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(run, worker) -> tuple[float, float]:
    """(best seconds, smallest peak MiB above the starting RSS) over 2 runs after a warm-up run."""
    run()
    times, peaks = [], []
    for _ in range(2):
        worker.engine.zero_grad()
        release_free_memory()
        before, _ = read_rss()
        reset_peak()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        peaks.append((read_rss()[1] - before) / 2**20)
    return min(times), min(peaks)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
