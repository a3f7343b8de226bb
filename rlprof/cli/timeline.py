"""``rlprof timeline RUN [RUN ...] [-o FILE] [--step N]``: the run's torch traces -- every rank's trainer and vLLM
engine -- merged into one Chrome trace on one clock (see :mod:`rlprof.analysis.timeline`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from rlprof.cli.common import UsageError, find_run, say

HELP = "every rank's and vLLM engine's torch trace in one Chrome trace, on one clock"
EXAMPLE = "rlprof timeline outputs/demo -o merged.pt.trace.json.gz    # open in ui.perfetto.dev or rlprof view"
DEFAULT_OUTPUT = Path("timeline.pt.trace.json.gz")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN")
    parser.add_argument(
        "-o", "--output", type=Path, default=DEFAULT_OUTPUT, help=f"default {DEFAULT_OUTPUT} (.gz: gzipped)"
    )
    parser.add_argument("--step", type=int, help="only the step window holding this step (default: every window)")
    parser.add_argument("--run", help="the run id to merge when a save path holds several runs")


def command(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.timeline import TimelineError, merge

    run = find_run(args.runs, args.run)
    try:
        timeline = merge(run, args.output, args.step)
    except TimelineError as exc:
        raise UsageError(str(exc)) from None
    say(console, f"{timeline.output}: {timeline.events:,} events of {len(timeline.lanes)} traces")
    for lane in timeline.lanes:
        clock = "" if lane.placed else " (own clock: placed at 0)"
        say(console, f"  {lane.label}: {lane.events:,} events from {lane.file.path}{clock}")
    if timeline.steps:
        say(console, f"steps marked: {', '.join(str(n) for n in sorted(timeline.steps))}")
    if timeline.pipeline_lanes:
        say(
            console,
            f"pipeline records of {timeline.pipeline_lanes} processes, {timeline.sample_lives:,} prompts followed "
            "from sampling to update (lane: sample lives)",
        )
    if timeline.flows:
        say(console, f"arrows from trainer rollout ranges to the engine's work: {timeline.flows}")
    hosts = {lane.host for lane in timeline.lanes}
    if len(hosts) <= 1:
        say(console, "clocks: one host, one clock")
    for host, skew in timeline.skew_us.items():
        measured = (
            f"{skew / 1000:+.3f} ms (median collective end vs the first host)"
            if skew is not None
            else ("not measured (no collective in common)")
        )
        say(console, f"clock skew of {host}: {measured}; not corrected")
    for note in timeline.notes:
        say(console, f"note: {note}")
    say(console, "open it in https://ui.perfetto.dev, chrome://tracing, or: rlprof view " + str(timeline.output))
    return 0
