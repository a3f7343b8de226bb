"""Find what a run holds: metrics, the saved config and run record, and every file the profiler wrote.

A run is named by one or more paths: a trainer's ``trainer.log_dir`` (``run.json``, ``config.yaml``,
``metrics.jsonl``), an rlprof ``save_path`` (``manifest.jsonl``), a ``metrics.jsonl`` or a trace file, or a folder
above them (``outputs/demo`` holding ``logs/`` and ``profile/``). Several paths make one run: the save paths of two
nodes, or a log folder and a save path elsewhere. Every subcommand of ``rlprof`` starts from the :class:`Run`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from rlprof.manifest import FILE_NAME as MANIFEST
from rlprof.manifest import read_manifest

METRICS = "metrics.jsonl"
RUN_RECORD = "run.json"
CONFIG = "config.yaml"
SEARCH_DEPTH = 3
SKIPPED_FOLDERS = ("previous", ".git", "wandb", "models")


class RunNotFound(ValueError):
    """Nothing readable at the given paths; the message says what was looked for."""


@dataclass(frozen=True)
class OutputFile:
    """One file listed in a manifest."""

    tool: str
    path: Path
    steps: tuple[int, ...]
    rank: int
    window: Optional[int]
    role: Optional[str]
    host: Optional[str]
    bytes: int
    oom: bool = False

    @property
    def window_name(self) -> str:
        steps = self.steps
        return f"step{steps[0]}" if len(steps) == 1 else f"step{steps[0]}-{steps[-1]}" if steps else "?"


@dataclass
class Run:
    """Everything found for one run."""

    name: str
    metrics_path: Optional[Path] = None
    config: Optional[dict[str, Any]] = None
    record: Optional[dict[str, Any]] = None
    run_id: Optional[str] = None
    save_paths: list[Path] = field(default_factory=list)
    files: list[OutputFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was chosen or skipped while finding the run (one line each)."""

    def outputs(self, tool: str) -> list[OutputFile]:
        return [f for f in self.files if f.tool == tool]

    @property
    def traces(self) -> list[OutputFile]:
        return self.outputs("torch")

    @property
    def host_memory(self) -> list[OutputFile]:
        return [f for f in self.outputs("torch_memory") if f.path.name.endswith(".host_memory.jsonl")]

    @property
    def host_allocations(self) -> list[OutputFile]:
        return [f for f in self.outputs("torch_memory") if f.path.name.endswith(".host_alloc.json.gz")]

    @property
    def snapshots(self) -> list[OutputFile]:
        return [f for f in self.outputs("torch_memory") if f.path.suffix == ".pickle"]

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A value of the saved trainer config (``config.yaml``) by dotted key, or ``default``."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def empty(self) -> bool:
        return self.metrics_path is None and not self.files


def find_run(paths: list[Path], run_id: Optional[str] = None) -> Run:
    """The :class:`Run` at ``paths`` (see the module doc); ``run_id`` picks one run of a shared save path."""
    logs: list[Path] = []
    save_paths: list[Path] = []
    loose: list[Path] = []
    for path in paths:
        if not path.exists():
            raise RunNotFound(f"{path}: no such file or directory")
        found_logs, found_saves, found_loose = _discover(path)
        logs += found_logs
        save_paths += found_saves
        loose += found_loose
    run = Run(name=", ".join(str(p) for p in paths))
    log_dir = _choose_log_dir(run, logs)
    if log_dir is not None:
        run.metrics_path = log_dir / METRICS if (log_dir / METRICS).exists() else None
        run.config = _read_yaml(log_dir / CONFIG, run)
        run.record = _read_json(log_dir / RUN_RECORD, run)
        if run.record:
            run.run_id = run.record.get("run_id")
            recorded = run.record.get("profile_save_path")
            if recorded and (Path(recorded) / MANIFEST).exists():
                save_paths.append(Path(recorded))
    for path in loose:
        if path.name.endswith(".jsonl") and run.metrics_path is None:
            run.metrics_path = path
        elif ".pt.trace.json" in path.name:
            run.files.append(OutputFile("torch", path, (), 0, None, None, None, path.stat().st_size))
        elif path.suffix == ".pickle":
            run.files.append(
                OutputFile(
                    "torch_memory", path, (), 0, None, None, None, path.stat().st_size, oom=path.name.startswith("oom_")
                )
            )
    run.save_paths = list(dict.fromkeys(p.resolve() for p in save_paths))
    _read_outputs(run, run_id)
    return run


def _discover(path: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(log folders, save paths, loose files) at or below ``path``."""
    if path.is_file():
        if path.name == MANIFEST:
            return [], [path.parent], []
        if path.name == RUN_RECORD:
            return [path.parent], [], []
        return [], [], [path]
    logs, saves = [], []
    for folder in _folders(path, SEARCH_DEPTH):
        if (folder / RUN_RECORD).exists() or (folder / METRICS).exists():
            logs.append(folder)
        if (folder / MANIFEST).exists():
            saves.append(folder)
    return logs, saves, []


def _folders(root: Path, depth: int) -> list[Path]:
    found = [root]
    if depth > 0:
        for child in sorted(root.iterdir()):
            if (
                child.is_dir()
                and not child.name.startswith(".")
                and child.name not in SKIPPED_FOLDERS
                and not child.name.startswith("previous-")
            ):
                found += _folders(child, depth - 1)
    return found


def _choose_log_dir(run: Run, logs: list[Path]) -> Optional[Path]:
    unique = list(dict.fromkeys(p.resolve() for p in logs))
    if len(unique) > 1:
        newest = max(
            unique, key=lambda p: max((p / n).stat().st_mtime for n in (METRICS, RUN_RECORD) if (p / n).exists())
        )
        run.notes.append(
            f"{len(unique)} trainer log folders found; reporting the newest, {newest} (name one folder to choose)"
        )
        return newest
    return unique[0] if unique else None


def _read_json(path: Path, run: Run) -> Optional[dict[str, Any]]:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        run.notes.append(f"{path} is not valid JSON; skipped")
        return None
    return data if isinstance(data, dict) else None


def _read_yaml(path: Path, run: Run) -> Optional[dict[str, Any]]:
    if not path.exists():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        run.notes.append(f"{path} is not valid YAML; skipped")
        return None
    return data if isinstance(data, dict) else None


def _read_outputs(run: Run, run_id: Optional[str]) -> None:
    """The manifest lines of the chosen run from every save path."""
    sessions = [s for path in run.save_paths for s in read_manifest(path, kind="session")]
    entries = [(path, e) for path in run.save_paths for e in read_manifest(path)]
    runs: set[str] = {str(r) for r in [e.get("run") for _, e in entries] + [s.get("run") for s in sessions] if r}
    chosen = run_id or run.run_id
    if chosen is not None and chosen not in runs and runs:
        if run_id is not None:
            raise RunNotFound(
                f"--run {run_id}: no such run in {', '.join(map(str, run.save_paths))}; runs there: "
                f"{', '.join(sorted(runs))}"
            )
        run.notes.append(f"the trainer's run {chosen} wrote no profile in {', '.join(map(str, run.save_paths))}")
        chosen = None
    if chosen is None and len(runs) > 1:
        newest = max(entries, key=lambda item: item[1].get("time", 0))[1] if entries else {}
        latest: Optional[str] = newest.get("run")
        chosen = latest or sorted(runs)[-1]
        run.notes.append(f"the save path holds {len(runs)} runs; reporting the latest, {chosen} (--run ID for another)")
    if chosen is None and len(runs) == 1:
        chosen = next(iter(runs))
    run.run_id = run.run_id or chosen
    for save_path, entry in entries:
        if chosen is not None and entry.get("run") not in (chosen, None):
            continue
        path = save_path / entry["path"]
        if not path.exists():
            run.notes.append(f"{path} is listed in the manifest but missing; skipped")
            continue
        run.files.append(
            OutputFile(
                tool=entry["tool"],
                path=path,
                steps=tuple(entry.get("steps") or ()),
                rank=int(entry.get("rank", 0)),
                window=entry.get("window"),
                role=entry.get("role"),
                host=entry.get("host"),
                bytes=int(entry.get("bytes", 0)),
                oom=bool(entry.get("oom")),
            )
        )
