"""Rollout backends behind one interface (:class:`Rollout`) and one registry (:func:`register_rollout`): ``hf``
(transformers' sampling on the actor's module) and ``vllm`` (a vLLM engine), or your own."""

from rlprof_train.workers.rollout import hf, vllm  # noqa: F401  (the built-in backends register themselves)
from rlprof_train.workers.rollout.base import ContinuingRollout, Rollout, SamplingParams, build_rollout_batch
from rlprof_train.workers.rollout.registry import (
    RolloutContext,
    RolloutSpec,
    create_rollout,
    register_rollout,
    rollout_names,
    rollout_spec,
)

__all__ = [
    "ContinuingRollout",
    "Rollout",
    "RolloutContext",
    "RolloutSpec",
    "SamplingParams",
    "build_rollout_batch",
    "create_rollout",
    "register_rollout",
    "rollout_names",
    "rollout_spec",
]
