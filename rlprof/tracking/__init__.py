"""Experiment tracking: one :class:`Tracker` fanning metrics out to console, TensorBoard, JSONL, wandb, mlflow."""

from rlprof.tracking.tracker import BACKENDS, Tracker, parse_backends

__all__ = ["BACKENDS", "Tracker", "parse_backends"]
