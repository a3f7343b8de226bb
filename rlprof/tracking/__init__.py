"""Experiment tracking: one :class:`Tracker` fanning metrics out to registered backends (console, TensorBoard,
JSONL, wandb, mlflow, Prometheus, or your own: :func:`register_backend`)."""

from rlprof.tracking import console, jsonl, mlflow, prometheus, tensorboard, wandb  # noqa: F401  (registers the built-ins)
from rlprof.tracking.base import Backend, BackendContext, backend_names, register_backend
from rlprof.tracking.tracker import Tracker, parse_backends

__all__ = ["Backend", "BackendContext", "Tracker", "backend_names", "parse_backends", "register_backend"]
