"""PPO formulas on small hand-computed numbers, plus the invariances the trainer relies on."""

from __future__ import annotations

import math

import pytest
import torch

from rlprof_train import algos

T = torch.tensor


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol
    )


VALUES = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_helpers():
    close(algos.masked_sum(VALUES, MASK), 7.0)
    close(algos.masked_sum(VALUES, MASK, dim=-1), [3.0, 4.0])
    close(algos.masked_mean(VALUES, MASK), 7 / 3)
    close(algos.masked_mean(VALUES, MASK, dim=-1), [1.5, 4.0])
    close(algos.masked_var(VALUES, MASK), 7 / 3)  # 1, 2, 4: squares 42/9, over N-1 = 2
    close(algos.masked_var(VALUES, MASK, unbiased=False), 14 / 9)
    white = algos.masked_whiten(VALUES, MASK)
    close(white[0, 0], (1 - 7 / 3) / math.sqrt(7 / 3))
    close(algos.masked_whiten(VALUES, MASK, shift_mean=False)[0, 0], (1 - 7 / 3) / math.sqrt(7 / 3) + 7 / 3)


def test_whitening_over_ranks_uses_every_ranks_rows():
    """With ``total`` (Σ over the ranks), a rank's rows are whitened by the whole batch's mean and variance: rank 0
    holding the first row gets what one process holding both rows gets (its ``total`` adds rank 1's count, sum and
    squares about the batch's mean, in that order); alone, the row would be whitened by its own."""
    whole = algos.masked_whiten(VALUES, MASK)
    close(algos.masked_whiten(VALUES, MASK, total=lambda x: x), whole)  # one process
    mean = float(algos.masked_mean(VALUES, MASK))
    rank_1 = iter(
        [
            float(MASK[1:].sum()),
            float(algos.masked_sum(VALUES[1:], MASK[1:])),
            float(algos.masked_sum((VALUES[1:] - mean) ** 2, MASK[1:])),
        ]
    )
    close(algos.masked_whiten(VALUES[:1], MASK[:1], total=lambda share: share + next(rank_1)), whole[:1])
    assert not torch.allclose(algos.masked_whiten(VALUES[:1], MASK[:1]), whole[:1])


def test_gae_by_hand_and_padding_is_skipped():
    rewards, values = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]])
    adv, ret = algos.gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8, whiten=False)
    # δ2 = 1 - .7 = .3; δ1 = .9·.7 - .6 = .03, A1 = .03 + .72·.3; δ0 = .9·.6 - .5 = .04, A0 = .04 + .72·A1
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])
    padded_adv, padded_ret = algos.gae_advantages(
        T([[0.0, 0.0, 1.0, 0.0]]),
        T([[0.5, 0.6, 0.7, 99.0]]),
        T([[1.0, 1.0, 1.0, 0.0]]),
        gamma=0.9,
        lam=0.8,
        whiten=False,
    )
    close(padded_adv, [[0.21712, 0.246, 0.3, 0.0]])
    close(padded_ret, [[0.71712, 0.846, 1.0, 0.0]])


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_values():
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    mask = (torch.arange(6)[None] < T([6, 4, 1, 3])[:, None]).float()
    adv, ret = algos.gae_advantages(rewards * mask, values, mask, gamma=1.0, lam=1.0, whiten=False)
    to_go = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
    close(adv, (to_go - values) * mask)
    close(ret, to_go * mask)


def test_gae_whitens_by_default():
    torch.manual_seed(1)
    adv, _ = algos.gae_advantages(torch.randn(3, 5), torch.randn(3, 5), torch.ones(3, 5), 0.99, 0.95)
    close(adv.mean(), 0.0)
    close(adv.std(), 1.0, tol=1e-4)


GROUP_REWARDS = T([[1.0], [0.0], [1.0], [0.5], [0.5], [0.7]])
GROUPS = ["a", "a", "a", "b", "b", "c"]
ONE = torch.ones(6, 1)


def test_grpo_by_hand():
    adv, ret = algos.grpo_advantages(GROUP_REWARDS, ONE, GROUPS)
    std_a = math.sqrt((1 / 9 + 4 / 9 + 1 / 9) / 2)
    expected = [(1 / 3) / std_a, (-2 / 3) / std_a, (1 / 3) / std_a, 0.0, 0.0, 0.7 / (1 + 1e-6)]
    close(adv[:, 0], expected, tol=1e-4)  # group c has one sample: mean 0, std 1 (as verl)
    assert torch.equal(adv, ret)


def test_dr_grpo_does_not_divide_by_std():
    adv, _ = algos.grpo_advantages(GROUP_REWARDS, ONE, GROUPS, norm_adv_by_std=False)
    close(adv[:, 0], [1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.7])


def test_grpo_advantages_sum_to_zero_within_each_group():
    torch.manual_seed(2)
    rewards = torch.rand(12, 5)
    mask = (torch.rand(12, 5) > 0.3).float()
    mask[:, 0] = 1
    index = torch.arange(12) // 4
    for norm in (True, False):
        adv, _ = algos.grpo_advantages(rewards, mask, index, norm_adv_by_std=norm)
        per_seq = adv.sum(-1) / mask.sum(-1)  # the sequence's advantage, broadcast on its tokens
        for g in range(3):
            close(per_seq[index == g].sum(), 0.0, tol=1e-5)
        assert torch.all(adv[mask == 0] == 0)


def test_rloo_by_hand():
    adv, _ = algos.rloo_advantages(GROUP_REWARDS, ONE, GROUPS)
    # a: 1 - (0+1)/2, 0 - (1+1)/2, 1 - (1+0)/2; b: 0.5 - 0.5 twice; c alone keeps its score
    close(adv[:, 0], [0.5, -1.0, 0.5, 0.0, 0.0, 0.7])


def test_reinforce_plus_plus_by_hand():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    adv, ret = algos.reinforce_plus_plus_advantages(rewards, torch.ones(2, 3), gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    mean, std = 3.25 / 6, math.sqrt(0.802083333 / 5)
    close(adv, (ret - mean) / std, tol=1e-4)


def test_reinforce_plus_plus_baseline_by_hand():
    adv, _ = algos.reinforce_plus_plus_baseline_advantages(GROUP_REWARDS[:5], ONE[:5], GROUPS[:5])
    std = math.sqrt((1 / 9 + 4 / 9 + 1 / 9) / 4)  # centred scores 1/3, -2/3, 1/3, 0, 0 have mean 0
    close(adv[:, 0], [1 / 3 / std, -2 / 3 / std, 1 / 3 / std, 0.0, 0.0], tol=1e-4)


def test_compute_advantage_dispatch_and_errors():
    adv, _ = algos.compute_advantage("rloo", GROUP_REWARDS, ONE, index=GROUPS)
    close(adv[:, 0], [0.5, -1.0, 0.5, 0.0, 0.0, 0.7])
    with pytest.raises(ValueError, match="adv_estimator='ppo'.*gae, grpo, rloo, reinforce_plus_plus"):
        algos.compute_advantage("ppo", GROUP_REWARDS, ONE)
    with pytest.raises(ValueError, match="gae needs critic values"):
        algos.compute_advantage("gae", GROUP_REWARDS, ONE)
    with pytest.raises(ValueError, match="grpo needs group ids"):
        algos.compute_advantage("grpo", GROUP_REWARDS, ONE)


LP, REF = T([[0.0, -1.0]]), T([[-0.5, -0.5]])


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("kl", [0.5, -0.5]),
        ("k1", [0.5, -0.5]),
        ("abs", [0.5, 0.5]),
        ("mse", [0.125, 0.125]),
        ("k2", [0.125, 0.125]),
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]),
        ("k3", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]),
    ],
)
def test_kl_estimators_by_hand(kl_type, expected):
    close(algos.kl_penalty(LP, REF, kl_type)[0], expected)


def test_low_var_kl_is_clamped_and_unknown_type_is_an_error():
    assert algos.kl_penalty(T([-30.0]), T([0.0]), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="kl_type='js'.*kl, abs, mse, low_var_kl"):
        algos.kl_penalty(LP, REF, "js")


def test_kl_in_reward_by_hand():
    scores = T([[0.0, 1.0]])
    rewards, current = algos.apply_kl_in_reward(scores, LP, REF, torch.ones(1, 2), kl_coef=0.1, kl_type="kl")
    close(rewards, [[-0.05, 1.05]])
    close(current, 0.0)


def test_kl_controllers():
    close(algos.adaptive_kl_coef(0.1, current_kl=0.2, n_steps=64, target_kl=0.1, horizon=640), 0.102)
    close(algos.adaptive_kl_coef(0.1, current_kl=0.09, n_steps=64, target_kl=0.1, horizon=640), 0.099)
    fixed = algos.KLController(0.1)
    fixed.update(5.0, 64)
    assert fixed.coef == 0.1
    adaptive = algos.KLController(0.1, "adaptive", target_kl=0.1, horizon=640)
    adaptive.update(0.2, 64)
    close(adaptive.coef, 0.102)
    with pytest.raises(ValueError, match="target_kl > 0 and horizon > 0"):
        algos.KLController(0.1, "adaptive")


def test_kl_loss_by_hand():
    close(algos.kl_loss(LP, REF, torch.ones(1, 2), "mse"), 0.125)
    close(algos.kl_loss(LP, REF, T([[1.0, 0.0]]), "kl"), 0.5)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", 3.5),
        ("seq-mean-token-mean", 2.75),
        ("seq-mean-token-sum-norm", 7 / 6),
    ],
)
def test_loss_aggregation_by_hand(mode, expected):
    close(algos.agg_loss(VALUES, MASK, mode), expected)


def test_unknown_aggregation_mode_lists_the_modes():
    with pytest.raises(ValueError, match="loss_agg_mode='mean'.*token-mean, seq-mean-token-sum"):
        algos.agg_loss(VALUES, MASK, "mean")


RATIOS = T([[1.5, 0.5, 1.1, 5.0, 0.5]])
ADVANTAGES = T([[1.0, 1.0, -1.0, -1.0, -1.0]])


def test_policy_loss_ratio_clip_and_dual_clip_by_hand():
    out = algos.policy_loss(
        torch.zeros(1, 5), RATIOS.log(), ADVANTAGES, torch.ones(1, 5), clip_ratio=0.2, clip_ratio_c=3.0
    )
    # per token: max(-Aρ, -A·clip(ρ)) = -1.2, -0.5, 1.1, 5 -> dual clip 3, 0.8
    close(out.pg_loss, (-1.2 - 0.5 + 1.1 + 3.0 + 0.8) / 5)
    close(out.pg_clipfrac, 2 / 5)  # tokens 1 and 5 take the clipped branch
    close(out.pg_clipfrac_lower, 1 / 5)  # token 4 hits the dual clip
    close(out.ppo_kl, -RATIOS.log().mean())


def test_policy_loss_asymmetric_clip_and_no_dual_clip():
    out = algos.policy_loss(
        torch.zeros(1, 5),
        RATIOS.log(),
        ADVANTAGES,
        torch.ones(1, 5),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=None,
    )
    close(out.pg_loss, (-1.28 - 0.5 + 1.1 + 5.0 + 0.8) / 5)
    close(out.pg_clipfrac_lower, 0.0)
    with pytest.raises(ValueError, match="clip_ratio_c=1.0 must be > 1.0"):
        algos.policy_loss(torch.zeros(1, 5), RATIOS.log(), ADVANTAGES, torch.ones(1, 5), clip_ratio_c=1.0)


def test_value_loss_by_hand():
    vf_loss, clipfrac = algos.value_loss(
        T([[1.0, 2.0]]), T([[1.5, 1.0]]), T([[0.5, 1.8]]), torch.ones(1, 2), cliprange_value=0.2
    )
    # token 1: V_clip = 0.7, errors .25 vs .64; token 2: V_clip = 2.0, errors 1 and 1
    close(vf_loss, 0.5 * (0.64 + 1.0) / 2)
    close(clipfrac, 0.5)


def test_entropy_by_hand_and_chunked_equals_plain():
    close(
        algos.entropy_from_logits(T([[0.0, 0.0], [0.0, math.log(3.0)]])),
        [math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))],
    )
    torch.manual_seed(3)
    logits = torch.randn(3, 37, 50) * 4
    close(algos.entropy_from_logits_chunked(logits, chunk_size=16), algos.entropy_from_logits(logits), tol=1e-5)
    close(algos.entropy_from_logits_chunked(logits, chunk_size=1000), algos.entropy_from_logits(logits), tol=1e-5)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_micro_batches_with_global_counts_give_the_full_batch_gradient(mode):
    torch.manual_seed(4)
    lengths = T([7, 1, 3, 8, 2, 5])  # unequal token counts per micro-batch
    mask = (torch.arange(8)[None] < lengths[:, None]).float()
    weights = torch.randn(6, 8)
    param = torch.randn(8, requires_grad=True)

    def loss_of(rows, **counts):
        return algos.agg_loss((weights[rows] * param).sin(), mask[rows], mode, **counts)

    full = torch.autograd.grad(loss_of(slice(0, 6)), param)[0]
    counts = dict(total_tokens=mask.sum(), total_seqs=6, norm_length=8)
    accumulated = sum(
        torch.autograd.grad(loss_of(rows, **counts), param)[0] for rows in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    close(accumulated, full, tol=1e-5)
    if mode == "token-mean":  # the naive average of micro-batch means is biased: the test can tell them apart
        naive = (
            sum(torch.autograd.grad(loss_of(rows), param)[0] for rows in (slice(0, 2), slice(2, 3), slice(3, 6))) / 3
        )
        assert not torch.allclose(naive, full, atol=1e-3)


# ----------------------------------------------------------------------------------------------- found against verl


def test_low_var_kl_gradient_stays_finite_when_the_log_ratio_is_far_below_minus_88():
    log_prob = T([-100.0, -0.5]).requires_grad_()
    kl = algos.kl_penalty(log_prob, T([0.0, 0.0]), "low_var_kl")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(log_prob.grad).all()
    close(kl[1], math.exp(0.5) - 1.5)  # unclamped values are unchanged


def test_reinforce_plus_plus_carries_the_return_across_a_masked_hole_as_verl_does():
    rewards = T([[0.0, 0.0, 0.0, 1.0]])
    mask = T([[1.0, 0.0, 0.0, 1.0]])  # e.g. a tool's output between two turns
    _, returns = algos.reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    close(returns, [[0.5, 0.0, 0.0, 1.0]])  # the hole is skipped, not a step: one discount from t=3 to t=0


def test_nan_on_padding_does_not_reach_the_losses():
    mask = T([[1.0, 1.0, 0.0]])
    log_prob = T([[-1.0, -2.0, float("nan")]])
    old = T([[-1.1, -1.9, float("inf")]])
    result = algos.policy_loss(old, log_prob, T([[1.0, -1.0, 0.0]]), mask)
    assert torch.isfinite(result.pg_loss) and torch.isfinite(result.ppo_kl)
    for mode in algos.LOSS_AGG_MODES:
        assert torch.isfinite(algos.agg_loss(log_prob, mask, mode))


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_an_empty_response_takes_no_part_in_a_sequence_mean(mode):
    with_empty = algos.agg_loss(VALUES, T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), mode)
    without = algos.agg_loss(VALUES[:1], T([[1.0, 1.0, 0.0]]), mode)
    close(with_empty, without)


def test_an_estimator_registered_from_user_code_is_used_through_the_public_api():
    @algos.register_adv_estimator("sign_of_score", needs_groups=False)
    def sign_of_score(token_level_rewards, mask, **_):
        advantages = algos.masked_sum(token_level_rewards, mask, dim=-1).sign()[:, None] * mask
        return advantages, advantages

    adv, _ = algos.compute_advantage("sign_of_score", T([[0.0, 2.0], [0.0, -1.0]]), torch.ones(2, 2))
    close(adv, [[1.0, 1.0], [-1.0, -1.0]])
    assert not algos.ADV_ESTIMATORS["sign_of_score"].needs_critic
    del algos.ADV_ESTIMATORS["sign_of_score"]
