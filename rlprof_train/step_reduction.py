"""The metrics of one PPO step, assembled from every rank: one gather, then each metric reduced with its own
reducer (worker metrics), over the whole batch (data metrics), or per rank (timing spread)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from rlprof.metrics import (
    MetricAggregator,
    compute_data_metrics,
    compute_memory_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    mfu_metrics,
    timing_shares,
    timing_spread,
)
from rlprof.metrics.dashboard_keys import training_aliases
from rlprof_train.agent.stats import multi_turn_metrics
from rlprof_train.batch import RolloutBatch
from rlprof_train.workers.engine import DistEnv
from rlprof_train.workers.rollout.engine_stats import engine_metrics

TENSOR_FIELDS = ("token_level_scores", "token_level_rewards", "advantages", "returns", "values", "response_mask")


@dataclass(frozen=True)
class StepFacts:
    """What the step's metrics need besides the batch and the timings."""

    step: int
    epoch: int
    response_length: int
    max_prompt_length: int
    model_config: Any
    """The policy's Hugging Face config (for MFU)."""
    ppo_epochs: int


def step_metrics(
    env: DistEnv, facts: StepFacts, batch: RolloutBatch, timing: dict[str, float], workers: MetricAggregator
) -> dict[str, float]:
    """Every metric of the step (verl's names, the seed's aliases, rlprof's timing split); all ranks agree. The
    batch's tensors are copied to the host here, where the metrics are computed and gathered."""
    everything = env.gather(
        {
            "workers": workers.state(),
            "timing": timing,
            "tensors": {k: None if (t := getattr(batch, k)) is None else t.cpu() for k in TENSOR_FIELDS},
            "prompt_lengths": batch.prompt_lengths().cpu(),
            "response_lengths": batch.response_lengths().cpu(),
            "sequence_lengths": batch.sequence_lengths().tolist(),
            "engine_requests": batch.extras.get("engine_requests", []),
            "engine_occupancy": batch.extras.get("engine_occupancy"),
            "engine_kv_cache_usage": batch.extras.get("engine_kv_cache_usage", []),
            "multi_turn": batch.extras.get("multi_turn"),
        }
    )
    tensors: dict[str, Any] = {
        k: torch.cat([r["tensors"][k] for r in everything]) if everything[0]["tensors"][k] is not None else None
        for k in TENSOR_FIELDS
    }
    seq_lens = [n for r in everything for n in r["sequence_lengths"]]
    prompt_lengths = torch.cat([r["prompt_lengths"] for r in everything])
    response_lengths = torch.cat([r["response_lengths"] for r in everything])
    prompt_tokens = int(prompt_lengths.sum())
    response_tokens = int(response_lengths.sum())
    metrics = MetricAggregator.from_states(r["workers"] for r in everything).compute()
    metrics.update(
        compute_data_metrics(
            **tensors,
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
            max_response_length=facts.response_length,
            max_prompt_length=facts.max_prompt_length,
        )
    )
    occupancies = [r["engine_occupancy"] for r in everything if r["engine_occupancy"] is not None]
    occupancy = (sum(o[0] for o in occupancies), sum(o[1] for o in occupancies)) if occupancies else None
    metrics.update(
        engine_metrics(
            [request for r in everything for request in r["engine_requests"]],
            occupancy,
            [usage for r in everything for usage in r["engine_kv_cache_usage"]],
        )
    )
    turns = [r["multi_turn"] for r in everything if r["multi_turn"] is not None]
    metrics.update(
        multi_turn_metrics(
            [t for m in turns for t in m["trajectories"]],
            [c for m in turns for c in m["calls"]],
            [split for m in turns for split in m["splits"]],
        )
    )
    metrics.update(compute_timing_metrics(timing, prompt_tokens, response_tokens))
    metrics.update(timing_shares(timing))
    if env.world_size > 1:
        metrics.update(timing_spread([r["timing"] for r in everything]))
    metrics.update(
        compute_throughput_metrics(
            timing["step"],
            prompt_tokens + response_tokens,
            env.world_size,
            num_samples=len(seq_lens),
            gen_seconds=timing.get("gen"),
        )
    )
    if "update_actor" in timing:  # not during trainer.critic_warmup
        metrics.update(
            mfu_metrics(
                "actor", facts.model_config, seq_lens * facts.ppo_epochs, timing["update_actor"], env.world_size
            )
        )
    metrics.update(compute_memory_metrics(reset_peaks=True))
    metrics.update(training_aliases(metrics))
    metrics.update(
        {
            "training/global_step": float(facts.step),
            "training/epoch": float(facts.epoch),
            "training/batch_fingerprint": float(zlib.crc32(str(sorted(set(batch.uid))).encode()) % 1_000_000),
        }
    )
    return metrics
