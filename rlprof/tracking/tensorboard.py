"""``tensorboard`` backend: scalars in ``$TENSORBOARD_DIR`` or ``tensorboard_log/{project}/{experiment}``."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlprof.tracking.base import Backend, BackendContext, register_backend


def tensorboard_dir(project_name: str, experiment_name: str) -> Path:
    return Path(os.environ.get("TENSORBOARD_DIR") or Path("tensorboard_log") / project_name / experiment_name)


@register_backend("tensorboard")
class TensorBoardBackend(Backend):
    """One ``add_scalar`` per metric, flushed every step. On resume, TensorBoard's own ``purge_step`` makes its
    readers drop the earlier events of steps >= ``resume_step``, so each step is read once. A new run (no
    ``resume_step``) that finds an earlier run's event files in its folder moves them to ``previous-{time}/`` (a run
    of its own in TensorBoard), so the two runs' curves are never mixed."""

    @classmethod
    def event_dir(cls, project: str, experiment: str) -> Path:
        return tensorboard_dir(project, experiment)

    def __init__(self, context: BackendContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        self.log_dir = tensorboard_dir(context.project, context.experiment)
        if context.resume_step is None:
            archive_events(self.log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=context.resume_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        try:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, global_step=step)
            self.writer.flush()
        except OSError as exc:  # raised here from the writer's thread: say which folder
            raise OSError(exc.errno, f"{exc.strerror or exc} writing the event file in {self.log_dir}") from None

    def close(self) -> None:
        self.writer.close()


def _quiet_writer_threads() -> None:
    """TensorBoard writes events on a thread of its own; when a write fails (a read-only folder, a full disk) the
    thread prints its traceback and keeps the error for the next ``flush``, where the tracker reports it in one
    warning and turns the backend off. Leave that thread's traceback out (other threads' go on as before)."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "rlprof_quiet", False):
        return

    def hook(args: Any) -> None:
        if not isinstance(args.thread, _AsyncWriterThread):
            previous(args)

    hook.rlprof_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def archive_events(log_dir: Path) -> None:
    """Move earlier ``events.out.tfevents.*`` files of ``log_dir`` into ``previous-{time}/`` (kept, not mixed)."""
    old = sorted(log_dir.glob("events.out.tfevents.*")) if log_dir.is_dir() else []
    if not old:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in old)))
    target = log_dir / f"previous-{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = log_dir / f"previous-{stamp}-{n}"
    target.mkdir()
    for path in old:
        os.replace(path, target / path.name)
    warnings.warn(
        f"rlprof tracking: {log_dir} held the TensorBoard events of an earlier run; they were moved to "
        f"{target} (shown as a run of its own)",
        RuntimeWarning,
        stacklevel=4,
    )
