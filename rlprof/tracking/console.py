"""``console`` backend: the seed's log lines, a periodic table of every metric and a progress bar (rich)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rlprof.metrics.dashboard_keys import KL_KEYS
from rlprof.tracking.base import Backend, BackendContext, first_present, register_backend

LOSS_KEYS = ("actor/pg_loss", "critic/vf_loss")
REWARD_KEYS = ("critic/rewards/mean", "critic/score/mean")


def step_line(metrics: Mapping[str, float], step: int, total_steps: Optional[int], total_epochs: Optional[int]) -> str:
    """``[INFO] Epoch 1/100 - Loss: 2.345, Reward: 0.123, KL: 0.045`` (the seed's line). The epoch comes from
    ``training/epoch`` when the total is known, else ``Step s/N``; values not logged are left out."""
    epoch = metrics.get("training/epoch")
    if epoch is not None and total_epochs:
        head = f"Epoch {int(epoch)}/{total_epochs} - Step {step}"
    else:
        head = f"Step {step}/{total_steps}" if total_steps else f"Step {step}"
    parts = []
    for label, keys in (("Loss", LOSS_KEYS), ("Reward", REWARD_KEYS), ("KL", KL_KEYS)):
        value = first_present(metrics, keys)
        if value is not None:
            parts.append(f"{label}: {value:.3f}")
    return f"[INFO] {head}" + (" - " + ", ".join(parts) if parts else "")


def detail_lines(metrics: Mapping[str, float]) -> list[str]:
    """The seed's ``[DEBUG]`` throughput and memory lines, from whichever metrics were logged."""
    lines = []
    if "perf/rollout_samples_per_s" in metrics:
        lines.append(f"[DEBUG] Rollout throughput: {metrics['perf/rollout_samples_per_s']:.0f} samples/sec")
    if "perf/throughput" in metrics:
        lines.append(f"[DEBUG] Throughput: {metrics['perf/throughput']:.0f} tokens/sec/device")
    if "perf/max_memory_reserved_gb" in metrics and "perf/device_memory_total_gb" in metrics:
        used, total = metrics["perf/max_memory_reserved_gb"], metrics["perf/device_memory_total_gb"]
        lines.append(f"[DEBUG] Memory usage: {used:.1f}GB/{total:.1f}GB ({100 * used / total:.1f}%)")
    elif "perf/cpu_memory_used_gb" in metrics and "perf/cpu_memory_total_gb" in metrics:
        used, total = metrics["perf/cpu_memory_used_gb"], metrics["perf/cpu_memory_total_gb"]
        lines.append(f"[DEBUG] Memory usage: {used:.1f}GB/{total:.1f}GB ({100 * used / total:.1f}%) host")
    return lines


def split_line(metrics: Mapping[str, float]) -> Optional[str]:
    """``[INFO] Step time: rollout 38% | training 52% | other 6% | unaccounted 4%`` from ``timing_share/*``."""
    parts = [
        f"{group} {100 * metrics[f'timing_share/{group}']:.0f}%"
        for group in ("rollout", "training", "other", "unaccounted")
        if f"timing_share/{group}" in metrics
    ]
    return "[INFO] Step time: " + " | ".join(parts) if parts else None


def metrics_table(metrics: Mapping[str, float], step: int) -> Table:
    table = Table(title=f"metrics at step {step}", show_lines=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in sorted(metrics):
        table.add_row(key, f"{metrics[key]:.6g}")
    return table


@register_backend("console")
class ConsoleBackend(Backend):
    """Per step: the seed's ``[INFO]`` line and ``[DEBUG]`` lines; every ``table_every`` steps (and the last) a
    table of all metrics and the step's time split (rollout / training / other / unaccounted, from
    ``timing_share/*``); with ``total_steps``, a progress bar with the time remaining."""

    def __init__(self, context: BackendContext) -> None:
        if context.table_every <= 0:
            raise ValueError(f"table_every={context.table_every} must be positive")
        self.console: Console = context.console or Console()
        self.total_steps = context.total_steps
        self.total_epochs = context.total_epochs
        self.table_every = context.table_every
        total_steps = self.total_steps
        self.progress: Optional[Progress] = None
        if total_steps:
            self.progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                auto_refresh=False,
                transient=False,
            )
            self.task = self.progress.add_task("training", total=total_steps)
            self.progress.start()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        print_line = self.console.print
        print_line(step_line(metrics, step, self.total_steps, self.total_epochs), markup=False, highlight=False)
        for line in detail_lines(metrics):
            print_line(line, markup=False, highlight=False)
        if step % self.table_every == 0 or (self.total_steps and step >= self.total_steps):
            print_line(metrics_table(metrics, step))
            split = split_line(metrics)
            if split:
                print_line(split, markup=False, highlight=False)
        if self.progress is not None:
            self.progress.update(self.task, completed=step)
            self.progress.refresh()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
