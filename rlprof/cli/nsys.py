"""``rlprof nsys REPORT``: the NVTX ranges of an nsys report (.nsys-rep or exported .sqlite) per role; and
``rlprof nsys profile [nsys options] -- COMMAND ...``: run a command under Nsight Systems with the capture settings
its own profiler config implies, then check what was captured.

The command's config is read the way it will read it: its ``key=value`` overrides (OmegaConf dotlist) over its
``--config FILE`` and, for ``rlprof_train.main_ppo``, the trainer's defaults. From ``global_profiler`` come the
windows: with CUDA, ``--capture-range=cudaProfilerApi --capture-range-end=repeat:N`` with N the number of windows
(each window is one cudaProfilerStart/Stop pair; ``repeat`` alone when the count is open-ended or capture is
per range); without CUDA no capture range (nothing would start it) and ``--sample=none --cpuctxsw=none`` (without
them Debian's nsys 2022.4 can hang). Windows that cannot happen (steps past ``trainer.total_training_steps``) are
reported before nsys starts; after it, the reports written and the windows whose step markers are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from rlprof.cli.common import UsageError, nsys_binary, say
from rlprof.config import load_config
from rlprof.manifest import Manifest
from rlprof.session import new_run_id
from rlprof.tools import tool_spec, tool_specs

HELP = "NVTX ranges of an nsys report per role (or: nsys profile -- COMMAND)"
EXAMPLE = (
    "rlprof nsys profile -- python -m rlprof_train.main_ppo global_profiler.tool=nsys "
    "'global_profiler.steps=[2,3]'\n  rlprof nsys report.nsys-rep --nsys .nsys/nsys"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", type=Path)
    parser.add_argument("--nsys", help="path of the nsys binary (default: on PATH)")


def command(args: argparse.Namespace, console: Console) -> int:
    """``rlprof nsys REPORT``: the NVTX ranges of domain rlprof per role and name."""
    from rlprof.analysis.sources.nsys_report import export_sqlite, range_totals, read_nvtx_ranges

    report: Path = args.report
    if not report.exists():
        raise UsageError(f"{report}: no such file")
    if report.suffix != ".sqlite":
        report = export_sqlite(nsys_binary(args.nsys), report)
    table = Table(title=f"NVTX ranges in {report.name} (domain rlprof)")
    for column in ("role", "range", "count", "total ms", "mean ms"):
        table.add_column(column, justify="left" if column in ("role", "range") else "right")
    for totals in range_totals(read_nvtx_ranges(report)):
        total = totals.total_ns / 1e6
        table.add_row(totals.role, totals.name, str(totals.count), f"{total:.3f}", f"{total / totals.count:.3f}")
    console.print(table)
    return 0


def profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlprof nsys profile",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run COMMAND under nsys profile with the capture settings its rlprof config implies, then list "
        "the reports, warn about windows not captured and print the NVTX ranges per role.",
        epilog=f"example:\n  {EXAMPLE.splitlines()[0]}",
    )
    parser.add_argument("--nsys", help="path of the nsys binary (default: on PATH)")
    parser.add_argument("--timeout", type=float, help="stop nsys after this many seconds")
    parser.set_defaults(handler=profile_command, command="nsys profile")
    return parser


def profile_command(args: argparse.Namespace, console: Console) -> int:
    """``rlprof nsys profile [opts] -- COMMAND``."""
    from rlprof.analysis.sources.nsys_report import export_sqlite

    if not args.target:
        raise UsageError("give the command after --, e.g. rlprof nsys profile -- python train.py ...")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    try:
        capture = plan(args.target, args.nsys_options, cuda)
    except (LaunchError, ValueError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    nsys = nsys_binary(args.nsys)
    for warning in capture.warnings:
        say(console, f"warning: {warning}")
    say(console, f"nsys profile {' '.join(capture.options)} {' '.join(args.target)}")
    run_id = os.environ.get("RLPROF_RUN_ID") or new_run_id()
    status = run(nsys, args.target, capture, args.timeout, run_id)
    written = reports(capture.output)
    if not written:
        raise UsageError(f"nsys wrote no report at {capture.output}.nsys-rep (exit status {status})")
    say(console, "reports: " + ", ".join(map(str, written)))
    if status != 0:
        say(console, f"warning: nsys (and the command under it) ended with exit status {status}")
    captured: set[int] = set()
    for report in written:
        sqlite = export_sqlite(nsys, report)
        captured |= captured_steps(sqlite)
        command(argparse.Namespace(report=sqlite, nsys=nsys), console)
    for line in list_reports(capture, written, captured, run_id):
        say(console, f"warning: {line}")
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


# --------------------------------------------------------------------------------------------- the capture plan


class LaunchError(ValueError):
    """The command cannot be profiled as asked; one line says why."""


@dataclass
class CapturePlan:
    output: Path
    """Report path without extension (nsys adds ``.nsys-rep``; with repeat, ``.1``, ``.2``, ...)."""
    options: list[str]
    windows: list[tuple[int, int]]
    """(first, last) step of each window, when the selection is closed."""
    save_path: Path = Path("outputs/profile")
    """The command's ``global_profiler.save_path``: its manifest lists the reports."""
    warnings: list[str] = field(default_factory=list)


def command_config(command: list[str]) -> Any:
    """The OmegaConf config the command will run with (see the module doc)."""
    base: Any = OmegaConf.create({})
    if "rlprof_train.main_ppo" in command:
        spec = importlib.util.find_spec("rlprof_train")
        if spec is not None and spec.submodule_search_locations:
            shipped = Path(next(iter(spec.submodule_search_locations))) / "config"
            if (shipped / "ppo_trainer.yaml").exists():
                base = OmegaConf.load(shipped / "ppo_trainer.yaml")
            named = _hydra_config(command, shipped)
            if named is not None:
                tree = OmegaConf.to_container(OmegaConf.load(named))
                if isinstance(tree, dict):
                    settings = {k: v for k, v in tree.items() if k not in ("hydra", "defaults")}
                    base = OmegaConf.merge(base, OmegaConf.create(settings))
    if "--config" in command:
        index = command.index("--config")
        if index + 1 >= len(command):
            raise LaunchError("--config in the command has no file after it")
        base = OmegaConf.merge(base, OmegaConf.load(command[index + 1]))
    overrides = [
        token.removeprefix("+")
        for token in command
        if "=" in token and not token.startswith("-") and "." in token.split("=", 1)[0]
    ]
    return OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))


def _hydra_config(command: list[str], shipped: Path) -> Optional[Path]:
    """The trainer's ``--config-path DIR --config-name NAME`` file (``--config-name`` alone: a shipped config)."""
    values: dict[str, str] = {}
    for i, token in enumerate(command):
        option, has_value, value = token.partition("=")
        if option in ("--config-path", "--config-name"):
            values[option] = value if has_value else (command[i + 1] if i + 1 < len(command) else "")
    name = values.get("--config-name")
    if not name:
        return None
    folder = Path(values["--config-path"]).expanduser() if "--config-path" in values else shipped
    file = folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if not file.is_file():
        raise LaunchError(f"--config-name={name} in the command: no such file {file}")
    return file


def plan(command: list[str], nsys_options: list[str], cuda: bool) -> CapturePlan:
    """The capture settings for ``command`` (see the module doc)."""
    config = command_config(command)
    profiler = load_config(config)
    gp = profiler.global_profiler
    if gp.tool is None or tool_spec(gp.tool).launcher != "nsys":
        under = [spec.name for spec in tool_specs() if spec.launcher == "nsys"]
        raise LaunchError(
            f"the command's global_profiler.tool is {gp.tool!r}, which records without nsys; rlprof nsys runs "
            f"{' or '.join(under)}: add global_profiler.tool={under[0]} to it"
        )
    selection = profiler.step_selection()
    windows = selection.windows()
    discrete = bool(gp.global_tool_config.nsys.discrete)
    warnings = []
    total = OmegaConf.select(config, "trainer.total_training_steps", default=None)
    if isinstance(total, int):
        beyond = [w for w in windows if w[0] > total]
        if beyond:
            warnings.append(
                f"window(s) {', '.join(f'{a}-{b}' if a != b else str(a) for a, b in beyond)} start after "
                f"trainer.total_training_steps={total}: they will never be captured"
            )
        if selection.steps is None and selection.start is not None and selection.start > total:
            warnings.append(f"the window starts at step {selection.start}, after trainer.total_training_steps={total}")
    output = Path(gp.save_path) / "nsys" / "report"
    options = list(nsys_options)
    if not any(o in ("-o", "--output") or o.startswith("--output=") for o in options):
        options += ["-o", str(output)]
    else:
        index = next(i for i, o in enumerate(options) if o in ("-o", "--output") or o.startswith("--output="))
        output = Path(options[index].split("=", 1)[1] if "=" in options[index] else options[index + 1])
    if not any(o.startswith(("-t", "--trace")) for o in options):
        options += ["-t", "cuda,nvtx,osrt" if cuda else "nvtx,osrt"]
    if cuda:
        repeat = "repeat" if discrete or not windows else f"repeat:{len(windows)}"
        options += ["--capture-range=cudaProfilerApi", f"--capture-range-end={repeat}"]
    else:
        options += ["--sample=none", "--cpuctxsw=none"]
    options += ["--force-overwrite=true"]
    return CapturePlan(output, options, windows, Path(gp.save_path), warnings)


def reports(output: Path) -> list[Path]:
    """Reports nsys wrote for ``output`` (one, or numbered ones with repeat)."""
    found = sorted(output.parent.glob(f"{output.name}*.nsys-rep")) if output.parent.is_dir() else []
    return [p for p in found if p.name == f"{output.name}.nsys-rep" or p.name.startswith(f"{output.name}.")]


def run(nsys: str, command: list[str], capture: CapturePlan, timeout_s: Optional[float], run_id: str) -> int:
    """Run the command under ``nsys profile`` with the plan's options, its rlprof run id set to ``run_id``; returns
    nsys's exit status."""
    capture.output.parent.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "RLPROF_RUN_ID": run_id}
    result = subprocess.run(
        [nsys, "profile", *capture.options, *command], check=False, timeout=timeout_s, env=environment
    )
    return result.returncode


def list_reports(capture: CapturePlan, reports: list[Path], steps: set[int], run_id: str) -> list[str]:
    """Write each report into the save path's manifest (format ``nsys_report``, the captured steps, the run id), so
    ``rlprof report SAVE_PATH`` finds it; returns a line for each report that lies outside the save path."""
    manifest = Manifest(capture.save_path, run=run_id)
    outside = []
    for report in reports:
        if not report.resolve().is_relative_to(capture.save_path.resolve()):
            outside.append(
                f"{report} is outside {capture.save_path}: not listed in its manifest (rlprof report {report})"
            )
            continue
        manifest.record("nsys", report, steps=sorted(steps), rank=0, format="nsys_report")
    return outside


def captured_steps(sqlite: Path) -> set[int]:
    """Step numbers of the ``step N`` markers (category ``step``) the nsys tool wrote into a report."""
    from rlprof.analysis.sources.nsys_report import read_nvtx_ranges

    steps = set()
    for r in read_nvtx_ranges(sqlite):
        if r.domain == "rlprof" and r.category == "step" and r.name.startswith("step "):
            number = r.name.split(" ", 1)[1]
            if number.isdigit():
                steps.add(int(number))
    return steps
