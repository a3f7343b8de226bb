"""``rlprof summary SAVE_PATH``: the files in ``SAVE_PATH/manifest.jsonl``, by tool, step window and rank."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeGuard

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
    skipped = 0
    for r in records:
        path = r.get("path")
        if not isinstance(path, str) or not path:
            skipped += 1  # a line anyone may have written: listed only when it names a file
            continue
        steps = [s for s in r.get("steps") or () if _integer(s)] if isinstance(r.get("steps"), list) else []
        span = "" if not steps else f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        rank, role, size = r.get("rank"), r.get("role"), r.get("bytes")
        table.add_row(
            str(r.get("tool", "")),
            span,
            str(rank) if _integer(rank) else "",
            role if isinstance(role, str) else "",
            path,
            human_bytes(size) if _integer(size) else "",
        )
    console.print(table)
    if skipped:
        console.print(f"{skipped} manifest lines were skipped (no file path)")
    return 0


def _integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
