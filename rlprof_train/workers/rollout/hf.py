"""``hf`` rollout: transformers' sampling on the actor's own module (always its current weights), by the loop of
:mod:`rlprof_train.workers.rollout.decode` (the tokens ``generate`` samples, computed with less work), with
``enforce_eager=false`` by its compiled, static-cache form (:mod:`rlprof_train.workers.rollout.static_decode`), or
by ``generate`` itself for models whose generation config asks for more."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from rlprof_train.batch import RolloutBatch
from rlprof_train.config.schema import TrainerConfig
from rlprof_train.data import Example, left_pad
from rlprof_train.workers.engine import gathered_parameters
from rlprof_train.workers.rollout.base import (
    Completion,
    Completions,
    ContinuingRollout,
    SamplingParams,
    completions_batch,
    prompt_keys,
    row_keys,
)
from rlprof_train.workers.rollout.decode import KeyedNoise, Sampling, loop_applies, sample
from rlprof_train.workers.rollout.engine_stats import RequestTimes, hf_request_times
from rlprof_train.workers.rollout.registry import RolloutContext, register_rollout
from rlprof_train.workers.rollout.static_decode import StaticDecoder


class HFRollout(ContinuingRollout):
    """Samples with the module (the loop, else ``generate``) on ``device``, where the module is; under ZeRO 3 its
    weights are gathered for each call. The loop's decode steps are timed for the engine counters
    (:mod:`~rlprof_train.workers.rollout.engine_stats`), in ``batch.extras["engine_requests"]`` and
    ``["engine_occupancy"]``. The sampled tokens come back to the host as lists: the completions, with each token's
    sampling log-prob when ``log_probs`` (the distribution after temperature, top-k and top-p). ``compiled``: the
    loop's decode step is compiled on a static cache (:mod:`.static_decode`); ``warm_up`` compiles the first step's
    shape, and each shape compiled later is named in the log with its time."""

    def __init__(
        self,
        module: Callable[[], Any],
        tokenizer: Any,
        zero_stage: int,
        micro_batch_size: Optional[int],
        device: torch.device,
        log_probs: bool = False,
        compiled: bool = False,
        log: Callable[[str], None] = print,
    ) -> None:
        self.module = module
        self.log = log
        self.static = StaticDecoder(log) if compiled else None
        self.log_probs = log_probs
        self.tokenizer = tokenizer
        self.zero_stage = zero_stage
        self.micro_batch_size = micro_batch_size
        self.device = device

    def warm_up(self, prompts: list[Example], sampling: SamplingParams) -> bool:
        """With ``compiled``: compile the decode step for the shape of a call with these prompts (two steps)."""
        if self.static is None:
            return False
        if not loop_applies(self.module()):
            self.log(
                "rollout: enforce_eager=false compiles nothing: the model's generation config asks for more than the "
                "loop does, so generate samples it, eagerly"
            )
            return False
        budgets = [sampling.response_length] * len(prompts)
        contexts = [p.prompt_ids for p in prompts]
        self.complete(contexts, sampling.n, budgets, sampling, prompt_keys(prompts, sampling), steps=2)
        return True

    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch:
        contexts, budgets = [p.prompt_ids for p in prompts], [sampling.response_length] * len(prompts)
        sampled = self.complete(contexts, sampling.n, budgets, sampling, prompt_keys(prompts, sampling))
        return completions_batch(prompts, sampled, sampling, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)

    @torch.no_grad()
    def complete(
        self,
        contexts: Sequence[Sequence[int]],
        n: int,
        budgets: Sequence[int],
        sampling: SamplingParams,
        keys: Sequence[int],
        steps: Optional[int] = None,
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
            with gathered_parameters(model, self.zero_stage):
                chunk_size = self.micro_batch_size or len(contexts)
                for start in range(0, len(contexts), chunk_size):
                    chunk = contexts[start : start + chunk_size]
                    ids, mask = (t.to(self.device) for t in left_pad(chunk, self.tokenizer.pad_token_id))
                    keyed = KeyedNoise(row_keys(keys[start : start + chunk_size], n, chunk), self.device)
                    step_times: list[float] = []
                    if not loop:  # generate: torch's random state, which the trainer seeds per step and rank
                        tokens, log_probs = _generate(model, ids, mask, settings, self.log_probs)
                    elif self.static is not None:
                        tokens, log_probs = self.static.sample(
                            model, ids, mask, settings, step_times, self.log_probs, steps, keyed
                        )
                    else:
                        tokens, log_probs = sample(model, ids, mask, settings, step_times, self.log_probs, keyed)
                    out = tokens.tolist()
                    scores = log_probs.tolist() if log_probs is not None else [None] * len(out)
                    lengths = [_length(row, settings.eos_token_id) for row in out]
                    for row, (sampled_row, length, row_scores) in enumerate(zip(out, lengths, scores, strict=True)):
                        kept = min(length, budgets[start + row // n])
                        rows.append(
                            Completion(sampled_row[:kept], row_scores[:kept] if row_scores is not None else None)
                        )
                    if loop:
                        requests += hf_request_times([len(c) for c in chunk], lengths, n, arrival, step_times)
                        sampled, row_steps = sampled + sum(lengths), row_steps + len(lengths) * len(step_times)
        finally:
            model.train(was_training)
        return Completions(rows, requests, (sampled, row_steps) if loop else None)


def _length(row: list[int], eos_token_id: int) -> int:
    """Tokens of a response up to its EOS, included (the loop pads after it)."""
    return row.index(eos_token_id) + 1 if eos_token_id in row else len(row)


def _generate(
    model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, with_log_probs: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers ``generate`` (for models whose generation config asks for processing the loop does not do): the
    responses, and with ``with_log_probs`` each token's log-prob under the processed scores it was sampled from."""
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
    if with_log_probs:
        options.update(return_dict_in_generate=True, output_scores=True)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **options)
    if not with_log_probs:
        return out[:, prompt_ids.shape[1] :], None
    responses = out.sequences[:, prompt_ids.shape[1] :]
    scores = torch.stack(out.scores, dim=1).float()  # [rows, T, V], as processed before sampling
    return responses, torch.log_softmax(scores, dim=-1).gather(-1, responses[..., None]).squeeze(-1)


def _preflight(cfg: TrainerConfig) -> Optional[str]:
    """The compiled decode replays on the weights' own buffers: ZeRO 3 gathers them anew for every call."""
    arr = cfg.actor_rollout_ref
    if not arr.rollout.enforce_eager and arr.actor.zero_stage == 3:
        return (
            "actor_rollout_ref.rollout.enforce_eager=false (the compiled decode) needs the weights in place, and "
            "actor_rollout_ref.actor.zero_stage=3 gathers them for each call; use enforce_eager=true or zero_stage "
            "0, 1 or 2"
        )
    return None


@register_rollout(
    "hf",
    title="transformers generate",
    reads=("micro_batch_size", "enforce_eager"),
    continues=True,
    log_probs_on_request=True,
    preflight=_preflight,
    pooled=True,
)
def hf_rollout(context: RolloutContext) -> HFRollout:
    """Samples from the actor's own module: nothing to load or sync."""
    actor, arr = context.actor, context.cfg.actor_rollout_ref
    return HFRollout(
        lambda: actor.module,
        context.tokenizer,
        arr.actor.zero_stage,
        arr.rollout.micro_batch_size,
        context.env.device,
        context.wants_log_probs,
        compiled=not arr.rollout.enforce_eager,
        log=context.log,
    )
