"""The :class:`Tracker`: metrics of each step to every chosen backend; a failing backend never stops the others."""

from __future__ import annotations

import ast
import contextlib
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rlprof.tracking.base import Backend, BackendContext, LiveSource, backend_factory, backend_names, to_floats

START_TIMEOUT_S = 60.0
"""How long a backend may take to start (an unreachable tracking server) before it is turned off."""


def parse_backends(value: Any) -> list[str]:
    """Backend names from a list, an OmegaConf ListConfig, a string holding a list (the seed's
    ``trainer.logger='["console","wandb"]'``), a comma-separated string or one name. Unknown names are an error."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError) as exc:
                raise ValueError(f"trainer.logger={value!r} is not a list of backend names") from exc
        else:
            value = [part.strip() for part in text.split(",") if part.strip()]
    names = [str(name) for name in value]
    for name in names:
        if name not in backend_names():
            raise ValueError(
                f"trainer.logger: unknown backend {name!r}; registered backends: {', '.join(backend_names())}"
            )
    return list(dict.fromkeys(names))


class Tracker:
    """Logs metrics of each step to the chosen backends.

    Files go under ``log_dir`` (default ``outputs/{project}/{experiment}``): ``metrics.jsonl`` for ``file``, run
    state and local stores for wandb and mlflow; TensorBoard writes to ``$TENSORBOARD_DIR`` or
    ``tensorboard_log/{project}/{experiment}``. ``resume_step``: a resumed run is about to log this step again;
    each backend then ends with one record per step (see each backend for how). ``rank`` and ``local_rank`` (default
    ``RANK`` and ``LOCAL_RANK`` of the environment, else 0) say which process of a job this is, for the backends every
    rank runs (``prometheus``: an endpoint per process); ``options`` holds a backend's settings under its name
    (``{"prometheus": {"port": 9490}}``). A backend that fails while logging warns once and is turned off; the
    others go on.
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        backends: Any = ("console",),
        *,
        log_dir: Optional[str | Path] = None,
        config: Optional[Mapping[str, Any]] = None,
        total_steps: Optional[int] = None,
        total_epochs: Optional[int] = None,
        resume_step: Optional[int] = None,
        console: Any = None,
        table_every: int = 10,
        start_timeout_s: float = START_TIMEOUT_S,
        rank: Optional[int] = None,
        local_rank: Optional[int] = None,
        options: Optional[Mapping[str, Mapping[str, Any]]] = None,
    ) -> None:
        self.names = parse_backends(backends)
        self.log_dir = Path(log_dir) if log_dir is not None else Path("outputs") / project_name / experiment_name
        context = BackendContext(
            project_name,
            experiment_name,
            self.log_dir,
            config,
            total_steps,
            total_epochs,
            resume_step,
            console,
            table_every,
            int(os.environ.get("RANK", "0")) if rank is None else rank,
            int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank,
            options or {},
        )
        self.backends: list[Backend] = []
        self.last_step: Optional[int] = None
        for name in self.names:
            backend = self._start(name, context, start_timeout_s)
            if backend is not None:
                self.backends.append(backend)

    @staticmethod
    def _start(name: str, context: BackendContext, timeout_s: float) -> Optional[Backend]:
        """Start one backend, waiting at most ``timeout_s``; a backend that fails or hangs (an unreachable server)
        is reported once and left out, and training goes on without it."""
        outcome: dict[str, Any] = {}

        def start() -> None:
            try:
                outcome["backend"] = backend_factory(name)(context)
            except Exception as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=start, name=f"rlprof-start-{name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if "backend" in outcome:
            backend: Backend = outcome["backend"]
            return backend
        reason = (
            f"{type(outcome['error']).__name__}: {outcome['error']}"
            if "error" in outcome
            else f"it did not start within {timeout_s:g} s"
        )
        warnings.warn(
            f"rlprof tracking: the {name} backend could not start ({reason}); it is turned off, the other "
            "backends go on",
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Send ``metrics`` (numbers) of ``step`` to every backend still working."""
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"Tracker.log: step={step} is not after the last logged step {self.last_step}")
        values = to_floats(metrics)
        self.last_step = step
        for backend in list(self.backends):
            try:
                backend.log(values, step)
            except Exception as exc:
                self._drop(backend, "logging", exc)

    def add_live(self, source: LiveSource) -> None:
        """Values read at each read of a live backend (``prometheus``'s scrapes) rather than at each step: ``source()``
        returns :class:`~rlprof.tracking.base.LiveSample` s (the watchdog's phase and how long it has run)."""
        for backend in self.backends:
            backend.add_live(source)

    def _drop(self, backend: Backend, action: str, exc: Exception) -> None:
        """Turn ``backend`` off after it failed: one warning, and it is closed (what it holds is released: a
        server, a file) unless closing is what failed."""
        self.backends.remove(backend)
        if action != "closing":
            with contextlib.suppress(Exception):
                backend.close()
        warnings.warn(
            f"rlprof tracking: the {backend.name} backend failed while {action} "
            f"({type(exc).__name__}: {exc}); it is turned off, the other backends go on",
            RuntimeWarning,
            stacklevel=3,
        )

    def close(self) -> None:
        for backend in list(self.backends):
            try:
                backend.close()
            except Exception as exc:
                self._drop(backend, "closing", exc)
        self.backends.clear()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
