"""Timing and throughput metrics of one training step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

# Phases whose per-token time is taken over response tokens (generation); the others over all tokens.
PER_RESPONSE_TOKEN = frozenset({"gen"})
PER_TOKEN = frozenset({"ref", "values", "adv", "update_critic", "update_actor", "old_log_prob", "reward"})


def compute_timing_metrics(
    timing_raw: Mapping[str, float], num_prompt_tokens: int, num_response_tokens: int
) -> dict[str, float]:
    """``timing_s/{phase}`` for every timed phase, and ``timing_per_token_ms/{phase}``: for ``gen`` per response
    token, for ref/values/adv/update_critic/update_actor/old_log_prob/reward per token (prompt + response).
    Phases not timed are absent; a phase with no tokens gets no per-token entry."""
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing_raw.items()}
    total_tokens = num_prompt_tokens + num_response_tokens
    for name, seconds in timing_raw.items():
        tokens = num_response_tokens if name in PER_RESPONSE_TOKEN else total_tokens if name in PER_TOKEN else 0
        if tokens > 0:
            metrics[f"timing_per_token_ms/{name}"] = 1000.0 * seconds / tokens
    return metrics


def compute_throughput_metrics(
    step_seconds: float,
    total_num_tokens: int,
    num_devices: int,
    num_samples: Optional[int] = None,
    gen_seconds: Optional[float] = None,
) -> dict[str, float]:
    """``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (tokens / s / device), and the
    seed's ``throughput/tokens_per_sec`` (tokens / s over all devices); with ``num_samples`` the seed's
    ``throughput/samples_per_sec`` (responses / s of step time), and with ``gen_seconds`` too,
    ``perf/rollout_samples_per_s`` (responses generated per second of generation)."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds={step_seconds} must be positive")
    if num_devices <= 0:
        raise ValueError(f"num_devices={num_devices} must be positive")
    metrics = {
        "perf/total_num_tokens": float(total_num_tokens),
        "perf/time_per_step": float(step_seconds),
        "perf/throughput": total_num_tokens / step_seconds / num_devices,
        "throughput/tokens_per_sec": total_num_tokens / step_seconds,
    }
    if num_samples is not None:
        metrics["throughput/samples_per_sec"] = num_samples / step_seconds
        if gen_seconds:
            metrics["perf/rollout_samples_per_s"] = num_samples / gen_seconds
    return metrics


PHASE_GROUPS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"gen", "gen_max", "gen_refill", "update_weights", "sync_rollout_weights"}),
    "training": frozenset({"old_log_prob", "ref", "values", "update_critic", "update_actor"}),
    "concurrent": frozenset({"generate_async"}),
}
"""Which timed phases are generation and which are training; any other phase (reward, adv, ...) is ``other``.
``concurrent``: work of another pool that ran beside the step (verl's one-step-off ``generate_async``: the rollout
pool's sampling of the next batch), not a part of the step's time: left out of every share of it."""


def phase_group(phase: str) -> str:
    """``rollout``, ``training`` or ``other`` for a phase name of ``timing_s/*``."""
    for group, phases in PHASE_GROUPS.items():
        if phase in phases:
            return group
    return "other"


def timing_shares(timing_raw: Mapping[str, float], step_key: str = "step") -> dict[str, float]:
    """``timing_share/{rollout,training,other,unaccounted}``: each group's share of the step's time (0..1), where
    unaccounted = the step minus every timed phase (time no phase covers: data loading, logging, waiting).
    Empty when the step itself was not timed."""
    step = timing_raw.get(step_key)
    if not step or step <= 0:
        return {}
    sums = {"rollout": 0.0, "training": 0.0, "other": 0.0}
    for phase, seconds in timing_raw.items():
        if phase != step_key and phase_group(phase) in sums:
            sums[phase_group(phase)] += seconds
    shares = {f"timing_share/{group}": seconds / step for group, seconds in sums.items()}
    shares["timing_share/unaccounted"] = max(0.0, step - sum(sums.values())) / step
    return shares
