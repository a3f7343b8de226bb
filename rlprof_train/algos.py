"""PPO's formulas as pure functions over tensors and masks: no torch.distributed, no I/O, no state but the KL
controllers' coefficient.

Shapes: ``B`` sequences (responses), ``T`` response tokens (right-padded); ``mask`` is ``[B, T]`` with 1 on real
response tokens and 0 on padding. Every returned per-token tensor is 0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch

Tensor = torch.Tensor
GroupIndex = Union[Tensor, Sequence[Hashable]]

# ----------------------------------------------------------------------------------------------- masked helpers


def masked_sum(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """``Σ values·mask`` over ``dim`` (all elements when None). values, mask: same shape; ``dim`` is reduced.

    Values outside the mask are replaced by 0 first (``where``, as verl does), so a NaN or inf on padding never
    reaches the sum."""
    masked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)) * mask
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """``Σ values·mask / Σ mask`` over ``dim`` (all when None); 0 where the mask is empty. Shapes as masked_sum."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked elements: ``Σ (x-μ)²·mask / (N-1)`` (``/ N`` when not unbiased), N = Σ mask.

    values, mask: same shape; returns a scalar."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    squares = masked_sum((values - mean) ** 2, mask)
    if unbiased:
        if count <= 1:
            raise ValueError(f"masked_var: the unbiased variance needs at least 2 masked elements, got {int(count)}")
        return squares / (count - 1)
    return squares / count.clamp(min=1)


Total = Callable[[float], float]
"""Σ of a number over the ranks that hold the batch's rows (``DistEnv.sum``; the identity on one process)."""


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, total: Optional[Total] = None
) -> Tensor:
    """``(x - μ) / sqrt(σ² + eps)`` with μ, σ² (unbiased) over the masked elements (μ added back when not
    shift_mean). With ``total``, μ and σ² are over the masked elements of every rank's rows: the whole batch's, as
    verl whitens the batch it holds whole, however the batch is split over processes.

    values, mask: same shape; returns values' shape."""
    if total is None:
        mean, variance = masked_mean(values, mask), masked_var(values, mask)
    else:
        count = total(float(mask.sum()))
        if count <= 1:
            raise ValueError(f"masked_whiten: the unbiased variance needs at least 2 masked elements, got {count:g}")
        mean = torch.tensor(total(float(masked_sum(values, mask))) / count, dtype=values.dtype, device=values.device)
        variance = torch.tensor(
            total(float(masked_sum((values - mean) ** 2, mask))) / (count - 1), dtype=values.dtype, device=values.device
        )
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    return whitened if shift_mean else whitened + mean


# ----------------------------------------------------------------------------------------------- advantages

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn(token_level_rewards, mask, *, values, index, gamma, lam, norm_adv_by_std)``
    (keywords it does not use are ignored) returning (advantages, returns), each ``[B, T]``."""

    name: str
    fn: AdvantageFn
    needs_critic: bool
    """Needs the critic's values (the trainer then runs a critic)."""
    needs_groups: bool
    """Compares the n responses of each prompt (needs the group ids, and ``rollout.n >= 2`` unless
    ``groups_of_one``)."""
    groups_of_one: bool = False
    """Defined for ``rollout.n = 1`` too (a group of one: mean 0, std 1, as verl computes it)."""
    needs_baseline: bool = False
    """Needs ``reward_baselines`` ``[B]``: the score of a greedy response to each row's prompt (ReMax); the trainer
    then samples one greedy response per prompt each step."""


ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_estimator(
    name: str,
    *,
    needs_critic: bool = False,
    needs_groups: bool = False,
    groups_of_one: bool = False,
    needs_baseline: bool = False,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an advantage estimator under ``name`` (a value of ``algorithm.adv_estimator``), as verl's
    ``register_adv_est``: the trainer's config check, the critic's presence and the greedy baseline rollout follow
    the flags."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        ADV_ESTIMATORS[name] = AdvantageEstimator(name, fn, needs_critic, needs_groups, groups_of_one, needs_baseline)
        return fn

    return register


def adv_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; unknown names list the registered ones."""
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"algorithm.adv_estimator={name!r} is unknown; choose one of: {', '.join(ADV_ESTIMATORS)}"
        ) from None


@register_adv_estimator("gae", needs_critic=True)
def gae_advantages(
    token_level_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
    total: Optional[Total] = None,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (actor-critic PPO). Returns (advantages, returns), each ``[B, T]``.

    Over the real tokens of each sequence (padding is skipped, not treated as a step):
    ``δ_t = r_t + γ·V_{t+1} - V_t`` (``V`` after the last token = 0), ``A_t = δ_t + γλ·A_{t+1}``,
    ``returns_t = A_t + V_t``. The advantages are then whitened over the batch (``whiten``; every rank's rows with
    ``total``).
    """
    batch, length = token_level_rewards.shape
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in reversed(range(length)):
        m = mask[:, t].to(values.dtype)
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage_t * m
        next_value = values[:, t] * m + next_value * (1 - m)
        next_advantage = advantage_t * m + next_advantage * (1 - m)
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask, total=total) * mask
    return advantages, returns


def _group_ids(index: GroupIndex, batch: int, device: torch.device) -> Tensor:
    if isinstance(index, Tensor):
        keys = index.tolist()
    else:
        keys = list(index)
    if len(keys) != batch:
        raise ValueError(f"index: {len(keys)} group ids for a batch of {batch} sequences")
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in keys], dtype=torch.long, device=device)


def group_mean_std(scores: Tensor, index: GroupIndex) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence (mean, std, size) of its group. scores ``[B]``; std unbiased; a group of one: mean 0, std 1."""
    ids = _group_ids(index, scores.shape[0], scores.device)
    groups = int(ids.max()) + 1 if ids.numel() else 0
    size = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    mean = torch.zeros_like(size).index_add_(0, ids, scores) / size
    squares = torch.zeros_like(size).index_add_(0, ids, (scores - mean[ids]) ** 2)
    std = torch.sqrt(squares / (size - 1).clamp(min=1))
    single = size == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[ids], std[ids], size[ids]


@register_adv_estimator("grpo", needs_groups=True, groups_of_one=True)
def grpo_advantages(
    token_level_rewards: Tensor,
    mask: Tensor,
    index: GroupIndex,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
    **_ignored: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO: each response's score ``s_i = Σ_t r_it`` against its prompt's group of n samples.

    ``A_i = (s_i - mean_g) / (std_g + eps)``, or ``s_i - mean_g`` with ``norm_adv_by_std=False`` (Dr.GRPO);
    broadcast to every response token. A group of one (``rollout.n=1``) has mean 0 and std 1, so ``A_i = s_i / (1 +
    eps)``, as verl computes it. token_level_rewards, mask: ``[B, T]``; index: ``[B]`` group ids (same id = same
    prompt). Returns (A, A), each ``[B, T]``.
    """
    scores = masked_sum(token_level_rewards, mask, dim=-1)
    mean, std, _ = group_mean_std(scores, index)
    advantage = scores - mean
    if norm_adv_by_std:
        advantage = advantage / (std + eps)
    advantages = advantage[:, None] * mask
    return advantages, advantages


@register_adv_estimator("rloo", needs_groups=True, groups_of_one=True)
def rloo_advantages(
    token_level_rewards: Tensor, mask: Tensor, index: GroupIndex, **_ignored: Any
) -> tuple[Tensor, Tensor]:
    """RLOO: the leave-one-out baseline ``A_i = s_i - (Σ_{j≠i in group} s_j) / (n-1)``; a group of one keeps s_i.

    Equivalently ``A_i = n/(n-1)·(s_i - mean_g)``. Broadcast to every response token. token_level_rewards,
    mask: ``[B, T]``; index: ``[B]`` group ids. Returns (A, A), each ``[B, T]``.
    """
    scores = masked_sum(token_level_rewards, mask, dim=-1)
    mean, _, size = group_mean_std(scores, index)
    leave_one_out = torch.where(size > 1, size / (size - 1).clamp(min=1) * (scores - mean), scores)
    advantages = leave_one_out[:, None] * mask
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    token_level_rewards: Tensor, mask: Tensor, gamma: float, total: Optional[Total] = None, **_ignored: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go ``G_t = r_t + γ·G_{t+1}`` over the real tokens of each sequence,
    whitened over the batch (every rank's rows with ``total``).

    Masked positions inside a response (tool output, another turn) are skipped, not steps: the running return is
    carried across them unchanged, so rewards after the hole reach the tokens before it (as in verl and in GAE
    here). token_level_rewards, mask: ``[B, T]``. Returns (whiten(G), G), each ``[B, T]`` (0 on masked positions).
    """
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t].to(token_level_rewards.dtype)
        new_running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new_running * m
        running = new_running * m + running * (1 - m)
    return masked_whiten(returns, mask, total=total) * mask, returns


@register_adv_estimator("reinforce_plus_plus_baseline", needs_groups=True, groups_of_one=True)
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: Tensor, mask: Tensor, index: GroupIndex, total: Optional[Total] = None, **_ignored: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: ``s_i - mean_g`` broadcast to tokens, then whitened over the batch
    (every rank's rows with ``total``).

    token_level_rewards, mask: ``[B, T]``; index: ``[B]`` group ids. Returns (A, A), each ``[B, T]``."""
    scores = masked_sum(token_level_rewards, mask, dim=-1)
    mean, _, _ = group_mean_std(scores, index)
    centred = (scores - mean)[:, None] * mask
    advantages = masked_whiten(centred, mask, total=total) * mask
    return advantages, advantages


@register_adv_estimator("remax", needs_baseline=True)
def remax_advantages(
    token_level_rewards: Tensor, mask: Tensor, reward_baselines: Tensor, **_ignored: Any
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al., 2023): REINFORCE with the score of the prompt's greedy response as the baseline.

    ``returns_t = Σ_{t' >= t} r_t'·m_t'`` (the return to go over the response), ``A_t = returns_t - b·m_t``, with
    ``b`` the greedy response's score (verl's ``compute_remax_outcome_advantage``). token_level_rewards, mask:
    ``[B, T]``; reward_baselines: ``[B]``. Returns (A, returns), each ``[B, T]``.
    """
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines[:, None] * mask
    return advantages, returns


def compute_advantage(
    estimator: str,
    token_level_rewards: Tensor,
    mask: Tensor,
    *,
    values: Optional[Tensor] = None,
    index: Optional[GroupIndex] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: Optional[Tensor] = None,
    total: Optional[Total] = None,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns) by ``algorithm.adv_estimator``; see each estimator for its formula. ``total``: Σ over
    the ranks holding the batch's other rows, for the estimators that whiten over the batch."""
    spec = adv_estimator(estimator)
    if spec.needs_critic and values is None:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs critic values (enable the critic)")
    if spec.needs_groups and index is None:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs group ids (the prompt of each response)")
    if spec.needs_baseline and reward_baselines is None:
        raise ValueError(f"algorithm.adv_estimator={estimator} needs reward_baselines (a greedy response's score)")
    return spec.fn(
        token_level_rewards=token_level_rewards,
        mask=mask,
        values=values,
        index=index,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std=norm_adv_by_std_in_grpo,
        reward_baselines=reward_baselines,
        total=total,
    )


# ----------------------------------------------------------------------------------------------- KL

KL_TYPES: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl")
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kl_type: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference from log-probs of the sampled tokens.

    With ``d = log π(a) - log π_ref(a)``: ``kl`` (k1) = d; ``abs`` = |d|; ``mse`` (k2) = d²/2;
    ``low_var_kl`` (k3) = ``exp(-d) + d - 1`` with d clamped to [-20, 20] before ``exp`` (so neither the value nor
    its gradient overflows) and the result clamped to [-10, 10]. Shapes: ``[B, T]`` in and out.
    """
    kind = KL_ALIASES.get(kl_type, kl_type)
    diff = log_prob - ref_log_prob
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff.square()
    if kind == "low_var_kl":
        diff = diff.clamp(min=-20, max=20)
        return (torch.exp(-diff) + diff - 1).clamp(min=-10, max=10)
    allowed = ", ".join(KL_TYPES + tuple(KL_ALIASES))
    raise ValueError(f"kl_type={kl_type!r} is unknown; choose one of: {allowed}")


def apply_kl_in_reward(
    token_level_scores: Tensor, log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor, kl_coef: float, kl_type: str
) -> tuple[Tensor, Tensor]:
    """KL as a reward penalty: ``r_t = score_t - β·KL_t``. Inputs ``[B, T]``; returns (rewards ``[B, T]``,
    current KL, a scalar).

    The current KL is the batch mean of each sequence's token-mean KL, the signal the adaptive controller follows.
    """
    kl = kl_penalty(log_prob, ref_log_prob, kl_type) * mask
    rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, mask, dim=-1).mean()
    return rewards, current_kl


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, target_kl: float, horizon: int) -> float:
    """The adaptive controller's next β (Ziegler et al. 2019).

    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``β ← β·(1 + e·n_steps / horizon)``.
    """
    error = min(max(current_kl / target_kl - 1, -0.2), 0.2)
    return coef * (1 + error * n_steps / horizon)


@dataclass
class KLController:
    """β for KL in the reward: fixed, or adaptive towards ``target_kl`` over ``horizon`` samples."""

    coef: float
    kind: Literal["fixed", "adaptive"] = "fixed"
    target_kl: Optional[float] = None
    horizon: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "adaptive"):
            raise ValueError(f"algorithm.kl_ctrl.type={self.kind!r} is unknown; choose one of: fixed, adaptive")
        if self.kind == "adaptive" and not (
            self.target_kl and self.target_kl > 0 and self.horizon and self.horizon > 0
        ):
            raise ValueError(
                f"algorithm.kl_ctrl: the adaptive controller needs target_kl > 0 and horizon > 0, "
                f"got target_kl={self.target_kl}, horizon={self.horizon}"
            )

    def update(self, current_kl: float, n_steps: int) -> None:
        """Follow the measured KL after ``n_steps`` samples (fixed: no change)."""
        if self.kind == "adaptive":
            assert self.target_kl is not None and self.horizon is not None
            self.coef = adaptive_kl_coef(self.coef, current_kl, n_steps, self.target_kl, self.horizon)


# ----------------------------------------------------------------------------------------------- aggregation

LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    total_tokens: Optional[float] = None,
    total_seqs: Optional[float] = None,
    norm_length: Optional[float] = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    - ``token-mean``: ``Σ ℓ·m / N_tok``
    - ``seq-mean-token-sum``: ``Σ_i (Σ_t ℓ_it m_it) / N_seq``
    - ``seq-mean-token-mean``: ``Σ_i (Σ_t ℓ_it m_it / Σ_t m_it) / N_seq``
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): ``Σ_i Σ_t ℓ_it m_it / (N_seq · L)``, L a constant length
      (``norm_length``, default T)

    ``N_tok`` and ``N_seq`` default to this batch's counts; ``N_seq`` counts only sequences with at least one token
    (an empty response takes no part in the mean, as in verl). For gradient accumulation pass the counts of the
    whole mini-batch (``total_tokens``, ``total_seqs``: see :func:`loss_counts`) and sum the micro-batch losses: the
    gradient then equals the full batch's exactly, whatever the token count of each micro-batch.
    """
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / (total_tokens if total_tokens is not None else mask.sum().clamp(min=1))
    seqs = total_seqs if total_seqs is not None else max(int((mask.sum(-1) > 0).sum()), 1)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).sum() / seqs
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        length = norm_length if norm_length is not None else loss_mat.shape[-1]
        return masked_sum(loss_mat, mask) / (seqs * length)
    raise ValueError(f"loss_agg_mode={mode!r} is unknown; choose one of: {', '.join(LOSS_AGG_MODES)}")


# ----------------------------------------------------------------------------------------------- losses


@dataclass(frozen=True)
class PolicyLoss:
    """``pg_loss`` and its diagnostics: fraction of tokens clipped (upper/ratio clip, lower/dual clip) and the
    approximate KL ``E[log π_old - log π]`` between the rollout policy and the current one."""

    pg_loss: Tensor
    pg_clipfrac: Tensor
    pg_clipfrac_lower: Tensor
    ppo_kl: Tensor


def clip_bounds(
    clip_ratio: float, clip_ratio_low: Optional[float], clip_ratio_high: Optional[float]
) -> tuple[float, float]:
    """``(ε_low, ε_high)``: each ``clip_ratio`` unless set."""
    return (
        clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio if clip_ratio_high is None else clip_ratio_high,
    )


def policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: Optional[Tensor] = None,
    **agg_counts: Optional[float],
) -> PolicyLoss:
    """PPO's clipped surrogate with dual clip. All inputs ``[B, T]``.

    ``ρ = exp(log π - log π_old)``; ``L = max(-A·ρ, -A·clip(ρ, 1-ε_low, 1+ε_high))``; for ``A < 0`` also
    ``L ← min(L, -A·c)`` (dual clip, Ye et al. 2020; ``clip_ratio_c=None`` disables it). ε_low / ε_high default to
    ``clip_ratio``. ``pg_loss = agg_loss(w·L)`` with the rollout correction's importance weights ``is_weights`` (1
    when None, :mod:`rlprof_train.rollout_correction`); ``agg_counts`` as in :func:`agg_loss`.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c={clip_ratio_c} must be > 1.0 (the dual-clip bound on -A·ρ)")
    log_ratio = (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    if clip_ratio_c is not None:
        dual = -advantages * clip_ratio_c
        clipfrac_lower = masked_mean(((losses > dual) & (advantages < 0)).float(), mask)
        losses = torch.where(advantages < 0, torch.minimum(losses, dual), losses)
    else:
        clipfrac_lower = torch.zeros((), dtype=losses.dtype, device=losses.device)
    return PolicyLoss(
        pg_loss=agg_loss(_weighted(losses, is_weights), mask, loss_agg_mode, **agg_counts),
        pg_clipfrac=clipfrac,
        pg_clipfrac_lower=clipfrac_lower,
        ppo_kl=masked_mean(-log_ratio, mask),
    )


def gspo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    is_weights: Optional[Tensor] = None,
    **agg_counts: Optional[float],
) -> PolicyLoss:
    """GSPO (Zheng et al. 2025), as verl's ``compute_policy_loss_gspo``. All inputs ``[B, T]``.

    The sequence ratio ``s_i = exp(Σ_t m_it (log π - log π_old)_it / |y_i|)`` enters each token as
    ``s_it = sg[s_i] · π_it / sg[π_it]`` (its value ``s_i``, the gradient of ``log π_it``), log-clamped at 10;
    ``L = max(-A·s_it, -A·clip(s_it, 1-ε_low, 1+ε_high))``, always aggregated seq-mean-token-mean (``loss_agg_mode``
    and ``clip_ratio_c`` do not apply, as in verl), each token's ``L`` times ``is_weights`` as in :func:`policy_loss`.
    ``ppo_kl`` is the token mean of ``log π_old - log π``.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(-1).clamp(min=1)  # [B]
    token_log_ratio = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    return PolicyLoss(
        pg_loss=agg_loss(
            _weighted(torch.maximum(unclipped, clipped), is_weights), mask, "seq-mean-token-mean", **agg_counts
        ),
        pg_clipfrac=masked_mean((clipped > unclipped).float(), mask),
        pg_clipfrac_lower=torch.zeros((), dtype=ratio.dtype, device=ratio.device),
        ppo_kl=masked_mean(-log_ratio, mask),
    )


def cispo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    is_weights: Optional[Tensor] = None,
    **agg_counts: Optional[float],
) -> PolicyLoss:
    """CISPO (MiniMax-M1, 2025), as verl's ``compute_policy_loss_cispo``. All inputs ``[B, T]``.

    ``ρ = exp(clamp(log π - log π_old, ±20))``; ``L = -sg[clip(ρ, 1-ε_low, 1+ε_high)] · A · log π``: every token keeps
    its gradient, the clipped ratio only weights it (``clip_ratio_c`` does not apply); times ``is_weights`` as in
    :func:`policy_loss`. ``pg_clipfrac``: the share of tokens whose ratio was clipped.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - low, 1 + high)
    return PolicyLoss(
        pg_loss=agg_loss(
            _weighted(-clipped.detach() * advantages * log_prob, is_weights), mask, loss_agg_mode, **agg_counts
        ),
        pg_clipfrac=masked_mean((ratio != clipped).float(), mask),
        pg_clipfrac_lower=torch.zeros((), dtype=ratio.dtype, device=ratio.device),
        ppo_kl=masked_mean(-log_ratio, mask),
    )


def reinforce_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: Optional[float] = None,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    is_weights: Optional[Tensor] = None,
    **agg_counts: Optional[float],
) -> PolicyLoss:
    """REINFORCE with importance weights, as verl's ``compute_policy_loss_reinforce`` (the rollout correction's
    bypass mode with ``loss_type=reinforce``, where the old log-probs are the rollout's). All inputs ``[B, T]``.

    ``L = -w·A·log π`` (``w`` = ``is_weights``, 1 when None; no ratio: the clip settings do not apply),
    ``pg_loss = agg_loss(L)``;
    ``ppo_kl`` is the token mean of ``log π_old - log π``, the clip fractions 0."""
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return PolicyLoss(
        pg_loss=agg_loss(_weighted(-advantages * log_prob, is_weights), mask, loss_agg_mode, **agg_counts),
        pg_clipfrac=zero,
        pg_clipfrac_lower=zero,
        ppo_kl=masked_mean(old_log_prob - log_prob, mask),
    )


def _weighted(losses: Tensor, is_weights: Optional[Tensor]) -> Tensor:
    return losses if is_weights is None else losses * is_weights


POLICY_LOSSES: dict[str, Callable[..., PolicyLoss]] = {
    "vanilla": policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}
"""``actor.policy_loss.loss_mode`` -> its objective; each takes :func:`policy_loss`'s arguments."""


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_counts: Optional[float],
) -> tuple[Tensor, Tensor]:
    """Clipped value loss. All inputs ``[B, T]``. Returns (vf_loss, vf_clipfrac).

    ``V_clip = clip(V, V_old - ε, V_old + ε)``; ``vf_loss = ½·agg(max((V - R)², (V_clip - R)²))``;
    vf_clipfrac = fraction of tokens where the clipped error is the larger.
    """
    clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    err = (vpreds - returns).square()
    err_clipped = (clipped - returns).square()
    vf_loss = 0.5 * agg_loss(torch.maximum(err, err_clipped), mask, loss_agg_mode, **agg_counts)
    return vf_loss, masked_mean((err_clipped > err).float(), mask)


def kl_loss(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    mask: Tensor,
    kl_type: str,
    loss_agg_mode: str = "token-mean",
    **agg_counts: Optional[float],
) -> Tensor:
    """KL as a loss term (``actor.use_kl_loss``): ``agg(kl_penalty(log π, log π_ref))``, inputs ``[B, T]``,
    a scalar out; the caller scales it by ``kl_loss_coef``."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_type), mask, loss_agg_mode, **agg_counts)


# ----------------------------------------------------------------------------------------------- entropy


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: ``H = logsumexp(z) - Σ softmax(z)·z``. ``[..., V] -> [...]``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_from_logits_chunked(logits: Tensor, chunk_size: int = 2048) -> Tensor:
    """:func:`entropy_from_logits` computed ``chunk_size`` positions at a time (``[..., V] -> [...]``), so the
    softmax of at most ``chunk_size × V`` values exists at once (the seed's ``entropy_from_logits_with_chunking``)."""
    if chunk_size <= 0:
        raise ValueError(f"entropy chunk_size={chunk_size} must be positive")
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=logits.dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        out[start : start + chunk_size] = entropy_from_logits(flat[start : start + chunk_size])
    return out.reshape(logits.shape[:-1])
