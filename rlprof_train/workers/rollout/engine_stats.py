"""The rollout engine's own counters per step: how long each request waited, took to its first token, took per token
after that, how often it was preempted and how full the KV cache got, read from what vLLM returns with each request
(``RequestOutput.metrics`` and ``num_cached_tokens``) and its scheduler's statistics, both kept when
``rollout.disable_log_stats=false``, or timed by the hf rollout's sampling loop (per decode step), gathered over the
ranks.

Per step, over the step's requests (one per prompt: vLLM fans a prompt's n samples out and returns them together):

- ``rollout/engine/queue_time_ms_p50|p99``: scheduled - queued, ms;
- ``rollout/engine/ttft_ms_p50|p99``: time to the first token (vLLM's ``first_token_latency``), ms;
- ``rollout/engine/itl_ms_p50|p99``: (last token - first token) / (tokens - 1), ms, for requests of 2+ tokens;
- ``rollout/engine/num_preemptions``: sum over requests;
- ``rollout/engine/prefix_cache_hit_rate``: prompt tokens served from the prefix cache / prompt tokens;
- ``rollout/engine/kv_cache_usage`` (vllm): the largest share of the KV cache's blocks in use at any engine iteration
  of the step (0..1, vLLM's ``kv_cache_usage_perc``; 1 is full: the next sequence waits or preempts another), and
  ``rollout/engine/kv_cache_usage_mean`` over the iterations (from vLLM's stat-logger interface:
  :mod:`.vllm_stats`);
- ``rollout/slowest_response_s``: the longest request, from its arrival to its last token;
- ``rollout/engine/batch_occupancy`` (hf): tokens sampled / (rows x decode steps) of each micro-batch: the share of
  ``generate``'s row-steps that make a real token (the loop drops finished rows, so 1 - occupancy is the work saved).

The hf rollout has no scheduler queue, preemption or prefix cache, so it reports none of those; a request (a prompt
and its n responses) arrives when the rollout starts, so its time to the first token includes the micro-batches
sampled before its own, and its last token is its longest response's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from rlprof.analysis.step_series import quantile

PREFIX = "rollout/engine/"


@dataclass(frozen=True)
class RequestTimes:
    """One request's life in the engine, in seconds."""

    queue_s: Optional[float]
    """None where the engine has no queue (hf)."""
    ttft_s: float
    itl_s: Optional[float]
    """None for a request of one token."""
    total_s: float
    """Arrival to last token: the time to the first token, then the decoding."""
    preemptions: Optional[int]
    """None where the engine never preempts (hf)."""
    prompt_tokens: int
    cached_tokens: Optional[int]
    """None where the engine has no prefix cache (hf)."""


def vllm_request_times(outputs: Sequence[Any]) -> Optional[list[RequestTimes]]:
    """Each ``RequestOutput``'s times, or None when vLLM kept none (``disable_log_stats``)."""
    found = []
    for output in outputs:
        stats = output.metrics
        if stats is None or not hasattr(stats, "first_token_latency"):
            return None
        tokens = stats.num_generation_tokens
        decode_s = stats.last_token_ts - stats.first_token_ts
        found.append(
            RequestTimes(
                queue_s=max(0.0, stats.scheduled_ts - stats.queued_ts),
                ttft_s=stats.first_token_latency,
                itl_s=decode_s / (tokens - 1) if tokens > 1 else None,
                total_s=stats.first_token_latency + max(0.0, decode_s),
                preemptions=stats.num_preemptions,
                prompt_tokens=len(output.prompt_token_ids or ()),
                cached_tokens=output.num_cached_tokens or 0,
            )
        )
    return found


def hf_request_times(
    prompt_tokens: Sequence[int], lengths: Sequence[int], n: int, arrival: float, step_times: Sequence[float]
) -> list[RequestTimes]:
    """One micro-batch's requests as the hf loop sampled them: ``lengths`` ``[B·n]`` tokens per response (rows of a
    prompt consecutive), ``step_times`` the clock at the end of each decode step, ``arrival`` when the rollout
    started (the same clock, seconds)."""
    found = []
    for i, prompt in enumerate(prompt_tokens):
        steps = max(lengths[i * n : (i + 1) * n])
        first, last = step_times[0], step_times[steps - 1]
        found.append(
            RequestTimes(
                queue_s=None,
                ttft_s=first - arrival,
                itl_s=(last - first) / (steps - 1) if steps > 1 else None,
                total_s=last - arrival,
                preemptions=None,
                prompt_tokens=prompt,
                cached_tokens=None,
            )
        )
    return found


def engine_metrics(
    requests: Sequence[RequestTimes],
    occupancy: Optional[tuple[int, int]] = None,
    kv_cache_usage: Sequence[float] = (),
) -> dict[str, float]:
    """The step's engine metrics (see the module doc) over ``requests`` (every rank's), the hf loop's ``occupancy``
    (tokens sampled, rows x decode steps; summed over ranks) and vLLM's ``kv_cache_usage`` per engine iteration
    (every rank's engine); {} for none."""
    metrics: dict[str, float] = {}
    if occupancy is not None and occupancy[1]:
        metrics[f"{PREFIX}batch_occupancy"] = occupancy[0] / occupancy[1]
    if kv_cache_usage:
        metrics[f"{PREFIX}kv_cache_usage"] = max(kv_cache_usage)
        metrics[f"{PREFIX}kv_cache_usage_mean"] = sum(kv_cache_usage) / len(kv_cache_usage)
    if not requests:
        return metrics
    series = {
        "queue_time_ms": [r.queue_s * 1e3 for r in requests if r.queue_s is not None],
        "ttft_ms": [r.ttft_s * 1e3 for r in requests],
        "itl_ms": [r.itl_s * 1e3 for r in requests if r.itl_s is not None],
    }
    for name, values in series.items():
        if values:
            metrics[f"{PREFIX}{name}_p50"] = quantile(values, 0.5)
            metrics[f"{PREFIX}{name}_p99"] = quantile(values, 0.99)
    preemptions = [r.preemptions for r in requests if r.preemptions is not None]
    if preemptions:
        metrics[f"{PREFIX}num_preemptions"] = float(sum(preemptions))
    cached = [(r.cached_tokens, r.prompt_tokens) for r in requests if r.cached_tokens is not None]
    if sum(prompt for _, prompt in cached):
        metrics[f"{PREFIX}prefix_cache_hit_rate"] = sum(c for c, _ in cached) / sum(prompt for _, prompt in cached)
    metrics["rollout/slowest_response_s"] = max(r.total_s for r in requests)
    return metrics
