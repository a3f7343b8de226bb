"""Find what a run holds: metrics, the saved config and run record, and every file the profiler (or anyone) wrote.

A run is named by one or more paths: a trainer's ``trainer.log_dir`` (``run.json``, ``config.yaml``,
``metrics.jsonl``), an rlprof ``save_path`` (``manifest.jsonl``), any file a source reads (a Chrome trace whatever
its name, an nsys report, a memory snapshot, a ``metrics.jsonl``), or a folder above them (``outputs/demo`` holding
``logs/`` and ``profile/``; a folder of HTA rank files or of verl's ``prof_rank-N.json.gz``). Several paths make one
run: the save paths of two nodes, or a log folder and a save path elsewhere. Every subcommand of ``rlprof`` starts
from the :class:`Run`.

Files listed in a manifest carry their format, step window, rank and role; files found without one are recognised
by their content (:func:`rlprof.analysis.sources.identify`). Nothing is followed out of the run: a manifest line
whose path leaves its save path, and a symbolic link out of a folder that was given, are skipped with a note.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from rlprof.analysis.sources import InputFile, ReadOptions, identify, source, sources
from rlprof.analysis.sources.metrics_jsonl import Metrics
from rlprof.manifest import FILE_NAME as MANIFEST
from rlprof.manifest import read_manifest

METRICS = "metrics.jsonl"
RUN_RECORD = "run.json"
CONFIG = "config.yaml"
SEARCH_DEPTH = 3
MAX_FILES = 10_000
"""Files looked at, at most, in the folders of one run."""
SKIPPED_FOLDERS = ("previous", ".git", "wandb", "models", "__pycache__")
LEGACY_FORMATS = {"torch": "chrome_trace", "vllm_torch": "chrome_trace"}
"""Manifest lines written before the format was recorded: by tool (memory files are recognised by content)."""
LEGACY_ENGINES = {"vllm_torch": "vLLM"}
"""Manifest lines written before the engine was recorded: by tool."""


class RunNotFound(ValueError):
    """Nothing readable at the given paths; the message says what was looked for."""


@dataclass
class Run:
    """Everything found for one run."""

    name: str
    config: Optional[dict[str, Any]] = None
    record: Optional[dict[str, Any]] = None
    run_id: Optional[str] = None
    save_paths: list[Path] = field(default_factory=list)
    inputs: list[InputFile] = field(default_factory=list)
    """Every readable file of the run, with its format."""
    notes: list[str] = field(default_factory=list)
    """What was chosen or skipped while finding the run (one line each)."""
    options: ReadOptions = field(default_factory=ReadOptions)
    log_dir: Optional[Path] = None
    """The folder of the run's metrics.jsonl, run.json and config.yaml (and stalls/), when found."""
    _metrics: Optional[Metrics] = None

    def of(self, *formats: str) -> list[InputFile]:
        return [f for f in self.inputs if f.format in formats]

    def of_category(self, category: str) -> list[InputFile]:
        return [f for f in self.inputs if _category(f) == category]

    @property
    def traces(self) -> list[InputFile]:
        """Trace files (torch traces, nsys reports)."""
        return self.of_category("trace")

    @property
    def metrics_path(self) -> Optional[Path]:
        found = self.of("metrics")
        return found[0].path if found else None

    @property
    def metrics(self) -> Metrics:
        """The run's step records, read once (with what was skipped, in ``notes``)."""
        if self._metrics is None:
            path = self.metrics_path
            reader = source("metrics")
            if path is None or reader is None:
                self._metrics = Metrics("", [])
            else:
                self._metrics = reader.read(InputFile("metrics", path), self.options)
        return self._metrics

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A value of the saved trainer config (``config.yaml``) by dotted key, or ``default``."""
        return setting_of(self.config, dotted, default)

    @property
    def empty(self) -> bool:
        return not self.inputs


def setting_of(config: Any, dotted: str, default: Any = None) -> Any:
    """The value at ``dotted`` (``actor_rollout_ref.actor.zero_stage``) in a nested config mapping, or ``default``."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def find_run(paths: list[Path], run_id: Optional[str] = None, options: Optional[ReadOptions] = None) -> Run:
    """The :class:`Run` at ``paths`` (see the module doc); ``run_id`` picks one run of a shared save path."""
    run = Run(name=", ".join(str(p) for p in paths), options=options or ReadOptions())
    logs: list[Path] = []
    save_paths: list[Path] = []
    loose: list[InputFile] = []
    for path in paths:
        if not path.exists():
            raise RunNotFound(f"{path}: no such file or directory")
        if path.is_file():
            if path.name == MANIFEST:
                save_paths.append(path.parent)
            elif path.name == RUN_RECORD:
                logs.append(path.parent)
            else:
                found = _loose(path)
                if found is None:
                    raise RunNotFound(f"{path} is not a file rlprof reads ({_readable()})")
                loose.append(found)
            continue
        resolved = path.resolve()
        if resolved == Path(resolved.anchor):
            raise RunNotFound(
                f"{path}{' (a link to ' + str(resolved) + ')' if path.is_symlink() else ''} is the filesystem's root, "
                "not a run's folder; give trainer.log_dir or global_profiler.save_path"
            )
        found_logs, found_saves, found_loose = _discover(path, run)
        logs += found_logs
        save_paths += found_saves
        loose += found_loose
    log_dir = run.log_dir = _choose_log_dir(run, logs)
    if log_dir is not None:
        if (log_dir / METRICS).exists():
            run.inputs.append(InputFile("metrics", log_dir / METRICS))
        run.config = _read_yaml(log_dir / CONFIG, run)
        run.record = _read_json(log_dir / RUN_RECORD, run)
        if run.record:
            run.run_id = run.record.get("run_id")
            recorded = run.record.get("profile_save_path")
            if isinstance(recorded, str) and (Path(recorded) / MANIFEST).exists():
                save_paths.append(Path(recorded))
    for found in loose:
        if not (_category(found) == "metrics" and run.metrics_path is not None):  # the log folder's one is read
            run.inputs.append(found)
    run.save_paths = list(dict.fromkeys(p.resolve() for p in save_paths))
    _read_outputs(run, run_id)
    return run


def _category(file: InputFile) -> Optional[str]:
    reader = source(file.format)
    return reader.category if reader is not None else None


def _loose(path: Path) -> Optional[InputFile]:
    """A file found without a manifest line, by its content (None: no source reads it)."""
    found = identify(path)
    if found is None:
        return None
    return InputFile(found.format, path, bytes=path.stat().st_size, oom=path.name.startswith("oom_"))


def _readable() -> str:
    return "one of: " + "; ".join(s.description for s in sources())


def _discover(root: Path, run: Run) -> tuple[list[Path], list[Path], list[InputFile]]:
    """(log folders, save paths, loose files) at or below ``root``; symbolic links out of it are not followed."""
    logs, saves = [], []
    loose: list[InputFile] = []
    top = root.resolve()
    budget = [MAX_FILES]
    for folder in _folders(root, SEARCH_DEPTH, top, run):
        names = {child.name for child in folder.iterdir()}
        if RUN_RECORD in names or METRICS in names:
            logs.append(folder)
        if MANIFEST in names:
            saves.append(folder)
            continue  # a save path's files are the ones its manifest lists
        for child in sorted(folder.iterdir()):
            if child.name in (METRICS, RUN_RECORD, CONFIG) or not child.is_file() or budget[0] <= 0:
                continue
            if not _inside(child, top):
                run.notes.append(f"{child} links out of {root}; not followed")
                continue
            budget[0] -= 1
            found = _loose(child)
            if found is not None:
                loose.append(found)
    if budget[0] <= 0:
        run.notes.append(f"{root} holds more than {MAX_FILES} files; only the first {MAX_FILES} were looked at")
    return logs, saves, loose


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # unreadable (permissions): not walked
        return False


def _inside(path: Path, top: Path) -> bool:
    try:
        return path.resolve().is_relative_to(top)
    except OSError:
        return False


def _folders(root: Path, depth: int, top: Path, run: Run) -> list[Path]:
    """``root`` and the folders below it, not below a save path (its manifest lists its files)."""
    found = [root]
    if depth > 0 and not (root / MANIFEST).exists():
        try:
            children = sorted(root.iterdir())
        except OSError as exc:  # a folder this user may not read
            run.notes.append(f"{root} cannot be listed ({exc.strerror}); skipped")
            return found
        for child in children:
            if (
                _is_dir(child)
                and not child.name.startswith(".")
                and child.name not in SKIPPED_FOLDERS
                and not child.name.startswith(("previous-", "global_step_"))
            ):
                if not _inside(child, top):
                    run.notes.append(f"{child} links out of {root}; not followed")
                    continue
                found += _folders(child, depth - 1, top, run)
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
    """A saved config; one with YAML aliases is refused (an alias bomb expands exponentially when walked)."""
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            run.notes.append(f"{path} uses YAML aliases, which rlprof does not expand; skipped")
            return None
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        run.notes.append(f"{path} is not valid YAML ({' '.join(str(exc).split())[:120]}); skipped")
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
        newest = max(entries, key=lambda item: _number(item[1].get("time")))[1] if entries else {}
        latest = newest.get("run")
        chosen = str(latest) if latest else sorted(runs)[-1]
        run.notes.append(f"the save path holds {len(runs)} runs; reporting the latest, {chosen} (--run ID for another)")
    if chosen is None and len(runs) == 1:
        chosen = next(iter(runs))
    run.run_id = run.run_id or chosen
    skipped = 0
    for save_path, entry in entries:
        if chosen is not None and entry.get("run") not in (chosen, None):
            continue
        found = _manifest_input(save_path, entry, run)
        if found is None:
            skipped += 1
        else:
            run.inputs.append(found)
    if skipped:
        run.notes.append(f"{skipped} manifest lines were skipped (malformed, missing files or unreadable formats)")


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _manifest_input(save_path: Path, entry: dict[str, Any], run: Run) -> Optional[InputFile]:
    """The input a manifest line describes, or None (with a note when it points out of the save path)."""
    relative = entry.get("path")
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        return None
    path = save_path / relative
    if not _inside(path, save_path.resolve()):
        run.notes.append(f"{save_path / MANIFEST}: the path {relative!r} leaves the save path; not followed")
        return None
    if not path.is_file():
        run.notes.append(f"{path} is listed in the manifest but missing; skipped")
        return None
    given = entry.get("format")
    if isinstance(given, str) and source(given) is None:
        return None  # listed, read by no source (vLLM's table of operators, "text")
    format_name = given if isinstance(given, str) else LEGACY_FORMATS.get(str(entry.get("tool")))
    if format_name is None:
        found = identify(path)
        if found is None:
            return None
        format_name = found.format
    steps = entry.get("steps")
    rank, window = entry.get("rank"), entry.get("window")
    role, host = entry.get("role"), entry.get("host")
    engine = entry.get("engine", LEGACY_ENGINES.get(str(entry.get("tool"))))
    pool = entry.get("pool")
    return InputFile(
        format=format_name,
        path=path,
        steps=tuple(s for s in steps if isinstance(s, int)) if isinstance(steps, list) else (),
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        window=window if isinstance(window, int) else None,
        role=role if isinstance(role, str) else None,
        host=host if isinstance(host, str) else None,
        bytes=int(entry["bytes"]) if isinstance(entry.get("bytes"), int) else path.stat().st_size,
        oom=entry.get("oom") is True,
        tool=str(entry.get("tool")) if entry.get("tool") is not None else None,
        engine=engine if isinstance(engine, str) else None,
        pool=pool if isinstance(pool, str) else None,
    )
