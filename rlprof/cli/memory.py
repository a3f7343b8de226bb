"""``rlprof memory FILE``: a CUDA snapshot, an OOM snapshot, a host allocation timeline, a memray capture or an
RSS-per-range file, read offline."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from rlprof.cli.common import UsageError, add_output_options, emit

HELP = "read a memory file offline (CUDA/OOM snapshot, host timeline, memray capture, RSS per range)"
EXAMPLE = "rlprof memory outputs/profile/torch_memory/step3/rank0_pid123.pickle --html memory.html"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path)
    add_output_options(parser, "also write a self-contained page with the timeline")
    parser.add_argument("--top", type=int, default=10, help="allocation sites listed (default 10)")


def command(args: argparse.Namespace, console: Console) -> int:
    from rlprof.analysis.allocations import summarize
    from rlprof.analysis.render.memory_layout import rss_document, summary_document
    from rlprof.analysis.sources import InputFile, ReadOptions, SourceError, identify

    path: Path = args.file
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    found = identify(path)
    if found is None or found.category != "memory":
        raise UsageError(
            f"{path}: not a memory file rlprof reads (a CUDA snapshot .pickle, an OOM snapshot, a "
            "*.host_alloc.json.gz, a memray capture .bin or a *.host_memory.jsonl)"
        )
    try:
        read = found.read(InputFile(found.format, path), ReadOptions())
    except SourceError as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    if found.histories:
        document = summary_document([summarize(history, top=args.top) for history in read], str(path))
    else:  # a process's RSS per range
        document = rss_document(read)
    return emit(document, args, console)
