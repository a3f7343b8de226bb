"""``tensorboard`` backend: scalars in ``$TENSORBOARD_DIR`` or ``tensorboard_log/{project}/{experiment}``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from rlprof.tracking.base import Backend


def tensorboard_dir(project_name: str, experiment_name: str) -> Path:
    return Path(os.environ.get("TENSORBOARD_DIR") or Path("tensorboard_log") / project_name / experiment_name)


class TensorBoardBackend(Backend):
    """One ``add_scalar`` per metric, flushed every step. On resume, TensorBoard's own ``purge_step`` makes its
    readers drop the earlier events of steps >= ``resume_step``, so each step is read once."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, resume_step: Optional[int] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=resume_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
