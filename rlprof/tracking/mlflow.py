"""``mlflow`` backend: ``$MLFLOW_TRACKING_URI``, or a local SQLite store ``{log_dir}/mlflow.db``."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlprof.tracking.base import BackendContext, RemoteRunBackend, RunState, flatten, mlflow_safe_key, register_backend

PARAMS_PER_BATCH = 100
PARAM_VALUE_CHARS = 500


def tracking_uri(log_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(log_dir).resolve() / 'mlflow.db'}"


@register_backend("mlflow")
class MlflowBackend(RemoteRunBackend):
    """Logs to one mlflow run (experiment = project, run name = experiment) through ``MlflowClient``.

    Metric names are made mlflow-safe (see :func:`mlflow_safe_key`). mlflow cannot drop logged steps, so on resume
    the steps it already holds keep their first values and are skipped, with one warning.
    """

    def __init__(self, context: BackendContext) -> None:
        from mlflow.tracking import MlflowClient

        log_dir, resume_step = Path(context.log_dir), context.resume_step
        log_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri(log_dir))
        state_path = log_dir / "mlflow_run.json"
        previous = RunState.load(state_path) if resume_step is not None else None
        if previous is not None:
            self.state = previous
            self.client.update_run(previous.run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(context.project)
            experiment_id = found.experiment_id if found else self.client.create_experiment(context.project)
            run = self.client.create_run(experiment_id, run_name=context.experiment)
            self.state = RunState(state_path, run.info.run_id)
            self._log_params(context.config or {})

    def _log_params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(mlflow_safe_key(k), str(v)[:PARAM_VALUE_CHARS]) for k, v in flatten(config).items()]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.state.run_id, params=params[start : start + PARAMS_PER_BATCH])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if self.already_logged(step):
            return
        now = int(time.time() * 1000)
        batch = [Metric(mlflow_safe_key(k), v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.state.run_id, metrics=batch)
        self.state.save(step)

    def close(self) -> None:
        self.client.set_terminated(self.state.run_id)
