"""The :class:`Tracker`: metrics of each step to every chosen backend; a failing backend never stops the others."""

from __future__ import annotations

import ast
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rlprof.tracking.base import Backend, to_floats

BACKENDS = ("console", "tensorboard", "file", "wandb", "mlflow")


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
        if name not in BACKENDS:
            raise ValueError(f"trainer.logger: unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    return list(dict.fromkeys(names))


class Tracker:
    """Logs metrics of each step to the chosen backends.

    Files go under ``log_dir`` (default ``outputs/{project}/{experiment}``): ``metrics.jsonl`` for ``file``, run
    state and local stores for wandb and mlflow; TensorBoard writes to ``$TENSORBOARD_DIR`` or
    ``tensorboard_log/{project}/{experiment}``. ``resume_step``: a resumed run is about to log this step again;
    each backend then ends with one record per step (see each backend for how). A backend that fails while
    logging warns once and is turned off; the others go on.
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
    ) -> None:
        self.names = parse_backends(backends)
        self.log_dir = Path(log_dir) if log_dir is not None else Path("outputs") / project_name / experiment_name
        self.backends: list[Backend] = []
        self.last_step: Optional[int] = None
        for name in self.names:
            self.backends.append(self._create(name, project_name, experiment_name, config, total_steps,
                                              total_epochs, resume_step, console, table_every))

    def _create(self, name: str, project: str, experiment: str, config: Optional[Mapping[str, Any]],
                total_steps: Optional[int], total_epochs: Optional[int], resume_step: Optional[int],
                console: Any, table_every: int) -> Backend:
        if name == "console":
            from rlprof.tracking.console import ConsoleBackend

            return ConsoleBackend(console, total_steps, total_epochs, table_every)
        if name == "tensorboard":
            from rlprof.tracking.tensorboard import TensorBoardBackend, tensorboard_dir

            return TensorBoardBackend(tensorboard_dir(project, experiment), resume_step)
        if name == "file":
            from rlprof.tracking.jsonl import JsonlBackend

            return JsonlBackend(self.log_dir, resume_step)
        if name == "wandb":
            from rlprof.tracking.wandb import WandbBackend

            return WandbBackend(project, experiment, self.log_dir, config, resume_step)
        from rlprof.tracking.mlflow import MlflowBackend

        return MlflowBackend(project, experiment, self.log_dir, config, resume_step)

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

    def _drop(self, backend: Backend, action: str, exc: Exception) -> None:
        self.backends.remove(backend)
        warnings.warn(f"rlprof tracking: the {backend.name} backend failed while {action} "
                      f"({type(exc).__name__}: {exc}); it is turned off, the other backends go on",
                      RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        for backend in list(self.backends):
            try:
                backend.close()
            except Exception as exc:
                self._drop(backend, "closing", exc)
        self.backends.clear()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
