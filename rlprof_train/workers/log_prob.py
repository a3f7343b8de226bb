"""The forward pass the actor (old log-probs) and the reference share: log-probs and entropies of the sampled
responses, micro-batch by micro-batch."""

from __future__ import annotations

from typing import Any

import torch

from rlprof_train.batch import MicroBatching, RolloutBatch, gather_rows
from rlprof_train.models import response_log_probs


@torch.no_grad()
def log_prob_pass(
    model: Any, batch: RolloutBatch, batching: MicroBatching, chunked_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies), each ``[B, R]`` (0 on padding), of ``batch``'s responses under ``model`` at the
    batch's sampling temperature; ``chunked_entropy`` computes entropies a chunk of positions at a time."""
    log_probs: list[tuple[list[int], torch.Tensor]] = []
    entropies: list[tuple[list[int], torch.Tensor]] = []
    for rows, micro in batching.split(batch):
        lp, entropy = response_log_probs(
            model,
            micro.input_ids,
            micro.attention_mask,
            micro.response_length,
            batch.temperature,
            with_entropy=True,
            chunked_entropy=chunked_entropy,
            packed=batching.packed,
        )
        assert entropy is not None
        log_probs.append((rows, lp))
        entropies.append((rows, entropy))
    return gather_rows(log_probs, batch.size, batch.response_length), gather_rows(
        entropies, batch.size, batch.response_length
    )
