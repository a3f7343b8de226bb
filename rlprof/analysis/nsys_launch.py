"""``rlprof nsys profile [nsys options] -- COMMAND ...``: run a command under Nsight Systems with the capture settings
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

import importlib.util
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from rlprof.config import load_config


class LaunchError(ValueError):
    """The command cannot be profiled as asked; one line says why."""


@dataclass
class CapturePlan:
    output: Path
    """Report path without extension (nsys adds ``.nsys-rep``; with repeat, ``.1``, ``.2``, ...)."""
    options: list[str]
    windows: list[tuple[int, int]]
    """(first, last) step of each window, when the selection is closed."""
    warnings: list[str] = field(default_factory=list)


def command_config(command: list[str]) -> Any:
    """The OmegaConf config the command will run with (see the module doc)."""
    base: Any = OmegaConf.create({})
    if "rlprof_train.main_ppo" in command:
        spec = importlib.util.find_spec("rlprof_train")
        if spec is not None and spec.submodule_search_locations:
            defaults = Path(next(iter(spec.submodule_search_locations))) / "config" / "ppo_trainer.yaml"
            if defaults.exists():
                base = OmegaConf.load(defaults)
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


def plan(command: list[str], nsys_options: list[str], cuda: bool) -> CapturePlan:
    """The capture settings for ``command`` (see the module doc)."""
    config = command_config(command)
    profiler = load_config(config)
    gp = profiler.global_profiler
    if gp.tool != "nsys":
        raise LaunchError(
            f"the command's global_profiler.tool is {gp.tool!r}, not 'nsys'; add global_profiler.tool=nsys to it"
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
    return CapturePlan(output, options, windows, warnings)


def reports(output: Path) -> list[Path]:
    """Reports nsys wrote for ``output`` (one, or numbered ones with repeat)."""
    found = sorted(output.parent.glob(f"{output.name}*.nsys-rep")) if output.parent.is_dir() else []
    return [p for p in found if p.name == f"{output.name}.nsys-rep" or p.name.startswith(f"{output.name}.")]


def run(nsys: str, command: list[str], capture: CapturePlan, timeout_s: Optional[float]) -> int:
    """Run the command under ``nsys profile`` with the plan's options; returns nsys's exit status."""
    capture.output.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([nsys, "profile", *capture.options, *command], check=False, timeout=timeout_s)
    return result.returncode


def captured_steps(sqlite: Path) -> set[int]:
    """Step numbers of the ``step N`` markers (category ``step``) the nsys tool wrote into a report."""
    from rlprof.analysis.nsys_report import read_nvtx_ranges

    steps = set()
    for r in read_nvtx_ranges(sqlite):
        if r.domain == "rlprof" and r.category == "step" and r.name.startswith("step "):
            number = r.name.split(" ", 1)[1]
            if number.isdigit():
                steps.add(int(number))
    return steps
