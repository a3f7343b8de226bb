"""The ``rlprof`` command: read runs back. One module per subcommand, each with ``HELP``, ``EXAMPLE``,
``add_arguments(parser)`` and ``command(args, console) -> exit code``:

    rlprof report RUN [RUN ...]       where the step goes, what limits it, which knob to turn
    rlprof compare RUN_A RUN_B ...    config diff, learning curves and speed with noise-aware verdicts
    rlprof compare OLD.json NEW.json  two pytest-benchmark files: regressions, and which rlprof role slowed
    rlprof view RUN [RUN ...]         TensorBoard over the runs' scalars and traces (loopback)
    rlprof memory FILE                a CUDA snapshot, OOM snapshot, host timeline or RSS file, offline
    rlprof nsys profile [opts] -- CMD run CMD under nsys with the capture settings its config implies
    rlprof nsys REPORT [--nsys PATH]  NVTX ranges of an nsys report (.nsys-rep or exported .sqlite) per role
    rlprof summary SAVE_PATH          the files in SAVE_PATH/manifest.jsonl, by tool, step window and rank
    rlprof timeline RUN [-o FILE]     every rank's and vLLM engine's torch trace in one trace, on one clock
    rlprof prometheus rules|dashboard|scrape   alert rules, a Grafana dashboard, a scrape configuration
    rlprof top RUN_LOG_DIR            a live view of a run from its folder: ranks, phases, breakdown, trends

Bad paths, empty runs and unreadable files give one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from rich.console import Console

from rlprof.cli import compare, memory, nsys, prometheus, report, summary, timeline, top, view
from rlprof.cli.common import UsageError

SUBCOMMANDS = {
    "report": report,
    "compare": compare,
    "view": view,
    "memory": memory,
    "summary": summary,
    "timeline": timeline,
    "nsys": nsys,
    "prometheus": prometheus,
    "top": top,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlprof",
        description="Read what an rlprof-profiled run wrote.",
        epilog="examples:\n" + "\n".join(f"  {m.EXAMPLE.splitlines()[0]}" for m in SUBCOMMANDS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        sub = commands.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            epilog=f"example:\n  {module.EXAMPLE}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(handler=module.command)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["nsys", "profile"]:  # rlprof nsys profile [its options] [nsys options] -- COMMAND
        rest = argv[2:]
        split = rest.index("--") if "--" in rest else len(rest)
        args, nsys_options = nsys.profile_parser().parse_known_args(rest[:split])
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
