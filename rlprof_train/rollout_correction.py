"""Rollout correction (verl's ``algorithm.rollout_correction``): the responses were sampled by the rollout's policy
``μ`` (its log-probs ``log μ``, returned with every response), the update trains ``π``; where the two differ (an
engine's kernels and precision, stale weights), importance weights and rejection correct the gradient.

Shapes: ``B`` responses, ``T`` response tokens; every tensor ``[B, T]``, ``mask`` 1 on response tokens. The log
ratio is ``δ = log π - log μ``, clamped to ±``SAFETY_BOUND`` before it is exponentiated.

- **Importance weights** (``rollout_is``): ``token``: ``w_t = exp(δ_t)``; ``sequence``: ``w_t = exp(Σ_t δ_t)`` for
  every token of the response. A single ``rollout_is_threshold`` ``u`` truncates (TIS: ``min(w, u)``); ``"l_u"``
  zeroes weights outside ``[l, u]`` (IcePop). ``rollout_is_batch_normalize`` divides by the batch's mean weight
  (over tokens for ``token``, over responses for ``sequence``; all ranks' responses). Weights carry no gradient.
- **Rejection** (``rollout_rs``, comma-separated, all must pass): divergences ``k1 = -δ``, ``k2 = δ²/2``,
  ``k3 = e^δ - 1 - δ`` per token (``token_k*``), or their sum, mean or max over the response (``seq_sum_k*``,
  ``seq_mean_k*``, ``seq_max_k*``); a token or response outside the threshold leaves the response mask. ``k1``
  options keep ``log l <= k1 <= log u`` (``"l_u"``, or ``u`` alone for ``[1/u, u]``); the others keep ``k <= u``.
- **Modes**: *decoupled* (default): ``π`` is the old policy the trainer recomputes once per step; the weights
  multiply the policy loss per token and the rejection narrows the mask, before the advantages. *bypass*
  (``bypass_mode``): the rollout's log-probs are the old log-probs (no recomputation); each micro-batch computes
  weights and rejection from the current policy, and ``loss_type`` ``ppo_clip`` is PPO's clipped ratio against
  ``μ`` (no extra weights), ``reinforce`` is ``-w·A·log π``.

verl's functions (``verl/trainer/ppo/rollout_corr_helper.py`` at verl-project/verl 1dda039b) are the reference: the
weights, masks and the metrics below equal theirs on the same inputs (tests). Metrics are under ``rollout_corr/``,
each reduced so that a step over several ranks gives the whole batch's value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlprof.metrics import MetricAggregator, Reduce
from rlprof_train.algos import masked_mean, masked_sum

Tensor = torch.Tensor
SAFETY_BOUND = 20.0
"""``|δ|`` is clamped to this before ``exp`` (as verl: ``e^20`` ~ 4.9e8)."""
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
LOSS_TYPES = ("ppo_clip", "reinforce")
PREFIX = "rollout_corr/"
GlobalSum = Callable[[float], float]
"""Σ of a number over the ranks (the identity on one rank)."""


@dataclass(frozen=True)
class Rejection:
    """One ``rollout_rs`` option and its bounds on the divergence (``lower`` for ``k1`` options only, in log)."""

    option: str
    upper: float
    lower: Optional[float] = None


@dataclass(frozen=True)
class Correction:
    """``algorithm.rollout_correction``, parsed (see :func:`parse`)."""

    level: Optional[str] = None
    """``token``, ``sequence`` or None (no importance weights)."""
    upper: float = 2.0
    lower: Optional[float] = None
    """IcePop's lower bound on a weight (None: TIS, truncation at ``upper``)."""
    batch_normalize: bool = False
    rejections: tuple[Rejection, ...] = ()
    bypass: bool = False
    loss_type: str = "ppo_clip"

    @property
    def active(self) -> bool:
        """Anything to compute: weights, rejection, or the rollout's log-probs as the old ones."""
        return self.level is not None or bool(self.rejections) or self.bypass


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


def _bounds(spec: Any) -> tuple[float, Optional[float]]:
    """``u`` or ``"l_u"`` with ``0 < l <= u`` -> ``(u, l or None)``; anything else: ValueError."""
    if isinstance(spec, bool) or spec is None:
        raise ValueError(spec)
    low_text, _, high_text = str(spec).strip().rpartition("_")
    upper, lower = _number(high_text), (_number(low_text) if low_text else None)
    if lower is not None and lower > upper:
        raise ValueError(spec)
    return upper, lower


def parse(settings: Any) -> tuple[Correction, list[str]]:
    """The correction ``settings`` ask for (an object with verl's field names) and every problem with them, each
    naming its key (``algorithm.rollout_correction.<key>``), the value and what is allowed."""
    key = "algorithm.rollout_correction."
    problems: list[str] = []
    level = settings.rollout_is
    if level is not None and level not in IS_LEVELS:
        problems.append(f"{key}rollout_is={level!r}: choose token, sequence or null")
        level = None
    upper, lower = 2.0, None
    spec = settings.rollout_is_threshold
    try:
        if spec is not None or level is not None:  # null: no weights, so no threshold (verl's scripts pass it so)
            upper, lower = _bounds(spec)
    except ValueError:
        problems.append(
            f"{key}rollout_is_threshold={spec!r}: a positive number u (weights truncated at u) or 'l_u' with "
            "0 < l <= u (weights outside [l, u] zeroed)"
        )
    rejections: list[Rejection] = []
    if settings.rollout_rs is not None:
        options = list(dict.fromkeys(o.strip() for o in str(settings.rollout_rs).split(",") if o.strip()))
        unknown = [o for o in options if o not in RS_OPTIONS]
        if unknown or not options:
            problems.append(f"{key}rollout_rs={settings.rollout_rs!r}: options are {', '.join(RS_OPTIONS)}")
        else:
            problems += _rejections(options, settings.rollout_rs_threshold, rejections)
    if settings.loss_type not in LOSS_TYPES:
        problems.append(f"{key}loss_type={settings.loss_type!r}: choose {' or '.join(LOSS_TYPES)}")
    correction = Correction(
        level,
        upper,
        lower,
        bool(settings.rollout_is_batch_normalize),
        tuple(rejections),
        bool(settings.bypass_mode),
        settings.loss_type,
    )
    return correction, problems


def _rejections(options: list[str], spec: Any, into: list[Rejection]) -> list[str]:
    """Fill ``into`` with each option's bounds from ``rollout_rs_threshold`` (one for all, or one per option);
    return the problems."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if spec is not None else []
    if not parts or len(parts) not in (1, len(options)):
        return [f"{key}={spec!r}: one threshold for all of {', '.join(options)} or one per option (comma-separated)"]
    for option, part in zip(options, parts * len(options) if len(parts) == 1 else parts, strict=True):
        try:
            if option.endswith("k1"):
                high, low = _bounds(part)
                into.append(Rejection(option, math.log(high), math.log(low if low is not None else 1.0 / high)))
            else:
                into.append(Rejection(option, _number(part)))
        except ValueError:
            allowed = "'l_u' (0 < l <= u) or u (for [1/u, u])" if option.endswith("k1") else "a positive number"
            return [f"{key}={spec!r}: {option} takes {allowed}, got {part!r}"]
    return []


# ------------------------------------------------------------------------------------------- the computations


def importance_weights(
    log_ratio: Tensor, mask: Tensor, correction: Correction, global_sum: GlobalSum = float
) -> tuple[Tensor, MetricAggregator]:
    """Weights ``[B, T]`` (0 on padding, no gradient) for ``δ = log π - log μ`` and their metrics."""
    assert correction.level is not None
    metrics = MetricAggregator()
    tokens, rows = float(mask.sum()), float(mask.shape[0])
    if correction.level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
    else:
        sequence_log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)  # [B, 1]
        raw = torch.exp(sequence_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio) * mask
    if correction.lower is None:
        weights = raw.clamp(max=correction.upper)
    else:
        weights = torch.where((raw >= correction.lower) & (raw <= correction.upper), raw, torch.zeros_like(raw))
    weights = weights.detach()
    lower = correction.lower if correction.lower is not None else 1.0 / correction.upper
    metrics.add(f"{PREFIX}rollout_is_mean", masked_mean(weights, mask).item(), Reduce.WEIGHTED_MEAN, tokens)
    if correction.level == "token":
        for name, outside in (("high", raw > correction.upper), ("low", raw < lower)):
            share = masked_mean(outside.float(), mask).item()
            metrics.add(f"{PREFIX}rollout_is_ratio_fraction_{name}", share, Reduce.WEIGHTED_MEAN, tokens)
        on = mask.bool()
        metrics.add(f"{PREFIX}rollout_is_max", weights.masked_fill(~on, -math.inf).max().item(), Reduce.MAX)
        metrics.add(f"{PREFIX}rollout_is_min", weights.masked_fill(~on, math.inf).min().item(), Reduce.MIN)
    else:
        sums = sequence_log_ratio.squeeze(-1)
        for name, outside in (("high", sums > math.log(correction.upper)), ("low", sums < math.log(lower))):
            metrics.add(
                f"{PREFIX}rollout_is_ratio_fraction_{name}", outside.float().mean().item(), Reduce.WEIGHTED_MEAN, rows
            )
        metrics.add(f"{PREFIX}rollout_is_max", math.exp(min(sums.max().item(), SAFETY_BOUND)), Reduce.MAX)
        metrics.add(f"{PREFIX}rollout_is_min", math.exp(sums.min().item()), Reduce.MIN)
    if correction.batch_normalize:
        if correction.level == "token":
            total, count = global_sum(float(masked_sum(weights, mask))), global_sum(tokens)
        else:
            per_row = masked_mean(weights, mask, dim=-1)
            answered = (mask.sum(-1) > 0).float()
            total, count = global_sum(float((per_row * answered).sum())), global_sum(float(answered.sum()))
        mean = total / max(count, 1e-8)
        if mean > 1e-8:
            weights = weights / mean
        metrics.add(f"{PREFIX}rollout_is_batch_norm_factor", mean if mean > 1e-8 else 1.0, Reduce.LAST)
    return weights, metrics


def rejection_mask(log_ratio: Tensor, mask: Tensor, correction: Correction) -> tuple[Tensor, MetricAggregator]:
    """The response mask without the tokens and responses a rejection option refuses, and its metrics."""
    metrics = MetricAggregator()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergences = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    on = mask.bool()
    keep_all = torch.ones_like(on)
    tokens, rows = float(mask.sum()), float(mask.shape[0])
    for rejection in correction.rejections:
        scope, _, estimator = rejection.option.rpartition("_")
        value = divergences[estimator]
        if scope == "seq_sum":
            value = masked_sum(value, mask, dim=-1).unsqueeze(-1)
        elif scope == "seq_mean":
            value = masked_mean(value, mask, dim=-1).unsqueeze(-1)
        elif scope == "seq_max":
            worst = value.masked_fill(~on, -math.inf).max(dim=-1).values
            value = torch.where(torch.isinf(worst), torch.zeros_like(worst), worst).unsqueeze(-1)
        keep = value <= rejection.upper
        if rejection.lower is not None:
            keep = keep & (value >= rejection.lower)
        keep = keep.expand_as(on)
        keep_all = keep_all & keep
        name = f"{PREFIX}rollout_rs_{rejection.option}"
        metrics.add(f"{name}_masked_fraction", masked_mean((~keep).float(), mask).item(), Reduce.WEIGHTED_MEAN, tokens)
        refused_rows = (~keep & on).any(dim=-1).float()
        answered = (mask.sum(-1) > 0).float()
        metrics.add(
            f"{name}_seq_masked_fraction",
            float((refused_rows * answered).sum() / answered.sum().clamp(min=1)),
            Reduce.WEIGHTED_MEAN,
            float(answered.sum()),
        )
    kept = mask * keep_all.to(mask.dtype)
    metrics.add(
        f"{PREFIX}rollout_rs_masked_fraction",
        masked_mean(1 - keep_all.float(), mask).item(),
        Reduce.WEIGHTED_MEAN,
        tokens,
    )
    refused = (~(keep_all & on) & on).any(dim=-1).float().mean().item()
    metrics.add(f"{PREFIX}rollout_rs_seq_masked_fraction", refused, Reduce.WEIGHTED_MEAN, rows)
    return kept, metrics


def off_policy_metrics(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> MetricAggregator:
    """How far ``π`` is from ``μ`` on the sampled tokens: ``kl`` ``E[log μ - log π]``, ``k3_kl``
    ``E[e^δ - δ - 1]``, the perplexities ``exp(-mean_t log p)`` (a mean over responses), ``log_ppl_diff`` (its
    mean, mean size, max and min over responses), and
    ``chi2_token`` ``E[e^{2δ}] - 1``, ``chi2_seq`` ``E_i[e^{2 Σ_t δ}] - 1``."""
    metrics = MetricAggregator()
    tokens, rows = float(mask.sum()), float(mask.shape[0])
    delta = log_prob - rollout_log_prob
    token_means = {
        "kl": -delta,
        "k3_kl": torch.exp(delta) - delta - 1,
        "chi2_token": torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square() - 1.0,
    }
    for name, values in token_means.items():
        metrics.add(f"{PREFIX}{name}", masked_mean(values, mask).item(), Reduce.WEIGHTED_MEAN, tokens)
    training, rollout = masked_mean(log_prob, mask, dim=-1), masked_mean(rollout_log_prob, mask, dim=-1)  # [B]
    sequence_sum = masked_sum(delta, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    row_means = {
        "training_ppl": torch.exp(-training),
        "training_log_ppl": -training,
        "rollout_ppl": torch.exp(-rollout),
        "rollout_log_ppl": -rollout,
        "log_ppl_diff": rollout - training,
        "log_ppl_abs_diff": (rollout - training).abs(),
        "ppl_ratio": torch.exp(rollout - training),
        "chi2_seq": torch.exp(2.0 * sequence_sum) - 1.0,
    }
    for name, values in row_means.items():
        metrics.add(f"{PREFIX}{name}", values.mean().item(), Reduce.WEIGHTED_MEAN, rows)
    metrics.add(f"{PREFIX}log_ppl_diff_max", (rollout - training).max().item(), Reduce.MAX)
    metrics.add(f"{PREFIX}log_ppl_diff_min", (rollout - training).min().item(), Reduce.MIN)
    return metrics


def correct(
    log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, correction: Correction, global_sum: GlobalSum = float
) -> tuple[Optional[Tensor], Tensor, MetricAggregator]:
    """(importance weights or None, the response mask after rejection, the metrics) for ``π``'s log-probs
    ``log_prob`` against the rollout's, as verl's ``compute_rollout_correction_and_rejection_mask``."""
    with torch.no_grad():
        log_ratio = log_prob - rollout_log_prob
        metrics = MetricAggregator()
        weights = None
        if correction.level is not None:
            weights, weight_metrics = importance_weights(log_ratio, mask, correction, global_sum)
            metrics.merge(weight_metrics)
        kept = mask
        if correction.rejections:
            kept, rejection_metrics = rejection_mask(log_ratio, mask, correction)
            metrics.merge(rejection_metrics)
        metrics.merge(off_policy_metrics(log_prob, rollout_log_prob, mask))
    return weights, kept, metrics
