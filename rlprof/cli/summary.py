"""``rlprof summary SAVE_PATH``: the files in ``SAVE_PATH/manifest.jsonl``, by tool, step window and rank."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rlprof.cli.common import UsageError
from rlprof.manifest import read_manifest

HELP = "list the files of a run (from its manifest.jsonl)"
EXAMPLE = "rlprof summary outputs/profile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("save_path", type=Path)


def command(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.render.units import human_bytes

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
