"""What every tracking backend implements, and the conversions they share."""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Optional


class Backend(ABC):
    """One place metrics go. ``log`` receives plain floats keyed by metric name, steps strictly increasing
    within a process; ``resume_step`` (given at construction) means steps >= it are being logged again."""

    name = "backend"

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None:
        """Flush and release; called once."""


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Numbers (Python, numpy or 0-d tensors) as floats; anything else raises ``TypeError`` naming the key."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
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
    def load(cls, path: Any) -> Optional["RunState"]:
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
                RuntimeWarning, stacklevel=4,
            )
        return True
