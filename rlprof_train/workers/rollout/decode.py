"""The hf rollout's sampling loop: transformers ``generate``'s sampling, with less computed.

Two savings, neither of which changes a sampled token:

- **one prefill per prompt**: the n responses of a prompt share its prefill; the KV cache is repeated n times
  after it (``generate(num_return_sequences=n)`` prefills every copy);
- **finished rows leave the batch**: a row that sampled EOS is dropped from the cache and from every later
  forward (``generate`` keeps computing it until the last row ends, then throws the tokens away).

Sampling is ``generate``'s, step for step: the same logits processors in the same order (non-finite removal,
temperature, top-k, top-p), and ``torch.multinomial(p, 1)``'s own rule, ``argmax(p / q)`` with ``q ~ Exp(1)``. The
noise ``q`` comes from one of two sources:

- **keyed** (what the trainer uses): each row has a key (:func:`~.base.row_keys`: from the round's seed, its
  prompt, its response index and its context's length) and its noise at decode step ``s`` for token ``v`` is a hash
  of (key, s, v) (:func:`keyed_exponential`). A response's tokens then depend on its key and the model only: not on
  the batch it is sampled in, its chunk, the rank or process that samples it, or how the processes are split into
  pools (tested: alone and in a batch, the same tokens);
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


_MASK32 = 0xFFFFFFFF


def _low32_product(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``(x * factor) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` and a 32-bit ``factor``, without an int64
    overflow (each partial product stays below ``2**49``)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * factor + (((high * factor) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection of ``[0, 2**32)`` that spreads every input bit over the output)."""
    x = x ^ (x >> 16)
    x = _low32_product(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _low32_product(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def keyed_exponential(keys: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[A, vocab]`` (float32) for rows of ``keys`` ``[A]`` (int64, :func:`~.base.row_keys`) at decode
    step ``step``: element ``(a, v)`` is ``-log(u)`` with ``u`` the top 24 bits of a hash of ``(keys[a], step, v)``,
    plus one half, over ``2**24`` (so ``0 < u < 1``: never an infinite or zero noise). A row's noise is a function of
    its key alone: which other rows share its batch changes nothing."""
    device = keys.device
    step_part = _mix32(torch.tensor(step & _MASK32, dtype=torch.int64, device=device) ^ 0x68E31DA4)
    row = _mix32((keys & _MASK32) ^ _mix32((keys >> 32) ^ step_part))  # [A]
    token = _mix32(torch.arange(vocab, dtype=torch.int64, device=device) ^ 0x1B873593)  # [V]
    hashed = _mix32(_mix32(row[:, None] ^ token[None, :]) ^ row[:, None])  # [A, V]
    uniform = ((hashed >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return -torch.log(uniform)


def draw(
    processors: Any,
    sampling: Sampling,
    history: torch.Tensor,
    logits: torch.Tensor,
    rows: int,
    active: Optional[torch.Tensor] = None,
    with_log_probs: bool = False,
    keys: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One step's tokens ``[A]`` for the ``active`` rows' last logits ``[A, V]`` (``history``: their tokens so far,
    ``[A, step]``), and with ``with_log_probs`` each token's log-prob under the processed scores it was drawn from.
    With ``keys`` (``[rows]``, every row's noise key) the noise is :func:`keyed_exponential` of the active
    rows' keys at this step; without, torch's random state gives the exponential noise of
    ``torch.multinomial(p, 1)`` for all ``rows`` of the batch, finished rows included. Either way the draws of a row
    do not depend on which others are still going; ``active`` None: all rows are."""
    scores = processors(history, logits)
    if sampling.temperature > 0:
        probs = torch.softmax(scores, dim=-1)
        if keys is not None:
            noise = keyed_exponential(keys if active is None else keys[active], history.shape[1], probs.shape[-1])
        else:
            noise = torch.empty((rows, probs.shape[-1]), dtype=probs.dtype, device=probs.device).exponential_(1)
            noise = noise if active is None else noise[active]
        chosen = (probs / noise.to(probs.dtype)).argmax(dim=-1)
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
    keys: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Responses ``[B·n, T]`` (T <= ``max_new_tokens``; rows of a prompt consecutive; EOS kept; pad after it) for
    left-padded prompts ``[B, P]`` with ``prompt_mask`` ``[B, P]``, and with ``with_log_probs`` each token's sampling
    log-prob ``[B·n, T]`` (0 after the EOS; else None); ``step_times`` gets ``time.perf_counter()`` once each step's
    tokens are known (T of them); ``keys`` ``[B·n]``: each row's noise key (None: torch's random state)."""
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
            processors, sampling, history, logits, rows, active, log_probs is not None, keys
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
