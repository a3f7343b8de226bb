"""``wandb`` backend (``WANDB_MODE=offline`` works without a server)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path

from rlprof.tracking.base import BackendContext, RemoteRunBackend, RunState, register_backend


@register_backend("wandb")
class WandbBackend(RemoteRunBackend):
    """Logs to one wandb run per training run; a resumed training run continues the same run id. Its files go to
    ``$WANDB_DIR/wandb`` when that is set, else ``{log_dir}/wandb``.

    wandb cannot drop logged steps, so on resume the steps it already holds (up to the last one logged) keep
    their first values and are skipped, with one warning; later steps are logged as usual.
    """

    def __init__(self, context: BackendContext) -> None:
        import wandb

        log_dir, resume_step = Path(context.log_dir), context.resume_step
        log_dir.mkdir(parents=True, exist_ok=True)
        state_path = log_dir / "wandb_run.json"
        previous = RunState.load(state_path) if resume_step is not None else None
        self.state = previous or RunState(state_path, uuid.uuid4().hex[:12])
        self.run = wandb.init(
            project=context.project,
            name=context.experiment,
            dir=os.path.abspath(os.environ.get("WANDB_DIR") or log_dir),  # wandb's own setting wins; resolved here
            id=self.state.run_id,
            resume="allow",
            config=dict(context.config or {}),
            reinit="create_new",
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.already_logged(step):
            return
        self.run.log(dict(metrics), step=step)
        self.state.save(step)

    def close(self) -> None:
        self.run.finish()
