"""``hf`` rollout: transformers ``generate`` on the actor's own module (always its current weights)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

import torch

from rlprof_train.batch import RolloutBatch
from rlprof_train.data import Example, left_pad
from rlprof_train.workers.rollout.base import Rollout, SamplingParams, build_rollout_batch

VLLM_ONLY_KNOBS = ("gpu_memory_utilization", "max_num_batched_tokens", "tensor_parallel_size", "disable_log_stats")


class HFRollout(Rollout):
    """Samples with ``module.generate``; under ZeRO 3 the partitioned weights are gathered for each call."""

    name = "hf"

    def __init__(
        self, module: Callable[[], Any], tokenizer: Any, zero_stage: int, micro_batch_size: Optional[int]
    ) -> None:
        self.module = module
        self.tokenizer = tokenizer
        self.zero_stage = zero_stage
        self.micro_batch_size = micro_batch_size

    def _gathered(self, model: Any) -> Any:
        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(model.parameters()))
        return contextlib.nullcontext()

    @torch.no_grad()
    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch:
        model = self.module()
        was_training = model.training
        model.eval()
        greedy = sampling.temperature == 0
        options = dict(
            do_sample=not greedy,
            max_new_tokens=sampling.response_length,
            num_return_sequences=sampling.n,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            remove_invalid_values=True,
        )  # a diverged policy samples garbage (caught later), not a crash
        if not greedy:
            options.update(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
            )  # 0: off (None would mean 50)
        responses: list[list[int]] = []
        try:
            with self._gathered(model):
                chunk_size = self.micro_batch_size or len(prompts)
                for start in range(0, len(prompts), chunk_size):
                    chunk = prompts[start : start + chunk_size]
                    ids, mask = left_pad([p.prompt_ids for p in chunk], self.tokenizer.pad_token_id)
                    out = model.generate(input_ids=ids, attention_mask=mask, **options)
                    responses.extend(out[:, ids.shape[1] :].tolist())
        finally:
            model.train(was_training)
        return build_rollout_batch(
            prompts, responses, sampling, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        )
