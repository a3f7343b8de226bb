"""What a rollout backend does: turn prompts into a :class:`RolloutBatch` of sampled responses."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlprof_train.batch import RolloutBatch
from rlprof_train.data import Example, left_pad


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled. ``temperature == 0`` means greedy."""

    n: int
    temperature: float
    top_p: float
    top_k: int  # -1: off
    response_length: int
    seed: int = 0
    """The generation round's seed: prompt ``p``'s noise key is ``noise_key(seed, p.index)`` (:func:`prompt_keys`),
    so a prompt of a round gets the same responses whichever batch, chunk, rank or pool samples it."""


def noise_key(*parts: int) -> int:
    """A 63-bit key from integers (a seed, a prompt, a response index, a context length, ...): distinct parts give
    unrelated keys (each part mixed in with SplitMix64's finaliser)."""
    key = 0x9E3779B97F4A7C15
    for part in parts:
        key = (key ^ (part & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        key ^= key >> 31
        key = key * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        key ^= key >> 29
    return key >> 1


def prompt_keys(prompts: Sequence[Example], sampling: SamplingParams) -> list[int]:
    """Each prompt's noise key in this round (what :meth:`ContinuingRollout.complete` takes for a first turn)."""
    return [noise_key(sampling.seed, p.index) for p in prompts]


def trajectory_keys(keys: Sequence[int], n: int, rows: Sequence[int]) -> list[int]:
    """The own key of each trajectory ``rows[i]`` (response ``row % n`` of prompt ``row // n``, whose key is in
    ``keys``): what a trajectory continued on its own (a later turn, a later segment) is completed with."""
    return [noise_key(keys[row // n], row % n) for row in rows]


def row_keys(keys: Sequence[int], n: int, contexts: Sequence[Sequence[int]]) -> list[int]:
    """The noise key of each of the ``n`` continuations of each context (context ``i``'s at ``i*n .. i*n+n-1``):
    its context's key, its index among the ``n`` and the context's length (a trajectory continued later draws
    afresh)."""
    return [noise_key(key, j, len(context)) for key, context in zip(keys, contexts, strict=True) for j in range(n)]


@dataclass(frozen=True)
class Completion:
    """One sampled continuation: its tokens (cut after the first EOS, which stays) and, from backends that return
    them, the sampling distribution's log-prob of each."""

    token_ids: list[int]
    log_probs: Optional[list[float]] = None


@dataclass
class Completions:
    """What :meth:`Rollout.complete` sampled, with the engine's timing of it (:mod:`.engine_stats`)."""

    rows: list[Completion]
    requests: list[Any] = field(default_factory=list)
    """``RequestTimes`` of each request the engine timed (none when it keeps no times)."""
    occupancy: Optional[tuple[int, int]] = None
    """hf: (tokens sampled, rows x decode steps)."""
    kv_cache_usage: list[float] = field(default_factory=list)
    """vllm: the KV cache's use (0..1) at each engine iteration (none when the engine keeps no statistics)."""


class Rollout(ABC):
    """Generates responses for prompts; ``sync_weights`` makes it sample from the actor's current weights.

    The contract (register a backend with :func:`~rlprof_train.workers.rollout.registry.register_rollout`):

    - ``generate(prompts, sampling)`` returns a :class:`RolloutBatch` of ``len(prompts) * sampling.n`` rows, prompt
      ``i``'s responses at rows ``i*n .. i*n+n-1``, each cut after its first EOS and right-padded to
      ``sampling.response_length`` (:func:`build_rollout_batch` assembles exactly that from token ids). It runs on
      every rank with that rank's prompts, inside the trainer's ``rollout/gen`` range, so every rlprof tool's window
      covers it with nothing to do; a backend registered with ``returns_log_probs`` also sets
      ``batch.extras["rollout_log_probs"]`` ([B, T], the sampling distribution's log-probs, 0 outside the response).
    - A backend that can continue token sequences is a :class:`ContinuingRollout` (registered with
      ``continues=True``): multi-turn rollouts (:mod:`~rlprof_train.workers.rollout.multi_turn`) run on it.
    - ``warm_up(prompts, sampling)`` runs once before the first step with that step's prompts.
    - ``sync_weights()`` runs after every actor update (inside ``rollout/update_weights``) and after a resume.
    - ``close()`` runs once at the end, also after a failure.
    - A backend whose engine records on its own (an engine-side profiler) follows rlprof's windows as a
      :class:`rlprof.window.WindowListener` (``rlprof.get_session().add_window_listener(self)``), publishes what the
      engine wrote with ``session.record_output(..., format=...)`` so ``rlprof report`` finds it, and removes itself
      in ``close()`` (see :mod:`~rlprof_train.workers.rollout.vllm`).
    """

    name = "rollout"
    """The registered name (set by the registry)."""

    @abstractmethod
    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch: ...

    def warm_up(self, prompts: list[Example], sampling: SamplingParams) -> bool:
        """Compile what a ``generate`` call with these prompts would compile first, and say whether there was
        anything to compile (not for backends that compile nothing, or compile when they start); the trainer times it
        before its first step as ``timing_s/rollout_compile``."""
        return False

    def sync_weights(self) -> None:
        """Load the actor's latest weights (a no-op for backends that sample from the actor's own module)."""

    def close(self) -> None:
        """Finish what the backend records (e.g. an engine-side profile) and stop what it started (an engine)."""


class ContinuingRollout(Rollout):
    """A backend that also continues token sequences: what a multi-turn rollout needs from it."""

    @abstractmethod
    def complete(
        self,
        contexts: Sequence[Sequence[int]],
        n: int,
        budgets: Sequence[int],
        sampling: SamplingParams,
        keys: Sequence[int],
    ) -> Completions:
        """``n`` continuations of each of ``contexts`` (context ``i``'s at rows ``i*n .. i*n+n-1``), continuation
        ``i`` of at most ``budgets[i]`` tokens, sampled as ``sampling`` says (its ``n``, ``response_length`` and
        ``seed`` are not used). ``keys[i]``: context ``i``'s noise key (:func:`prompt_keys` for prompts, a
        trajectory's own for one continued); each continuation draws from its :func:`row_keys` key, so its tokens
        depend on the key and the weights only."""


def build_rollout_batch(
    prompts: list[Example], response_ids: list[list[int]], sampling: SamplingParams, pad_id: int, eos_id: int
) -> RolloutBatch:
    """Assemble prompts (each repeated n times, in order) and their responses into a :class:`RolloutBatch`.

    Responses are cut after their first EOS (which stays, masked in) and right-padded to ``response_length``.
    """
    n, response_length = sampling.n, sampling.response_length
    prompt_ids, prompt_mask = left_pad([p.prompt_ids for p in prompts for _ in range(n)], pad_id)
    lengths = [len(r) for r in response_ids]
    width = max([response_length, *lengths])
    generated = torch.tensor([[*r, *[pad_id] * (width - len(r))] for r in response_ids], dtype=torch.long)
    generated = generated.reshape(len(response_ids), width)[:, :response_length]
    is_eos = (generated == eos_id).long()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0  # an EOS came strictly before this position
    generated_here = torch.arange(response_length) < torch.tensor(lengths, dtype=torch.long)[:, None]
    response_mask = (generated_here & ~after_eos).long()
    responses = torch.where(response_mask.bool(), generated, torch.full_like(generated, pad_id))
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        response_mask=response_mask,
        prompt_length=prompt_ids.shape[1],
        uid=[p.index for p in prompts for _ in range(n)],
        data_source=[p.data_source for p in prompts for _ in range(n)],
        ground_truth=[p.ground_truth for p in prompts for _ in range(n)],
        n=n,
        temperature=sampling.temperature,
    )


def completions_batch(
    prompts: list[Example], sampled: Completions, sampling: SamplingParams, pad_id: int, eos_id: int
) -> RolloutBatch:
    """The single-turn batch of ``sampled`` (``sampling.n`` completions per prompt, in order), with what the backend
    measured: ``extras["rollout_log_probs"]`` when it returned log-probs, the engine's request times, occupancy and
    KV-cache use."""
    batch = build_rollout_batch(prompts, [c.token_ids for c in sampled.rows], sampling, pad_id, eos_id)
    if any(c.log_probs is not None for c in sampled.rows):
        rollout_log_probs = torch.zeros(batch.response_mask.shape)
        for row, completion in enumerate(sampled.rows):
            values = (completion.log_probs or [])[: batch.response_length]
            rollout_log_probs[row, : len(values)] = torch.tensor(values)
        batch.extras["rollout_log_probs"] = rollout_log_probs * batch.response_mask
    if sampled.requests:
        batch.extras["engine_requests"] = sampled.requests
    if sampled.occupancy is not None:
        batch.extras["engine_occupancy"] = sampled.occupancy
    if sampled.kv_cache_usage:
        batch.extras["engine_kv_cache_usage"] = sampled.kv_cache_usage
    return batch
