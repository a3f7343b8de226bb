"""What a step's multi-turn trajectories did, as metrics, over every rank's trajectories and calls:

- ``num_turns/{mean,max,min}``: turns per trajectory as verl counts them (the prompt, each generation turn and
  each tool-reply turn);
- ``tool_call_counts/{mean,max,min}``: calls the policy wrote per trajectory (malformed ones included);
- ``tools/<name>/{calls,failures}`` and ``tools/<name>/latency_ms_{p50,p90,p99}``: per tool, its calls in the step,
  those that raised, timed out or were refused, and their latency; ``tools/malformed_calls``: calls that named no
  tool of the config or could not be read;
- ``rollout/generation_share`` and ``rollout/tool_wait_share``: of the rollout's time, the share spent generating
  and the share spent waiting for tool calls (the rest: turning replies into tokens, parsing);
- ``rollout/slowest_trajectory/{seconds,turns,tool_calls,length}``: the trajectory that finished last (seconds
  from the rollout's start), the long tail the step waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlprof.analysis.step_series import quantile

MALFORMED = ""
"""The tool name of a call that named no tool of the config or could not be read."""


@dataclass(frozen=True)
class TrajectoryRecord:
    """One trajectory of a multi-turn rollout."""

    turns: int
    """verl's ``num_turns``: 1 (the prompt) + generation turns + tool-reply turns."""
    tool_calls: int
    length: int
    """Response tokens, tool replies included."""
    seconds: float
    """From the rollout's start to this trajectory's end."""


@dataclass(frozen=True)
class ToolCallRecord:
    """One call: which tool (:data:`MALFORMED` for an unusable call), how long it took, whether it failed."""

    name: str
    seconds: float
    failed: bool


@dataclass(frozen=True)
class RolloutSplit:
    """Where a rollout's time went, in seconds."""

    total_s: float
    generating_s: float
    tool_wait_s: float


def multi_turn_metrics(
    trajectories: Sequence[TrajectoryRecord], calls: Sequence[ToolCallRecord], splits: Sequence[RolloutSplit]
) -> dict[str, float]:
    """The metrics of the module doc; {} when no trajectory was recorded (a single-turn rollout)."""
    if not trajectories:
        return {}
    metrics: dict[str, float] = {}
    for key, values in (
        ("num_turns", [t.turns for t in trajectories]),
        ("tool_call_counts", [t.tool_calls for t in trajectories]),
    ):
        metrics.update(
            {
                f"{key}/mean": sum(values) / len(values),
                f"{key}/max": float(max(values)),
                f"{key}/min": float(min(values)),
            }
        )
    metrics["tools/malformed_calls"] = float(sum(1 for c in calls if c.name == MALFORMED))
    for name in sorted({c.name for c in calls} - {MALFORMED}):
        mine = [c for c in calls if c.name == name]
        latencies = [c.seconds * 1e3 for c in mine]
        metrics[f"tools/{name}/calls"] = float(len(mine))
        metrics[f"tools/{name}/failures"] = float(sum(c.failed for c in mine))
        for q in (50, 90, 99):
            metrics[f"tools/{name}/latency_ms_p{q}"] = quantile(latencies, q / 100)
    total = sum(s.total_s for s in splits)
    if total > 0:
        metrics["rollout/generation_share"] = sum(s.generating_s for s in splits) / total
        metrics["rollout/tool_wait_share"] = sum(s.tool_wait_s for s in splits) / total
    slowest = max(trajectories, key=lambda t: t.seconds)
    metrics["rollout/slowest_trajectory/seconds"] = slowest.seconds
    metrics["rollout/slowest_trajectory/turns"] = float(slowest.turns)
    metrics["rollout/slowest_trajectory/tool_calls"] = float(slowest.tool_calls)
    metrics["rollout/slowest_trajectory/length"] = float(slowest.length)
    return metrics
