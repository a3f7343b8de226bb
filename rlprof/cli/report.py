"""``rlprof report RUN [RUN ...]``: where the step goes, what limits it, which knob to turn."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from rich.console import Console

from rlprof.cli.common import UsageError, add_output_options, emit, find_run, nsys_binary

HELP = "diagnose a run: step breakdown, ranges and operators, memory, what to try"
EXAMPLE = (
    "rlprof report outputs/demo                       # a trainer run: its log folder and profile\n"
    "  rlprof report outputs/demo --html report.html     # a self-contained page (no network needed)\n"
    "  rlprof report node0/profile node1/profile --format json"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="a trainer log folder, an rlprof save_path, a metrics.jsonl, a trace, or a folder above",
    )
    add_output_options(parser, "also write a self-contained HTML page here")
    parser.add_argument("--all-steps", action="store_true", help="include the warm-up steps in the statistics")
    parser.add_argument("--memory-limit-gb", type=float, help="the memory-bound rule's limit (default: device total)")
    parser.add_argument("--run", help="the run id to report when a save path holds several runs")
    parser.add_argument("--top", type=int, default=5, help="operators listed per range (default 5)")
    parser.add_argument("--nsys", help="the nsys that exports .nsys-rep reports to SQLite (default: nsys on PATH)")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module of yours first (repeatable): the report sections, rules and sources it registers "
        "take part (docs/extending.md)",
    )


def import_plugin(module: str) -> None:
    """Import the user's ``module`` (found on ``PYTHONPATH``, as ``--format module:function`` is); an error inside it
    keeps its traceback (it is the user's code), a module that is not there is one line."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise
        raise UsageError(f"--plugin {module}: no module named {exc.name!r} on the PYTHONPATH") from None


def command(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.render.report_layout import document
    from rlprof.analysis.report import build_report
    from rlprof.analysis.report_model import ReportOptions
    from rlprof.analysis.sources import ReadOptions

    for module in args.plugin:
        import_plugin(module)
    found = find_run(args.runs, args.run, ReadOptions(nsys=nsys_binary(args.nsys) if args.nsys else None))
    options = ReportOptions(include_warmup=args.all_steps, memory_limit_gb=args.memory_limit_gb, top_ops=args.top)
    report = build_report(found, options)
    if report.unreadable and not (report.traces or report.breakdown or report.memory):
        raise UsageError(report.unreadable[0])  # nothing of the run could be read: say why, in one line
    return emit(document(report), args, console)
