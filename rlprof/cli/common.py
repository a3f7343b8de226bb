"""What every subcommand shares: the one-line usage error, printing lines as they are, finding a run, and
:func:`emit`, which renders a result's document in the format the user asked for."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rich.console import Console

from rlprof.analysis.render.registry import Renderer, find_renderer, renderer_names

if TYPE_CHECKING:
    from rlprof.analysis.document import Document
    from rlprof.analysis.run import Run
    from rlprof.analysis.sources import ReadOptions


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit code 2."""


def say(console: Console, line: str) -> None:
    """One line as it is: no markup, no highlighting, never wrapped (tests and scripts grep for it)."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _renderer(spec: str) -> Renderer:
    """``--format``'s type: the renderer, found before any work (argparse reports the ``ValueError``'s text)."""
    try:
        return find_renderer(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_output_options(parser: argparse.ArgumentParser, html_help: Optional[str]) -> None:
    """``--format NAME`` (a registered renderer or ``module:function``) and, when ``html_help`` is given,
    ``--html FILE``."""
    names = ", ".join(renderer_names())
    parser.add_argument(
        "--format",
        type=_renderer,
        default="rich",
        metavar="NAME",
        help=f"{names}, or module:function (your own renderer: a document -> its text)",
    )
    if html_help is not None:
        parser.add_argument("--html", type=Path, help=html_help)


def emit(document: Document, args: argparse.Namespace, console: Console) -> int:
    """Show ``document`` with ``--format``'s renderer and write ``--html``; returns the document's exit code."""
    from rlprof.analysis.render import html

    shown: Renderer = args.format
    shown.write(document, console)
    page: Optional[Path] = getattr(args, "html", None)
    if page is not None:
        page.write_text(html.render(document), encoding="utf-8")
        if shown.to_console is not None:
            say(console, f"wrote {page}")
    return document.exit_code


def find_run(paths: list[Path], run_id: Optional[str], options: Optional[ReadOptions] = None) -> Run:
    """The run at ``paths``, or a usage error saying what was looked for."""
    from rlprof.analysis.run import RunNotFound
    from rlprof.analysis.run import find_run as discover

    try:
        run = discover(paths, run_id, options)
    except RunNotFound as exc:
        raise UsageError(str(exc)) from None
    if run.empty:
        notes = f" ({'; '.join(run.notes)})" if run.notes else ""
        raise UsageError(
            f"nothing to read in {', '.join(map(str, paths))}: no metrics.jsonl, run.json or usable "
            f"manifest.jsonl (a trainer's trainer.log_dir or an rlprof global_profiler.save_path){notes}"
        )
    return run


def nsys_binary(given: Optional[str]) -> str:
    """``--nsys PATH`` when it is an executable, else ``nsys`` on PATH."""
    if given is not None:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise UsageError(f"--nsys {given}: not an executable file")
        return given
    found = shutil.which("nsys")
    if found is None:
        raise UsageError("nsys not found: pass --nsys PATH (scripts/install_nsys.sh prints one)")
    return found
