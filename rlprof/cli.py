"""The ``rlprof`` command: read runs back.

    rlprof report RUN [RUN ...]       where the step goes, what limits it, which knob to turn
    rlprof compare RUN_A RUN_B ...    config diff, learning curves and speed with noise-aware verdicts
    rlprof compare OLD.json NEW.json  two pytest-benchmark files: regressions, and which rlprof role slowed
    rlprof view RUN [RUN ...]         TensorBoard over the runs' scalars and traces (loopback)
    rlprof memory FILE                a CUDA snapshot, OOM snapshot, host timeline or RSS file, offline
    rlprof nsys profile [opts] -- CMD run CMD under nsys with the capture settings its config implies
    rlprof nsys REPORT [--nsys PATH]  NVTX ranges of an nsys report (.nsys-rep or exported .sqlite) per role
    rlprof summary SAVE_PATH          the files in SAVE_PATH/manifest.jsonl, by tool, step window and rank

Bad paths, empty runs and unreadable files give one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
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
    "  rlprof report outputs/demo --html report.html     # a self-contained page (no network needed)\n"
    "  rlprof report node0/profile node1/profile --format json",
    "compare": "rlprof compare outputs/run_a outputs/run_b --target critic/score/mean=0.8 --html compare.html\n"
    "  rlprof compare .benchmarks/*/0001_base.json .benchmarks/*/0002_new.json --fail-above 1.2",
    "view": "rlprof view outputs/run_a outputs/run_b          # prints the URL; Ctrl-C stops it",
    "memory": "rlprof memory outputs/profile/torch_memory/step3/rank0_pid123.pickle --html memory.html",
    "nsys": "rlprof nsys profile -- python -m rlprof_train.main_ppo global_profiler.tool=nsys "
    "'global_profiler.steps=[2,3]'\n  rlprof nsys report.nsys-rep --nsys .nsys/nsys",
    "summary": "rlprof summary outputs/profile",
}


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit code 2."""


def summary(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.render.sections import human_bytes

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
        table.add_row(r["tool"], span, str(r["rank"]), r["role"] or "", r["path"], human_bytes(r["bytes"]))
    console.print(table)
    return 0


def nsys_ranges(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.nsys_report import export_sqlite, read_nvtx_ranges

    report: Path = args.report
    if not report.exists():
        raise UsageError(f"{report}: no such file")
    if report.suffix != ".sqlite":
        report = export_sqlite(_nsys_binary(args.nsys), report)
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
        if args.format == "rich":
            say(console, f"wrote {args.html}")
    return 0


def compare_runs(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis import compare as comparison
    from rlprof.analysis.bench_compare import is_benchmark_file
    from rlprof.analysis.render import console as console_renderer
    from rlprof.analysis.render import html, markdown
    from rlprof.analysis.render.compare_sections import charts, sections
    from rlprof.analysis.render.jsonout import to_data

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
    result = comparison.compare([_find_run([path], None) for path in args.runs], targets, args.smooth)
    layout = sections(result)
    if args.format == "json":
        print(json.dumps(to_data(result), indent=1, allow_nan=False))
    elif args.format == "md":
        print(markdown.render(layout), end="")
    else:
        console_renderer.render(layout, console)
    if args.html is not None:
        page = html.page(f"rlprof compare: {' vs '.join(result.runs)}", html.sections_html(layout, charts(result)))
        args.html.write_text(page, encoding="utf-8")
        if args.format == "rich":
            say(console, f"wrote {args.html}")
    return 0


def compare_benchmark_files(args: argparse.Namespace, console: Console) -> int:
    """``rlprof compare OLD.json NEW.json [--fail-above R]``: exit 1 when a benchmark regressed beyond R."""
    from rlprof.analysis import bench_compare
    from rlprof.analysis.render import console as console_renderer
    from rlprof.analysis.render import markdown
    from rlprof.analysis.render.bench_sections import sections
    from rlprof.analysis.render.jsonout import to_data

    if len(args.runs) != 2 or not all(bench_compare.is_benchmark_file(path) for path in args.runs):
        raise UsageError(f"pytest-benchmark files compare in pairs: OLD.json NEW.json (got {len(args.runs)} paths)")
    if args.target or args.html is not None:
        raise UsageError("--target and --html apply to runs, not to pytest-benchmark files")
    try:
        result = bench_compare.compare_benchmarks(args.runs[0], args.runs[1], args.fail_above)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.format == "json":
        print(json.dumps(to_data(result), indent=1, allow_nan=False))
    elif args.format == "md":
        print(markdown.render(sections(result)), end="")
    else:
        console_renderer.render(sections(result), console)
    return 1 if result.regressed else 0


def view(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.view import LOOPBACK, serve, tensorboard_binary

    try:
        tensorboard_binary()
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if args.host not in LOOPBACK:
        say(console, f"serving on {args.host}: anyone who can reach this host can read these runs")
    runs = [_find_run([path], None) for path in args.runs]
    return serve(runs, args.host, args.port, lambda line: say(console, line))


def memory(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.memory import MemoryFileError, read_history, summarize
    from rlprof.analysis.render import console as console_renderer
    from rlprof.analysis.render import html, markdown
    from rlprof.analysis.render.jsonout import to_data
    from rlprof.analysis.render.memory_sections import rss_chart, rss_sections, summary_sections

    path: Path = args.file
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    charts: list[str] = []
    data: object
    try:
        if path.name.endswith(".host_memory.jsonl"):
            layout = rss_sections(path)
            data = {"file": str(path), "sections": [s.__dict__ for s in layout]}
            charts = rss_chart(path) if args.html else []
        elif path.suffix == ".pickle" or path.name.endswith(".host_alloc.json.gz"):
            summary = summarize(read_history(path), top=args.top)
            layout = summary_sections(summary, oom=path.name.startswith("oom_"))
            data = summary
            charts = html.timeline_charts(summary) if args.html else []
        else:
            raise UsageError(
                f"{path}: not a memory file rlprof reads (a snapshot .pickle, an OOM snapshot, a "
                "*.host_alloc.json.gz or a *.host_memory.jsonl)"
            )
    except (MemoryFileError, ValueError, KeyError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    if args.format == "json":
        print(json.dumps(to_data(data), indent=1, allow_nan=False, default=lambda o: o.__dict__))
    elif args.format == "md":
        print(markdown.render(layout), end="")
    else:
        console_renderer.render(layout, console)
    if args.html is not None:
        args.html.write_text(
            html.page(
                f"rlprof memory: {path.name}",
                html.sections_html(layout, {"Memory": charts, "Host memory (RSS) per range": charts}),
            ),
            encoding="utf-8",
        )
        if args.format == "rich":
            say(console, f"wrote {args.html}")
    return 0


def nsys_profile(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis import nsys_launch
    from rlprof.analysis.nsys_report import export_sqlite

    if not args.target:
        raise UsageError("give the command after --, e.g. rlprof nsys profile -- python train.py ...")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    try:
        capture = nsys_launch.plan(args.target, args.nsys_options, cuda)
    except (nsys_launch.LaunchError, ValueError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    nsys = _nsys_binary(args.nsys)
    for warning in capture.warnings:
        say(console, f"warning: {warning}")
    say(console, f"nsys profile {' '.join(capture.options)} {' '.join(args.target)}")
    status = nsys_launch.run(nsys, args.target, capture, args.timeout)
    written = nsys_launch.reports(capture.output)
    if not written:
        raise UsageError(f"nsys wrote no report at {capture.output}.nsys-rep (exit status {status})")
    say(console, "reports: " + ", ".join(map(str, written)))
    if status != 0:
        say(console, f"warning: nsys (and the command under it) ended with exit status {status}")
    captured: set[int] = set()
    for report in written:
        sqlite = export_sqlite(nsys, report)
        captured |= nsys_launch.captured_steps(sqlite)
        nsys_ranges(argparse.Namespace(report=sqlite, nsys=nsys), console)
    expected = {step for first, last in capture.windows for step in range(first, last + 1)}
    say(
        console,
        f"steps captured: {', '.join(map(str, sorted(captured))) or 'none'}"
        + (f" (configured: {', '.join(map(str, sorted(expected)))})" if expected else ""),
    )
    if expected - captured:
        say(
            console,
            f"warning: {len(capture.windows)} window(s) configured, but steps "
            f"{sorted(expected - captured)} are not in the report(s)",
        )
    return status


def _nsys_binary(given: Optional[str]) -> str:
    """``--nsys PATH`` when it is an executable, else ``nsys`` on PATH."""
    if given is not None:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise UsageError(f"--nsys {given}: not an executable file")
        return given
    found = shutil.which("nsys")
    if found is None:
        raise UsageError("nsys not found: pass --nsys PATH (scripts/install_nsys.sh prints one)")
    return found


def say(console: Console, line: str) -> None:
    """One line as it is: no markup, no highlighting, never wrapped (tests and scripts grep for it)."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: declarations only, one block per subcommand read top to bottom (its length is the CLI's
    surface; splitting it would scatter that)."""
    parser = argparse.ArgumentParser(
        prog="rlprof",
        description="Read what an rlprof-profiled run wrote.",
        epilog="examples:\n" + "\n".join(f"  {EXAMPLES[name].splitlines()[0]}" for name in EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    p_compare = command("compare", "compare runs: config diff, learning curves, speed with intervals", compare_runs)
    p_compare.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="as for report; the first is the baseline")
    p_compare.add_argument(
        "--target",
        action="append",
        metavar="METRIC=VALUE",
        help="report the step where each run's smoothed METRIC first reaches VALUE",
    )
    p_compare.add_argument("--smooth", type=int, default=10, help="moving-average window for targets and bests")
    p_compare.add_argument("--format", choices=("rich", "md", "json"), default="rich")
    p_compare.add_argument("--html", type=Path, help="also write a self-contained page with overlaid curves")
    p_compare.add_argument(
        "--fail-above",
        type=float,
        metavar="RATIO",
        help="with two pytest-benchmark files (OLD.json NEW.json): exit 1 when a benchmark's median, or a ratio it "
        "stored in extra_info, grew more than RATIO times (e.g. 1.2)",
    )
    p_view = command("view", "TensorBoard over the runs' scalars and torch traces", view)
    p_view.add_argument("runs", type=Path, nargs="+", metavar="RUN")
    p_view.add_argument("--port", type=int, help="default: a free port")
    p_view.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1; another host exposes the runs")
    p_memory = command("memory", "read a memory file offline (CUDA/OOM snapshot, host timeline, RSS per range)", memory)
    p_memory.add_argument("file", type=Path)
    p_memory.add_argument("--format", choices=("rich", "md", "json"), default="rich")
    p_memory.add_argument("--html", type=Path, help="also write a self-contained page with the timeline")
    p_memory.add_argument("--top", type=int, default=10, help="allocation sites listed (default 10)")
    p_summary = command("summary", "list the files of a run (from its manifest.jsonl)", summary)
    p_summary.add_argument("save_path", type=Path)
    p_nsys = command("nsys", "NVTX ranges of an nsys report per role (or: nsys profile -- COMMAND)", nsys_ranges)
    p_nsys.add_argument("report", type=Path)
    p_nsys.add_argument("--nsys", help="path of the nsys binary (default: on PATH)")
    return parser


def nsys_profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlprof nsys profile",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run COMMAND under nsys profile with the capture settings its rlprof config implies, then list "
        "the reports, warn about windows not captured and print the NVTX ranges per role.",
        epilog=f"example:\n  {EXAMPLES['nsys'].splitlines()[0]}",
    )
    parser.add_argument("--nsys", help="path of the nsys binary (default: on PATH)")
    parser.add_argument("--timeout", type=float, help="stop nsys after this many seconds")
    parser.set_defaults(handler=nsys_profile, command="nsys profile")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["nsys", "profile"]:  # rlprof nsys profile [its options] [nsys options] -- COMMAND
        rest = argv[2:]
        split = rest.index("--") if "--" in rest else len(rest)
        args, nsys_options = nsys_profile_parser().parse_known_args(rest[:split])
        args.nsys_options, args.target = nsys_options, rest[split + 1 :]
    else:
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
