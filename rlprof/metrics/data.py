"""Data metrics of a PPO batch: scores, rewards, advantages, returns, values and lengths (verl's names), and the
seed's reward statistics."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch import Tensor


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    """``{prefix}/mean, max, min``; NaN for an empty selection (verl's convention), said once per prefix."""
    values = values.detach().float()
    if values.numel() == 0:
        warnings.warn(
            f"{prefix}: no values in this batch (every response is empty); reported as NaN",
            RuntimeWarning,
            stacklevel=3,
        )
        return {f"{prefix}/{stat}": float("nan") for stat in ("mean", "max", "min")}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


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
    response_lengths: Optional[Tensor] = None,
) -> dict[str, float]:
    """Batch statistics, all ``{mean, max, min}``; per-token tensors are ``[B, T]`` over response tokens.

    ``response_mask`` marks the tokens the policy sampled; ``response_lengths`` ``[B]`` counts each response's real
    tokens when they are more (a multi-turn response holds tool replies, which verl counts in ``response_length``;
    default: ``response_mask``'s sum).

    - ``critic/score``, ``critic/rewards``: per sequence, the sum over its tokens (score before, reward after the
      KL penalty), over the responses that are not empty (an *aborted* response has no token);
    - ``response/aborted_ratio``: the share of empty responses; ``response_length_non_aborted/*`` the lengths of
      the others (verl's handling of generation that returned nothing);
    - ``critic/advantages``, ``critic/returns``, ``critic/values`` (when given): over the real response tokens;
      with values, ``critic/vf_explained_var = 1 - Var(returns - values) / (Var(returns) + 1e-5)``;
    - ``response_length``, ``prompt_length`` (``prompt_lengths``: ``[B]``), each with ``clip_ratio``: the share
      of sequences that hit their maximum length; ``response_length/p99`` (linear interpolation), the long tail
      that a batch's generation waits for;
    - the seed's ``reward/{mean,std,max,min}``: the same sequence rewards as ``critic/rewards``, with their
      (unbiased) standard deviation.
    """
    import torch

    mask = response_mask.bool()
    response_lengths = (response_mask.sum(-1) if response_lengths is None else response_lengths).float()
    prompt_lengths = prompt_lengths.float()
    aborted = response_lengths == 0
    sequence_rewards = (token_level_rewards * response_mask).sum(-1)[~aborted]
    metrics = {
        **_stats("critic/score", (token_level_scores * response_mask).sum(-1)[~aborted]),
        **_stats("critic/rewards", sequence_rewards),
        **_stats("critic/advantages", advantages[mask]),
        **_stats("critic/returns", returns[mask]),
        **_stats("response_length", response_lengths),
        "response_length/clip_ratio": (response_lengths >= max_response_length).float().mean().item(),
        "response_length/p99": torch.quantile(response_lengths, 0.99).item() if response_lengths.numel() else math.nan,
        "response/aborted_ratio": aborted.float().mean().item(),
        **_stats("prompt_length", prompt_lengths),
        "prompt_length/clip_ratio": (prompt_lengths >= max_prompt_length).float().mean().item(),
    }
    kept = response_lengths[~aborted]
    metrics.update(_stats("response_length_non_aborted", kept))
    metrics["response_length_non_aborted/clip_ratio"] = (
        (kept >= max_response_length).float().mean().item() if kept.numel() else float("nan")
    )
    for stat in ("mean", "max", "min"):
        metrics[f"reward/{stat}"] = metrics[f"critic/rewards/{stat}"]
    metrics["reward/std"] = sequence_rewards.std().item() if sequence_rewards.numel() > 1 else 0.0
    if values is not None:
        metrics.update(_stats("critic/values", values[mask]))
        valid_returns, valid_values = returns[mask].float(), values[mask].float()
        if valid_returns.numel() > 1:
            explained = 1.0 - (valid_returns - valid_values).var() / (valid_returns.var() + 1e-5)
            metrics["critic/vf_explained_var"] = explained.item()
        else:
            metrics["critic/vf_explained_var"] = float("nan")
    return metrics
