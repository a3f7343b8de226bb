"""``hf`` rollout: transformers' sampling on the actor's own module (always its current weights), by the loop of
:mod:`rlprof_train.workers.rollout.decode` (the tokens ``generate`` samples, computed with less work) or by
``generate`` itself for models whose generation config asks for more."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from rlprof_train.batch import RolloutBatch
from rlprof_train.data import Example, left_pad
from rlprof_train.workers.rollout.base import (
    Completion,
    Completions,
    ContinuingRollout,
    SamplingParams,
    completions_batch,
)
from rlprof_train.workers.rollout.decode import Sampling, loop_applies, sample
from rlprof_train.workers.rollout.engine_stats import RequestTimes, hf_request_times
from rlprof_train.workers.rollout.registry import RolloutContext, register_rollout


class HFRollout(ContinuingRollout):
    """Samples with the module (the loop, else ``generate``) on ``device``, where the module is; under ZeRO 3 its
    weights are gathered for each call. The loop's decode steps are timed for the engine counters
    (:mod:`~rlprof_train.workers.rollout.engine_stats`), in ``batch.extras["engine_requests"]`` and
    ``["engine_occupancy"]``. The sampled tokens come back to the host as lists: the completions."""

    def __init__(
        self,
        module: Callable[[], Any],
        tokenizer: Any,
        zero_stage: int,
        micro_batch_size: Optional[int],
        device: torch.device,
    ) -> None:
        self.module = module
        self.tokenizer = tokenizer
        self.zero_stage = zero_stage
        self.micro_batch_size = micro_batch_size
        self.device = device

    def _gathered(self, model: Any) -> Any:
        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(model.parameters()))
        return contextlib.nullcontext()

    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch:
        contexts, budgets = [p.prompt_ids for p in prompts], [sampling.response_length] * len(prompts)
        sampled = self.complete(contexts, sampling.n, budgets, sampling)
        return completions_batch(prompts, sampled, sampling, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)

    @torch.no_grad()
    def complete(
        self, contexts: Sequence[Sequence[int]], n: int, budgets: Sequence[int], sampling: SamplingParams
    ) -> Completions:
        model = self.module()
        was_training = model.training
        model.eval()
        settings = Sampling(
            n,
            max(budgets),
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
        )
        loop = loop_applies(model)
        rows: list[Completion] = []
        requests: list[RequestTimes] = []  # timed by the loop only: generate keeps no per-step times
        sampled, row_steps = 0, 0
        arrival = time.perf_counter()
        try:
            with self._gathered(model):
                chunk_size = self.micro_batch_size or len(contexts)
                for start in range(0, len(contexts), chunk_size):
                    chunk = contexts[start : start + chunk_size]
                    ids, mask = (t.to(self.device) for t in left_pad(chunk, self.tokenizer.pad_token_id))
                    step_times: list[float] = []
                    out = (
                        sample(model, ids, mask, settings, step_times)
                        if loop
                        else _generate(model, ids, mask, settings)
                    ).tolist()
                    lengths = [_length(row, settings.eos_token_id) for row in out]
                    for row, (tokens, length) in enumerate(zip(out, lengths, strict=True)):
                        rows.append(Completion(tokens[: min(length, budgets[start + row // n])]))
                    if loop:
                        requests += hf_request_times([len(c) for c in chunk], lengths, n, arrival, step_times)
                        sampled, row_steps = sampled + sum(lengths), row_steps + len(lengths) * len(step_times)
        finally:
            model.train(was_training)
        return Completions(rows, requests, (sampled, row_steps) if loop else None)


def _length(row: list[int], eos_token_id: int) -> int:
    """Tokens of a response up to its EOS, included (the loop pads after it)."""
    return row.index(eos_token_id) + 1 if eos_token_id in row else len(row)


def _generate(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """transformers ``generate`` (for models whose generation config asks for processing the loop does not do)."""
    greedy = sampling.temperature == 0
    options: dict[str, Any] = dict(
        do_sample=not greedy,
        max_new_tokens=sampling.max_new_tokens,
        num_return_sequences=sampling.n,
        eos_token_id=sampling.eos_token_id,
        pad_token_id=sampling.pad_token_id,
        remove_invalid_values=True,
    )  # a diverged policy samples garbage (caught later), not a crash
    if not greedy:
        options.update(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0)
        )  # 0: off (None would mean 50)
    else:  # generate refuses num_return_sequences > 1 without sampling: n identical greedy rows
        prompt_ids, prompt_mask = (t.repeat_interleave(sampling.n, dim=0) for t in (prompt_ids, prompt_mask))
        options["num_return_sequences"] = 1
    out: torch.Tensor = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **options)
    return out[:, prompt_ids.shape[1] :]


@register_rollout("hf", title="transformers generate", reads=("micro_batch_size",), continues=True)
def hf_rollout(context: RolloutContext) -> HFRollout:
    """Samples from the actor's own module: nothing to load or sync."""
    actor, arr = context.actor, context.cfg.actor_rollout_ref
    return HFRollout(
        lambda: actor.module, context.tokenizer, arr.actor.zero_stage, arr.rollout.micro_batch_size, context.env.device
    )
