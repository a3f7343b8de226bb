"""The ``rlprof`` command: read runs back.

    rlprof report RUN [RUN ...]       where the step goes, what limits it, which knob to turn
    rlprof summary SAVE_PATH          the files in SAVE_PATH/manifest.jsonl, by tool, step window and rank
    rlprof nsys REPORT [--nsys PATH]  NVTX ranges of an nsys report (.nsys-rep or exported .sqlite) per role

Bad paths, empty runs and unreadable files give one line and exit code 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rich.console import Console
from rich.table import Table

from rlprof.manifest import read_manifest

if TYPE_CHECKING:
    from rlprof.analysis.run import Run

EXAMPLES = {
    "report": "rlprof report outputs/demo                       # a trainer run: its log folder and profile\n"
    "rlprof report outputs/demo --html report.html     # a self-contained page (no network needed)\n"
    "rlprof report node0/profile node1/profile --format json",
}


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit code 2."""


def summary(args: argparse.Namespace, console: Console) -> int:
    records = read_manifest(args.save_path)
    if not records:
        raise UsageError(f"no manifest.jsonl with records under {args.save_path}")
    table = Table(title=f"rlprof outputs in {args.save_path}")
    for column in ("tool", "steps", "rank", "role", "path", "size"):
        table.add_column(
            column,
            justify="right" if column in ("rank", "size") else "left",
            overflow="fold" if column == "path" else "ellipsis",
        )
    for r in records:
        steps = r["steps"]
        span = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        table.add_row(r["tool"], span, str(r["rank"]), r["role"] or "", r["path"], _size(r["bytes"]))
    console.print(table)
    return 0


def nsys_ranges(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.nsys_report import export_sqlite, read_nvtx_ranges

    report: Path = args.report
    if not report.exists():
        raise UsageError(f"{report}: no such file")
    if report.suffix != ".sqlite":
        nsys = args.nsys or shutil.which("nsys")
        if nsys is None:
            raise UsageError("nsys not found: pass --nsys PATH (scripts/install_nsys.sh prints one)")
        report = export_sqlite(nsys, report)
    totals: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in read_nvtx_ranges(report):
        if r.domain == "rlprof":
            totals[(r.category, r.name)].append(r.duration_ns)
    table = Table(title=f"NVTX ranges in {report.name} (domain rlprof)")
    for column in ("role", "range", "count", "total ms", "mean ms"):
        table.add_column(column, justify="left" if column in ("role", "range") else "right")
    for (role, name), durations in sorted(totals.items(), key=lambda item: -sum(item[1])):
        total = sum(durations) / 1e6
        table.add_row(role, name, str(len(durations)), f"{total:.3f}", f"{total / len(durations):.3f}")
    console.print(table)
    return 0


def report(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.render import console as console_renderer
    from rlprof.analysis.render import html, jsonout, markdown
    from rlprof.analysis.render.sections import sections
    from rlprof.analysis.report import ReportOptions, build_report

    run = _find_run(args.runs, args.run)
    result = build_report(
        run, ReportOptions(include_warmup=args.all_steps, memory_limit_gb=args.memory_limit_gb, top_ops=args.top)
    )
    layout = sections(result)
    if args.format == "json":
        print(jsonout.render(result))
    elif args.format == "md":
        print(markdown.render(layout), end="")
    else:
        console_renderer.render(layout, console)
    if args.html is not None:
        args.html.write_text(html.render(result, layout), encoding="utf-8")
        console.print(f"wrote {args.html}", highlight=False) if args.format == "rich" else None
    return 0


def _find_run(paths: list[Path], run_id: Optional[str]) -> Run:
    from rlprof.analysis.run import RunNotFound, find_run

    try:
        run = find_run(paths, run_id)
    except RunNotFound as exc:
        raise UsageError(str(exc)) from None
    if run.empty:
        raise UsageError(
            f"nothing to read in {', '.join(map(str, paths))}: no metrics.jsonl, run.json or "
            "manifest.jsonl (a trainer's trainer.log_dir or an rlprof global_profiler.save_path)"
        )
    return run


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlprof", description="Read what an rlprof-profiled run wrote.")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(
        name: str, help_text: str, handler: Callable[[argparse.Namespace, Console], int]
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=f"example:\n  {EXAMPLES[name]}" if name in EXAMPLES else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(handler=handler)
        return sub

    p_report = command("report", "diagnose a run: step breakdown, ranges and operators, memory, what to try", report)
    p_report.add_argument(
        "runs",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="a trainer log folder, an rlprof save_path, a metrics.jsonl, a trace, or a folder above",
    )
    p_report.add_argument("--format", choices=("rich", "md", "json"), default="rich")
    p_report.add_argument("--html", type=Path, help="also write a self-contained HTML page here")
    p_report.add_argument("--all-steps", action="store_true", help="include the warm-up steps in the statistics")
    p_report.add_argument("--memory-limit-gb", type=float, help="the memory-bound rule's limit (default: device total)")
    p_report.add_argument("--run", help="the run id to report when a save path holds several runs")
    p_report.add_argument("--top", type=int, default=5, help="operators listed per range (default 5)")
    p_summary = command("summary", "list the files of a run (from its manifest.jsonl)", summary)
    p_summary.add_argument("save_path", type=Path)
    p_nsys = command("nsys", "NVTX ranges of an nsys report, per role", nsys_ranges)
    p_nsys.add_argument("report", type=Path)
    p_nsys.add_argument("--nsys", help="path of the nsys binary (default: on PATH)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        code: int = args.handler(args, console)
        return code
    except UsageError as exc:
        print(f"rlprof {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
