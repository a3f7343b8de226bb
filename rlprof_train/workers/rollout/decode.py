"""The hf rollout's sampling loop: transformers ``generate``'s sampling, with less computed.

Two savings, neither of which changes a sampled token:

- **one prefill per prompt**: the n responses of a prompt share its prefill; the KV cache is repeated n times
  after it (``generate(num_return_sequences=n)`` prefills every copy);
- **finished rows leave the batch**: a row that sampled EOS is dropped from the cache and from every later
  forward (``generate`` keeps computing it until the last row ends, then throws the tokens away).

Sampling is ``generate``'s, step for step: the same logits processors in the same order (non-finite removal,
temperature, top-k, top-p), and ``torch.multinomial(p, 1)``'s own rule, ``argmax(p / q)`` with ``q ~ Exp(1)``. The
noise ``q`` comes from one of two sources:

- **keyed** (what the trainer uses, :class:`KeyedNoise`): each row draws from a generator of its own, seeded with
  its key (:func:`~.base.row_keys`: from the round's seed, its prompt, its response index and its context's length).
  A response's tokens then depend on its key and the model only: not on the batch it is sampled in, its chunk, the
  rank or process that samples it, or how the processes are split into pools (tested: alone and in a batch, the
  same tokens);
- **torch's random state** (no keys): drawn for the full ``[B, V]`` batch every step, finished rows included, as
  ``generate`` draws it. From the same random state, the tokens are those ``generate`` samples (on the CPU, where
  ``generate`` checks for the end every step; tested): the proof that the rule is ``generate``'s.

A model whose generation config asks for more processing (repetition penalty, min-p, suppressed tokens, ...) is
sampled by ``generate`` itself, from torch's random state.

Asked for, the loop also returns each sampled token's log-prob under the distribution it was drawn from: the log-softmax
of the processed scores (after temperature, top-k and top-p), verl's ``processed_logprobs``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlprof_train.models import position_ids

# generation-config fields this loop applies or that do not change sampling; any other non-default field: generate
_HANDLED = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "transformers_version",
    "_from_model_config",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "max_length",
    "max_new_tokens",
    "use_cache",
    "num_return_sequences",
    "remove_invalid_values",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "output_logits",
    "return_dict_in_generate",
}


@dataclass(frozen=True)
class Sampling:
    """What to sample: ``n`` responses per prompt of at most ``max_new_tokens``; ``temperature == 0``: greedy;
    ``top_k <= 0``: off; ``top_p >= 1``: off."""

    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos_token_id: int
    pad_token_id: int


def loop_applies(model: Any) -> bool:
    """Whether this loop samples as ``generate`` would for ``model``: a decoder-only model whose generation config
    asks for nothing beyond the rollout's own settings."""
    from transformers import GenerationConfig

    config = getattr(model, "generation_config", None)
    if getattr(model.config, "is_encoder_decoder", False) or config is None:
        return False
    default = GenerationConfig().to_dict()
    changed = {k for k, v in config.to_dict().items() if k not in default or default[k] != v}
    return not (changed - _HANDLED)


def processors_for(sampling: Sampling) -> Any:
    """The logits processors ``generate`` would build for these settings, in its order."""
    from transformers import (
        InfNanRemoveLogitsProcessor,
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList([InfNanRemoveLogitsProcessor()])
    if sampling.temperature > 0:
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            processors.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=sampling.top_p))
    return processors


class KeyedNoise:
    """The trainer's sampling noise: each row has a generator of its own, seeded with the row's key
    (:func:`~.base.row_keys`), from which every decode step draws its ``Exp(1)`` noise over the vocabulary. A row's
    draws are a function of its key alone: which other rows share its batch, or have ended, changes nothing (as
    vLLM's per-request seeded generators)."""

    def __init__(self, keys: Sequence[int], device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(key) for key in keys]

    def draw(self, rows: Sequence[int], vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This step's noise ``[len(rows), vocab]`` of ``rows`` (indices into the keys), each from its generator."""
        noise = torch.empty((len(rows), vocab), dtype=dtype, device=device)
        for slot, row in enumerate(rows):
            noise[slot].exponential_(1, generator=self.generators[row])
        return noise


def draw(
    processors: Any,
    sampling: Sampling,
    history: torch.Tensor,
    logits: torch.Tensor,
    rows: int,
    active: Optional[torch.Tensor] = None,
    with_log_probs: bool = False,
    keyed: Optional[KeyedNoise] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One step's tokens ``[A]`` for the ``active`` rows' last logits ``[A, V]`` (``history``: their tokens so far,
    ``[A, step]``), and with ``with_log_probs`` each token's log-prob under the processed scores it was drawn from.
    With ``keyed`` the active rows' noise comes from their own generators; without, torch's random state gives the
    exponential noise of ``torch.multinomial(p, 1)`` for all ``rows`` of the batch, finished rows included. Either
    way the draws of a row do not depend on which others are still going; ``active`` None: all rows are."""
    scores = processors(history, logits)
    if sampling.temperature > 0:
        probs = torch.softmax(scores, dim=-1)
        if keyed is not None:
            drawing = range(rows) if active is None else active.tolist()
            noise = keyed.draw(drawing, probs.shape[-1], probs.dtype, probs.device)
        else:
            noise = torch.empty((rows, probs.shape[-1]), dtype=probs.dtype, device=probs.device).exponential_(1)
            noise = noise if active is None else noise[active]
        chosen = (probs / noise).argmax(dim=-1)
    else:
        chosen = scores.argmax(dim=-1)
    if not with_log_probs:
        return chosen, None
    return chosen, torch.log_softmax(scores, dim=-1).gather(-1, chosen[:, None]).squeeze(1)


@torch.no_grad()
def sample(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: Sampling,
    step_times: Optional[list[float]] = None,
    with_log_probs: bool = False,
    keyed: Optional[KeyedNoise] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Responses ``[B·n, T]`` (T <= ``max_new_tokens``; rows of a prompt consecutive; EOS kept; pad after it) for
    left-padded prompts ``[B, P]`` with ``prompt_mask`` ``[B, P]``, and with ``with_log_probs`` each token's sampling
    log-prob ``[B·n, T]`` (0 after the EOS; else None); ``step_times`` gets ``time.perf_counter()`` once each step's
    tokens are known (T of them); ``keyed``: each row's own noise (None: torch's random state)."""
    from transformers import DynamicCache

    n, device = sampling.n, prompt_ids.device
    rows = prompt_ids.shape[0] * n
    processors = processors_for(sampling)
    cache = DynamicCache(config=model.config)
    positions = position_ids(prompt_mask.long())
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)  # [B·n, V]
    cache.batch_repeat_interleave(n)
    mask = prompt_mask.repeat_interleave(n, dim=0)
    position = positions[:, -1:].repeat_interleave(n, dim=0)
    tokens = torch.full((rows, sampling.max_new_tokens), sampling.pad_token_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(tokens.shape, device=device) if with_log_probs else None
    active = torch.arange(rows, device=device)  # the rows still sampling, in batch order
    for step in range(sampling.max_new_tokens):
        history = tokens[active, :step]
        chosen, chosen_log_probs = draw(
            processors, sampling, history, logits, rows, active, log_probs is not None, keyed
        )
        tokens[active, step] = chosen
        if log_probs is not None and chosen_log_probs is not None:
            log_probs[active, step] = chosen_log_probs
        going = chosen != sampling.eos_token_id
        any_going = bool(going.any())  # waits for the step's tokens on a GPU
        if step_times is not None:
            step_times.append(time.perf_counter())
        if step + 1 == sampling.max_new_tokens or not any_going:
            return tokens[:, : step + 1], (log_probs[:, : step + 1] if log_probs is not None else None)
        if not bool(going.all()):
            keep = going.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, chosen, mask, position = active[keep], chosen[keep], mask[keep], position[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        position = position + 1
        out = model(
            input_ids=chosen[:, None], attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True
        )
        logits = out.logits[:, -1].float()
    return tokens, log_probs
