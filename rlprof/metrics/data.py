"""Data metrics of a PPO batch: scores, rewards, advantages, returns, values and lengths (verl's names)."""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    values = values.detach().float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(
    *,
    token_level_scores: Tensor,
    token_level_rewards: Tensor,
    advantages: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    prompt_lengths: Tensor,
    max_response_length: int,
    max_prompt_length: int,
    values: Optional[Tensor] = None,
) -> dict[str, float]:
    """Batch statistics, all ``{mean, max, min}``; per-token tensors are ``[B, T]`` over response tokens.

    - ``critic/score``, ``critic/rewards``: per sequence, the sum over its tokens (score before, reward after
      the KL penalty);
    - ``critic/advantages``, ``critic/returns``, ``critic/values`` (when given): over the real response tokens;
    - ``response_length``, ``prompt_length`` (``prompt_lengths``: ``[B]``), each with ``clip_ratio``: the share
      of sequences that hit their maximum length.
    """
    mask = response_mask.bool()
    response_lengths = response_mask.sum(-1).float()
    prompt_lengths = prompt_lengths.float()
    metrics = {
        **_stats("critic/score", (token_level_scores * response_mask).sum(-1)),
        **_stats("critic/rewards", (token_level_rewards * response_mask).sum(-1)),
        **_stats("critic/advantages", advantages[mask]),
        **_stats("critic/returns", returns[mask]),
        **_stats("response_length", response_lengths),
        "response_length/clip_ratio": (response_lengths >= max_response_length).float().mean().item(),
        **_stats("prompt_length", prompt_lengths),
        "prompt_length/clip_ratio": (prompt_lengths >= max_prompt_length).float().mean().item(),
    }
    if values is not None:
        metrics.update(_stats("critic/values", values[mask]))
    return metrics
