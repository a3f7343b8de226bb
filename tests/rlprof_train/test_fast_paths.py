"""The trainer's fast paths on the CPU (where ``torch.compile`` and static caches run too): the same learning as the
eager paths, the compile timed once on its own, and what they cannot do refused before any work."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from test_trainer_e2e import run_trainer

from rlprof.tracking.jsonl import read_jsonl
from rlprof.typed_config import ConfigError
from rlprof_train.config.load import load_trainer_config
from rlprof_train.models import CompiledForward, load_causal_lm, response_log_probs
from rlprof_train.preflight import validate
from rlprof_train.prepare import EMBEDDED_MODEL_DIR
from rlprof_train.tiny_model import ensure_tiny_model

from conftest import ROOT

ARR = "actor_rollout_ref"
STEPS = 60
EAGER_SEEDS = (1, 2, 3)
FAST_SEEDS = (1,)
FAST = (
    f"{ARR}.rollout.enforce_eager=false",  # the hf rollout's static cache and compiled decode step
    f"{ARR}.model.torch_compile=true",  # the training passes' compiled forward (packed: the default)
    f"{ARR}.model.dtype=bfloat16",  # bf16 parameters, fp32 master weights in DeepSpeed's optimizer
    f"{ARR}.model.use_remove_padding=true",  # packed sequences (the demo's default too)
    f"{ARR}.actor.optim.fused=true",  # torch's fused AdamW (the default too)
)


def run(folder: Path, seed: int, *overrides: str, steps: int = STEPS) -> list[dict]:
    result = run_trainer(
        folder,
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.seed={seed}",
        *overrides,
    )
    records = [r for r in read_jsonl(folder / "logs" / "metrics.jsonl") if r["step"] > 0]
    return [{**r, "_log": result.stdout + result.stderr} for r in records]


def mean_reward(records: list[dict]) -> float:
    return statistics.fmean(r["critic/score/mean"] for r in records)


@pytest.mark.long
def test_sixty_steps_with_the_fast_paths_learn_as_the_eager_paths_do_within_the_run_to_run_spread(tmp_path):
    """The demo's GRPO for 60 steps: eager with three seeds gives the run-to-run spread of the mean reward over the
    run; the fast paths with one of those seeds land within it (widened by the spread itself) and learn. A rollout
    that sampled from stale weights stays at the start's reward (~0.15 against ~0.29) and fails."""
    eager = {seed: run(tmp_path / f"eager{seed}", seed) for seed in EAGER_SEEDS}
    fast = {seed: run(tmp_path / f"fast{seed}", seed, *FAST) for seed in FAST_SEEDS}
    eager_means = [mean_reward(r) for r in eager.values()]
    spread = max(eager_means) - min(eager_means)
    low, high = min(eager_means) - spread, max(eager_means) + spread
    fast_means = {seed: mean_reward(r) for seed, r in fast.items()}
    print(f"\nmean reward over {STEPS} steps: eager {eager_means} (spread {spread:.3f}); fast {fast_means}")
    for seed, records in fast.items():
        assert low <= fast_means[seed] <= high, (seed, fast_means[seed], (low, high))
        rewards = [r["critic/score/mean"] for r in records]
        assert statistics.fmean(rewards[-20:]) >= statistics.fmean(rewards[:5]) + 0.1, rewards  # it learned


@pytest.mark.long  # about a minute on 2 cores: the compiled decode itself is checked in the test command
def test_the_rollouts_compile_is_timed_once_before_step_1_and_logged_with_it(tmp_path):
    """The fast paths for three steps: the compile is timed once, on its own (Trainer.warm_up, before step 1's
    window), logged with step 1 and named in the log once; an eager run logs no compile."""
    fast = run(tmp_path / "fast", 1, *FAST, steps=3)
    compiled = [r["step"] for r in fast if "timing_s/rollout_compile" in r]
    assert compiled == [1], compiled
    assert fast[0]["_log"].count("rollout: compiled the decode step for 256 rows x 16 positions") == 1
    eager = run(tmp_path / "eager", 1, steps=3)
    assert len(eager) == 3 and not any("timing_s/rollout_compile" in r for r in eager)


@pytest.mark.long  # CI time: in the test command's long runs
def test_the_compiled_forward_gives_the_eager_log_probs_entropies_and_gradients_with_one_graph_for_all_shapes():
    """The padded path (the trainer's run above takes the packed one): micro-batches of other sizes and widths reuse
    the first call's graph (dynamic shapes); the values and gradients are the eager forward's up to float rounding."""
    model = load_causal_lm(ensure_tiny_model(ROOT / EMBEDDED_MODEL_DIR, 4), gradient_checkpointing=True)
    compiled = CompiledForward(model)
    torch._dynamo.utils.counters.clear()
    generator = torch.Generator().manual_seed(0)
    for rows, prompt, response in ((16, 6, 4), (32, 7, 4), (24, 6, 5), (8, 9, 3)):
        ids = torch.randint(5, 300, (rows, prompt + response), generator=generator)
        mask = torch.ones_like(ids)
        mask[: rows // 4, :2] = 0  # left padding
        mask[rows // 2 :, -1:] = 0  # responses that ended early
        results = []
        for forward in (compiled, model):
            log_probs, entropy = response_log_probs(forward, ids, mask, response, 0.7, with_entropy=True)
            assert entropy is not None
            (log_probs.sum() + entropy.sum()).backward()
            results.append((log_probs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad()
        (got_lp, got_entropy, got_grads), (lp, entropy, grads) = results
        torch.testing.assert_close(got_lp, lp, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_entropy, entropy, rtol=1e-4, atol=1e-5)
        for got, expected in zip(got_grads, grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_the_compiled_forward_with_zero_3_is_one_config_error():
    base = ["--config-name=demo", f"{ARR}.model.torch_compile=true"]
    validate(load_trainer_config([*base, f"{ARR}.actor.zero_stage=2"]))
    with pytest.raises(ConfigError) as raised:
        validate(load_trainer_config([*base, f"{ARR}.actor.zero_stage=3"]))
    assert str(raised.value) == (
        f"{ARR}.model.torch_compile=True: a compiled forward needs the weights in place, and {ARR}.actor.zero_stage=3"
        " gathers them layer by layer in hooks; use zero_stage 0, 1 or 2, or torch_compile=false"
    )


def test_the_compiled_decode_with_zero_3_is_one_config_error():
    base = ["--config-name=demo", f"{ARR}.rollout.enforce_eager=false"]
    validate(load_trainer_config([*base, f"{ARR}.actor.zero_stage=2"]))
    validate(load_trainer_config([*base[:1], f"{ARR}.actor.zero_stage=3"]))  # eager: nothing to refuse
    with pytest.raises(ConfigError) as raised:
        validate(load_trainer_config([*base, f"{ARR}.actor.zero_stage=3"]))
    assert str(raised.value) == (
        f"{ARR}.rollout.name='hf': {ARR}.rollout.enforce_eager=false (the compiled decode) needs the weights in "
        f"place, and {ARR}.actor.zero_stage=3 gathers them for each call; use enforce_eager=true or zero_stage 0, 1 "
        "or 2"
    )
