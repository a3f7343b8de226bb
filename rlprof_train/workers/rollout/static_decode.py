"""The hf rollout's compiled decode (``rollout.enforce_eager=false``): transformers' static KV cache and its compiled
forward, with shapes that stay the same from step to step and from call to call.

A decode step of a small model is a few hundred kernel launches and little arithmetic, so on a GPU its time is the
host's; compiling the step (``torch.compile`` of the model's forward on transformers' ``StaticCache``, as
transformers documents it; CUDA graphs on a GPU) makes it one replay. A compiled step needs fixed shapes, so unlike
the eager loop (:mod:`.decode`), whose batch shrinks as rows finish, this loop keeps every row to the end:

- the batch is ``bucket(prompts) · n`` rows (the padding rows repeat the last prompt; their tokens are thrown away);
- the cache holds ``bucket(prompt length + new tokens)`` positions (:func:`bucket`: a power of two, at least 16),
  the attention mask covers all of them (positions after the current one are masked by the cache position);
- a finished row goes on computing with pad as its input, its tokens pad.

So a run compiles one decode step per (rows, positions) bucket: one for training, one for validation, a few more
for multi-turn contexts that grow; past :data:`MAX_SHAPES` of them a new shape decodes eagerly (said once) instead of
compiling again. Each cache is kept for the next call with its shape (a CUDA graph replays on the same buffers).
Sampling is the eager loop's (:func:`.decode.draw`: the same processors and the same noise for the real rows): from
the same keys (or the same random state) and weights, the tokens are the eager loop's up to the compiled kernels'
float rounding (greedy tokens equal on the CPU; tested). The prefill runs eagerly, its shape varies with the prompts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch

from rlprof_train.models import CompiledForward, position_ids
from rlprof_train.workers.rollout.decode import KeyedNoise, Sampling, draw, processors_for, sample

MIN_BUCKET = 16
KEPT_CACHES = 4
"""Static caches kept between calls, least recently used dropped first (each is rows x positions x layers x 2)."""
MAX_SHAPES = 32
"""Decode shapes compiled at most for one decoder: each costs a compile and, on a GPU, its CUDA graph's memory; a call
of a new shape past them samples with the eager loop (:func:`.decode.sample`, the same tokens)."""


def bucket(size: int) -> int:
    """The power of two at least ``size`` and at least :data:`MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << (max(size, 1) - 1).bit_length())


def prompt_bucket(prompts: int) -> int:
    """Prompts a compiled batch holds for ``prompts`` real ones: the power of two at least ``prompts``."""
    return 1 << (max(prompts, 1) - 1).bit_length()


class StaticDecoder:
    """Compiled decode steps of one model, with the static caches of the shapes seen so far.

    ``log`` is told each shape's compile (the time of its first decode step, where ``torch.compile`` traces and
    compiles it) and, once, that new shapes decode eagerly past ``max_shapes``; ``compiled`` holds the shapes
    (rows, positions, dtype) compiled, in order, with their compile times."""

    def __init__(self, log: Callable[[str], None], max_shapes: int = MAX_SHAPES) -> None:
        self.log = log
        self.max_shapes = max(1, max_shapes)
        self.compiled: dict[tuple[int, int, torch.dtype], float] = {}
        self.caches: OrderedDict[tuple[int, int, torch.dtype], Any] = OrderedDict()
        self._forward: Optional[CompiledForward] = None
        self._said_eager = False

    def _cache(self, model: Any, shape: tuple[int, int, torch.dtype]) -> Any:
        """The static cache for this shape, reset."""
        from transformers import StaticCache

        cache = self.caches.pop(shape, None)
        if cache is None:
            cache = StaticCache(config=model.config, max_cache_len=shape[1])
        else:
            cache.reset()
        self.caches[shape] = cache
        while len(self.caches) > KEPT_CACHES:
            self.caches.popitem(last=False)
        return cache

    def _past_most_shapes(self, shape: tuple[int, int, torch.dtype]) -> bool:
        """Whether the new ``shape`` is past ``max_shapes`` (said once), so that it decodes eagerly."""
        if len(self.compiled) < self.max_shapes:
            return False
        if not self._said_eager:
            self.log(
                f"rollout: {len(self.compiled)} decode shapes are compiled (the most kept); {shape[0]} rows x "
                f"{shape[1]} positions and any other new shape decode eagerly"
            )
            self._said_eager = True
        return True

    def compiled_forward(self, model: Any) -> Any:
        """``model``'s forward compiled as transformers documents for its static cache (whole graph, static shapes,
        CUDA graphs on a GPU), once per model."""
        if self._forward is None or self._forward.module is not model:
            mode = "reduce-overhead" if next(model.parameters()).device.type == "cuda" else "default"
            self._forward = CompiledForward(model, fullgraph=True, dynamic=False, mode=mode)
        return self._forward

    @torch.no_grad()
    def sample(
        self,
        model: Any,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        step_times: Optional[list[float]] = None,
        with_log_probs: bool = False,
        steps: Optional[int] = None,
        keyed: Optional[KeyedNoise] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """What :func:`.decode.sample` returns for the same arguments: responses ``[B·n, T]`` and with
        ``with_log_probs`` their sampling log-probs; ``steps`` caps the decode steps below ``max_new_tokens`` (a
        warm-up compiles with a few); ``keyed``: each real row's own noise (None: torch's random state)."""
        n, device = sampling.n, prompt_ids.device
        prompts, width = prompt_ids.shape
        padded = prompt_bucket(prompts)
        rows, real = padded * n, prompts * n
        positions = bucket(width + sampling.max_new_tokens)
        shape = (rows, positions, next(model.parameters()).dtype)
        new_shape = shape not in self.compiled
        if new_shape and self._past_most_shapes(shape):
            return sample(model, prompt_ids, prompt_mask, sampling, step_times, with_log_probs, keyed)
        if padded > prompts:  # padding rows: the last prompt again
            extra = padded - prompts
            prompt_ids = torch.cat([prompt_ids, prompt_ids[-1:].expand(extra, -1)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[-1:].expand(extra, -1)])
        cache = self._cache(model, shape)
        ids, mask = prompt_ids.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0)
        full_mask = torch.cat([mask, mask.new_ones((rows, positions - width))], dim=1)  # [rows, positions]
        position = position_ids(mask.long())
        out = model(
            input_ids=ids,
            attention_mask=full_mask[:, :width],
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(width, device=device),
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].float()
        position = position[:, -1:]
        processors = processors_for(sampling)
        total = min(sampling.max_new_tokens, steps or sampling.max_new_tokens)
        tokens = torch.full((real, total), sampling.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros(tokens.shape, device=device) if with_log_probs else None
        done = torch.zeros(real, dtype=torch.bool, device=device)
        step_input = torch.full((rows, 1), sampling.pad_token_id, dtype=torch.long, device=device)
        compiled = self.compiled_forward(model)
        for step in range(total):
            history = tokens[:, :step]
            chosen, chosen_log_probs = draw(
                processors, sampling, history, logits[:real], real, None, with_log_probs, keyed
            )
            chosen = chosen.masked_fill(done, sampling.pad_token_id)
            tokens[:, step] = chosen
            if log_probs is not None and chosen_log_probs is not None:
                log_probs[:, step] = chosen_log_probs.masked_fill(done, 0.0)
            done = done | (chosen == sampling.eos_token_id)
            all_done = bool(done.all())  # waits for the step's tokens on a GPU
            if step_times is not None:
                step_times.append(time.perf_counter())
            if step + 1 == total or all_done:
                return tokens[:, : step + 1], (log_probs[:, : step + 1] if log_probs is not None else None)
            step_input[:real, 0] = chosen
            position = position + 1
            started = time.perf_counter()
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out = compiled(
                input_ids=step_input,
                attention_mask=full_mask,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.full((1,), width + step, dtype=torch.long, device=device),
            )
            logits = out.logits[:, -1].float()
            if new_shape:
                self.compiled[shape] = time.perf_counter() - started
                self.log(
                    f"rollout: compiled the decode step for {rows} rows x {positions} positions in "
                    f"{self.compiled[shape]:.1f} s"
                )
                new_shape = False
        return tokens, log_probs
