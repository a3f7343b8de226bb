"""Training that goes wrong silently is stopped loudly: non-finite losses or gradient norms, step after step."""

from __future__ import annotations

import math
from collections.abc import Mapping

WATCHED = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/grad_norm")


class TrainingDiverged(RuntimeError):
    """Losses or gradient norms stayed non-finite for ``trainer.nonfinite_patience`` steps."""


class NonFiniteGuard:
    """Counts consecutive steps with a non-finite watched metric; raises :class:`TrainingDiverged` at
    ``patience``. :attr:`healthy` says whether the last step was finite (checkpoints are written only then)."""

    def __init__(self, patience: int, hint: str = "") -> None:
        self.patience = patience
        self.hint = hint
        self.bad_steps: list[int] = []
        self.healthy = True

    def check(self, metrics: Mapping[str, float], step: int) -> None:
        bad = {key: metrics[key] for key in WATCHED if key in metrics and not math.isfinite(metrics[key])}
        self.healthy = not bad
        if not bad:
            self.bad_steps.clear()
            return
        self.bad_steps.append(step)
        if len(self.bad_steps) >= self.patience:
            values = ", ".join(f"{k}={v}" for k, v in bad.items())
            where = (
                f"for {len(self.bad_steps)} consecutive steps ({self.bad_steps[0]}-{step}; "
                if len(self.bad_steps) > 1
                else f"at step {step} ("
            )
            raise TrainingDiverged(
                f"training diverged: non-finite values {where}trainer.nonfinite_patience={self.patience}), last: "
                f"{values}. No checkpoint was written from {'these steps' if len(self.bad_steps) > 1 else 'it'}."
                f"{self.hint}"
            )
