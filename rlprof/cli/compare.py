"""``rlprof compare RUN_A RUN_B ...`` (config diff, learning curves, speed with noise-aware verdicts) and
``rlprof compare OLD.json NEW.json`` (two pytest-benchmark files: regressions, and which rlprof role slowed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from rlprof.cli.common import UsageError, add_output_options, emit, find_run

HELP = "compare runs: config diff, learning curves, speed with intervals"
EXAMPLE = (
    "rlprof compare outputs/run_a outputs/run_b --target critic/score/mean=0.8 --html compare.html\n"
    "  rlprof compare .benchmarks/*/0001_base.json .benchmarks/*/0002_new.json --fail-above 1.2"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="as for report; the first is the baseline")
    parser.add_argument(
        "--target",
        action="append",
        metavar="METRIC=VALUE",
        help="report the step where each run's smoothed METRIC first reaches VALUE",
    )
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window for targets and bests")
    add_output_options(parser, "also write a self-contained page with overlaid curves")
    parser.add_argument(
        "--fail-above",
        type=float,
        metavar="RATIO",
        help="with two pytest-benchmark files (OLD.json NEW.json): exit 1 when a benchmark's median, or a ratio it "
        "stored in extra_info, grew more than RATIO times (e.g. 1.2)",
    )


def command(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis import compare as comparison
    from rlprof.analysis.bench_compare import is_benchmark_file
    from rlprof.analysis.render.compare_layout import document

    if len(args.runs) < 2:
        raise UsageError("give at least two runs to compare")
    if any(is_benchmark_file(path) for path in args.runs):
        return compare_benchmark_files(args, console)
    if args.fail_above is not None:
        raise UsageError("--fail-above applies to pytest-benchmark JSON files (OLD.json NEW.json)")
    targets = {}
    for target in args.target or []:
        key, _, value = target.partition("=")
        try:
            targets[key] = float(value)
        except ValueError:
            raise UsageError(f"--target {target!r}: expected METRIC=NUMBER, e.g. critic/score/mean=0.8") from None
    result = comparison.compare([find_run([path], None) for path in args.runs], targets, args.smooth)
    return emit(document(result), args, console)


def compare_benchmark_files(args: argparse.Namespace, console: Console) -> int:
    """``rlprof compare OLD.json NEW.json [--fail-above R]``: exit 1 when a benchmark regressed beyond R."""
    from rlprof.analysis import bench_compare
    from rlprof.analysis.render.bench_layout import document

    if len(args.runs) != 2 or not all(bench_compare.is_benchmark_file(path) for path in args.runs):
        raise UsageError(f"pytest-benchmark files compare in pairs: OLD.json NEW.json (got {len(args.runs)} paths)")
    if args.target or args.html is not None:
        raise UsageError("--target and --html apply to runs, not to pytest-benchmark files")
    try:
        result = bench_compare.compare_benchmarks(args.runs[0], args.runs[1], args.fail_above)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return emit(document(result), args, console)
