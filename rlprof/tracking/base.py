"""What every tracking backend implements, the one registry of backends, and the conversions they share.

::

    @register_backend("mine")
    class MyBackend(Backend):
        def __init__(self, context: BackendContext): ...
        def log(self, metrics, step): ...

``"mine"`` is then a valid name in ``Tracker(..., backends=[...])`` and the trainer's ``trainer.logger``.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend may need to start, in one object."""

    project: str
    experiment: str
    log_dir: Path
    """Folder for the run's files: ``metrics.jsonl``, run state, local stores."""
    config: Optional[Mapping[str, Any]] = None
    """The run's configuration (hyper-parameters), for backends that store it."""
    total_steps: Optional[int] = None
    total_epochs: Optional[int] = None
    resume_step: Optional[int] = None
    """A resumed run is about to log this step again: each backend then ends with one record per step."""
    console: Any = None
    """A ``rich.console.Console`` for terminal output (default: a new one)."""
    table_every: int = 10
    """Console: a table of every metric each N steps."""
    rank: int = 0
    """This process's rank in the job (``RANK`` under torchrun)."""
    local_rank: int = 0
    """This process's rank on its node (``LOCAL_RANK``): per-rank backends serve on a base port + this."""
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Settings of one backend, under its name: ``{"prometheus": {"port": 9490}}``."""


@dataclass(frozen=True)
class LiveSample:
    """A value read when a live backend is read (a Prometheus scrape), not when a step is logged: how long this rank
    has been in its phase. ``labels`` tell samples of one key apart; every sample of a key has the same label names."""

    key: str
    labels: Mapping[str, str]
    value: float


LiveSource = Callable[[], "list[LiveSample]"]
"""What :meth:`Tracker.add_live` takes: called at each read, from the backend's thread."""


class Backend(ABC):
    """One place metrics go. ``log`` receives plain floats keyed by metric name, steps strictly increasing
    within a process."""

    name = "backend"
    per_rank = False
    """True: every rank of a job runs this backend with its own values (an endpoint per process); False: only the
    main process logs to it (the trainer's rank 0)."""

    @classmethod
    def event_dir(cls, project: str, experiment: str) -> Optional[Path]:
        """The folder of TensorBoard event files this backend writes for a run (``rlprof view`` serves it), or None:
        it writes none."""
        return None

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def add_live(self, source: LiveSource) -> None:
        """Read ``source`` whenever this backend is read (a live backend); the others ignore it."""

    def close(self) -> None:
        """Flush and release; called once."""


B = TypeVar("B", bound=type)
_BACKENDS: dict[str, Callable[[BackendContext], Backend]] = {}


def register_backend(name: str) -> Callable[[B], B]:
    """Register a :class:`Backend` subclass, built as ``cls(context: BackendContext)``, under ``name``."""

    def register(cls: B) -> B:
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise TypeError(f"register_backend({name!r}): {cls!r} does not subclass rlprof.tracking.Backend")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return register


def backend_names() -> list[str]:
    return list(_BACKENDS)


def backend_factory(name: str) -> Callable[[BackendContext], Backend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown tracking backend {name!r}; registered backends: {', '.join(_BACKENDS)}") from None


def event_dirs(backends: list[str], project: str, experiment: str) -> list[Path]:
    """The TensorBoard event folders the named backends write for a run."""
    found = [getattr(backend_factory(name), "event_dir", Backend.event_dir)(project, experiment) for name in backends]
    return [folder for folder in found if folder is not None]


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Numbers (Python, numpy or 0-d tensors) as floats; anything else raises ``TypeError`` naming the key."""
    out = {}
    for key, given in metrics.items():
        value = given.item() if hasattr(given, "item") and getattr(given, "ndim", 0) == 0 else given
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"metric {key!r}: {value!r} is not a number")
        out[str(key)] = float(value)
    return out


_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_safe_key(key: str) -> str:
    """mlflow accepts letters, digits, ``_ - . /`` and spaces in metric names; anything else becomes ``_``."""
    return _MLFLOW_UNSAFE.sub("_", key)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}``, for backends that take flat hyper-parameters."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def first_present(metrics: Mapping[str, float], keys: tuple[str, ...]) -> Optional[float]:
    for key in keys:
        value = metrics.get(key)
        if value is not None and not math.isnan(value):
            return value
    return None


class RunState:
    """``{log_dir}/{backend}_run.json``: the run id of a backend that keeps runs elsewhere, and the last step it
    holds, so a resumed training run continues the same run and knows which steps it cannot log again."""

    def __init__(self, path: Any, run_id: str, last_step: int = -1) -> None:
        self.path = path
        self.run_id = run_id
        self.last_step = last_step

    @classmethod
    def load(cls, path: Any) -> Optional[RunState]:
        import json

        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            return None
        return cls(path, data["run_id"], data["last_step"])

    def save(self, last_step: int) -> None:
        import json
        import os

        self.last_step = last_step
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump({"run_id": self.run_id, "last_step": last_step}, handle)
        os.replace(tmp, self.path)


class RemoteRunBackend(Backend):
    """A backend that keeps its runs in a store it cannot rewrite (wandb, mlflow).

    A resumed training run continues the same run (id kept in :class:`RunState`). Steps the run already holds
    cannot be dropped, so they keep their first values and are skipped, with one warning; later steps log as usual.
    """

    state: RunState

    def already_logged(self, step: int) -> bool:
        """True (and one warning per run) for a step this run holds from before a resume."""
        if step > self.state.last_step:
            return False
        if not getattr(self, "_warned_resume", False):
            self._warned_resume = True
            import warnings

            warnings.warn(
                f"{self.name} keeps steps <= {self.state.last_step} from before the resume (it cannot drop logged "
                f"steps); skipping them and logging from step {self.state.last_step + 1}",
                RuntimeWarning,
                stacklevel=4,
            )
        return True
