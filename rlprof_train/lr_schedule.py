"""The learning rate of each training step: verl's warm-up and decay (``optim.lr_warmup_steps``, ``lr_scheduler_type``),
as a function of the step, so a resumed run continues the schedule with no scheduler state.

verl builds a ``LambdaLR`` around ``get_constant_schedule_with_warmup`` or ``get_cosine_schedule_with_warmup``
(``verl/utils/torch_functional.py``) and advances it once per update of that model, after the update: its
``u``-th update (from 1; the actor's first is at step ``trainer.critic_warmup``, or 1) runs at ``lr · f(u - 1)``
with, for ``W`` warm-up steps and ``T`` steps in all,

    warm-up (s' < W):   f(s') = s' / max(1, W)                          (0 at the first update)
    constant:           f(s') = 1
    cosine:             p = (s' - W) / max(1, T - W)
                        f(s') = max(m, (1 - m)/2 · cos(2π · cycles · p) + (1 + m)/2)     (m = min_lr_ratio)

(cosine with ``zero_indexed_step=false`` counts s' from 1). ``W`` is ``lr_warmup_steps`` when positive, else
``int(lr_warmup_steps_ratio · T)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlprof_train.config.schema import OptimConfig


@dataclass(frozen=True)
class LRSchedule:
    """One optimizer's learning rate per training step."""

    optim: OptimConfig
    total_steps: int
    """``T``: the run's training steps (``trainer.total_training_steps``, or the epochs' steps), as verl injects
    them into both optimizers' configs."""

    @property
    def warmup_steps(self) -> int:
        if self.optim.lr_warmup_steps > 0:
            return self.optim.lr_warmup_steps
        return int(self.optim.lr_warmup_steps_ratio * self.total_steps)

    def factor(self, update: int) -> float:
        """``f(update - 1)``: the share of ``optim.lr`` that the model's ``update``-th update (from 1) runs at."""
        optim, warmup = self.optim, self.warmup_steps
        current = update - 1
        if optim.lr_scheduler_type == "cosine" and not optim.zero_indexed_step:
            current += 1
        if current < warmup:
            return current / max(1, warmup)
        if optim.lr_scheduler_type == "constant":
            return 1.0
        progress = (current - warmup) / max(1, self.total_steps - warmup)
        floor = optim.min_lr_ratio
        wave = math.cos(math.pi * optim.num_cycles * 2.0 * progress)
        return max(floor, wave * (1 - floor) * 0.5 + (1 + floor) * 0.5)

    def lr(self, update: int) -> float:
        """The learning rate of the model's ``update``-th update (from 1)."""
        return self.optim.lr * self.factor(update)
