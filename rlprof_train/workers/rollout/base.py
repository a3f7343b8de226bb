"""What a rollout backend does: turn prompts into a :class:`RolloutBatch` of sampled responses."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

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


class Rollout(ABC):
    """Generates responses for prompts; ``sync_weights`` makes it sample from the actor's current weights."""

    name = "rollout"

    @abstractmethod
    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch: ...

    def sync_weights(self) -> None:
        """Load the actor's latest weights (a no-op for backends that sample from the actor's own module)."""

    def close(self) -> None:
        """Finish what the backend records (e.g. an engine-side profile)."""


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


def ignored_knobs_note(rollout_cfg: Any, backend: str, knobs: tuple[str, ...]) -> str:
    """One log line naming the vLLM knobs a backend does not use, with their values."""
    values = ", ".join(f"{k}={getattr(rollout_cfg, k)}" for k in knobs)
    return f"rollout: the {backend} backend ignores the vLLM engine settings {values}"
