"""Rollout backends behind one interface: ``hf`` (transformers generate) and, later, ``vllm``."""

from rlprof_train.workers.rollout.base import Rollout, SamplingParams, build_rollout_batch

__all__ = ["Rollout", "SamplingParams", "build_rollout_batch"]
