"""The ``rlprof`` command: summarise what a profiled run wrote.

rlprof summary SAVE_PATH          the files in SAVE_PATH/manifest.jsonl, by tool, step window and rank
rlprof nsys REPORT [--nsys PATH]  NVTX ranges of an nsys report (.nsys-rep or exported .sqlite) per role
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from rlprof.manifest import read_manifest


def summary(save_path: Path, console: Console) -> int:
    records = read_manifest(save_path)
    if not records:
        console.print(f"[yellow]no manifest.jsonl with records under {save_path}[/yellow]")
        return 1
    table = Table(title=f"rlprof outputs in {save_path}")
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


def nsys_ranges(report: Path, nsys: Optional[str], console: Console) -> int:
    from rlprof.analysis.nsys_report import export_sqlite, read_nvtx_ranges

    if report.suffix != ".sqlite":
        nsys = nsys or shutil.which("nsys")
        if nsys is None:
            console.print("[red]nsys not found: pass --nsys PATH (scripts/install_nsys.sh prints one)[/red]")
            return 2
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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="rlprof", description="Summarise what an rlprof-profiled run wrote.")
    commands = parser.add_subparsers(dest="command", required=True)
    p_summary = commands.add_parser("summary", help="list the files of a run (from its manifest.jsonl)")
    p_summary.add_argument("save_path", type=Path)
    p_nsys = commands.add_parser("nsys", help="NVTX ranges of an nsys report, per role")
    p_nsys.add_argument("report", type=Path)
    p_nsys.add_argument("--nsys", help="path of the nsys binary (default: on PATH)")
    args = parser.parse_args(argv)
    console = Console()
    if args.command == "summary":
        return summary(args.save_path, console)
    return nsys_ranges(args.report, args.nsys, console)


if __name__ == "__main__":
    sys.exit(main())
