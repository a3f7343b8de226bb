"""Rollout correction (``algorithm.rollout_correction``) against verl's own functions (verl-project/verl 1dda039b,
``verl/trainer/ppo/rollout_corr_helper.py`` and ``core_algos.py`` in tests/data/verl, Apache-2.0): importance
weights, rejection masks, their metrics and the off-policy diagnostics on the same seeded ragged batches; the losses
with weights and bypass mode's loss and gradient; the settings refused in one line. (The hf rollout's log-probs:
test_hf_rollout.py; two steps of verl's own rollout-correction scripts: test_verl_scripts.py.)"""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from test_verl_policy_losses import ActorConfig, _masked_mean, _masked_sum, verl_losses
from verl_source import verl_functions

from rlprof.metrics import MetricAggregator
from rlprof.typed_config import ConfigError
from rlprof_train import algos, rollout_correction
from rlprof_train.config.load import load_trainer_config
from rlprof_train.config.schema import RolloutCorrectionConfig
from rlprof_train.preflight import validate
from rlprof_train.rollout_correction import RS_OPTIONS, Correction, correct, parse

HELPER = Path(__file__).parents[1] / "data" / "verl" / "rollout_corr_helper_1dda039b.py"
VERL_NAMES = (
    "_parse_rollout_is_threshold",
    "_parse_rollout_rs_thresholds",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
    "compute_rollout_correction_weights",
    "compute_is_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_offpolicy_metrics",
)


class _DataProto:
    """verl's ``DataProto.from_dict(tensors=...)``, as far as the helper uses it (``.batch``)."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> _DataProto:
        return cls(tensors)


def _distributed_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``torch_functional.distributed_masked_mean`` (same commit): the masked sum and count summed over the
    process group (used where an earlier test left one initialised; a world of one here)."""
    total, count = torch.sum(values * mask), torch.sum(mask)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.SUM)
    return total / count


def verl_helper() -> dict[str, Any]:
    """verl's rollout-correction functions, on one process (no torch.distributed, as verl's driver)."""
    namespace = {
        "torch": torch,
        "math": __import__("math"),
        "Optional": Optional,
        "Any": Any,
        "DataProto": _DataProto,
        "SAFETY_BOUND": 20.0,
        "SUPPORTED_ROLLOUT_RS_OPTIONS": set(RS_OPTIONS),
        "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS": {"token_k1", "token_k2", "token_k3"},
        "verl_F": SimpleNamespace(
            masked_sum=_masked_sum, masked_mean=_masked_mean, distributed_masked_mean=_distributed_masked_mean
        ),
    }
    return verl_functions(HELPER, VERL_NAMES, namespace)


def batch(seed: int, rows: int = 8, width: int = 10, spread: float = 0.3) -> tuple[torch.Tensor, ...]:
    """Ragged responses (one empty), the rollout's log-probs and the trainer's, apart by a shift per response and
    noise per token (some weights past any threshold below)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    lengths[-1] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rollout = -torch.rand(rows, width, generator=generator) * 3
    trained = rollout + spread * torch.randn(rows, 1, generator=generator)
    trained = trained + spread * torch.randn(rows, width, generator=generator)
    return trained, rollout, mask


def settings(**given: Any) -> Correction:
    correction, problems = parse(RolloutCorrectionConfig(**given))
    assert problems == []
    return correction


def assert_metrics_equal(ours: dict[str, float], theirs: dict[str, float]) -> None:
    """Every metric we report equals verl's of the same name (theirs carry ``rollout_corr/`` or not)."""
    plain = {key.removeprefix("rollout_corr/"): value for key, value in theirs.items()}
    for key, value in ours.items():
        name = key.removeprefix("rollout_corr/")
        assert name in plain, f"{name} is not one of verl's metrics"
        assert value == pytest.approx(plain[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.3, "0.8_1.25"])
@pytest.mark.parametrize("normalize", [False, True])
def test_importance_weights_and_their_metrics_equal_verls(seed, level, threshold, normalize):
    trained, rollout, mask = batch(seed)
    correction = settings(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize)
    weights, metrics = rollout_correction.importance_weights(trained - rollout, mask, correction)
    theirs, their_metrics = verl_helper()["compute_rollout_correction_weights"](
        trained - rollout, mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize
    )
    torch.testing.assert_close(weights, theirs)
    assert_metrics_equal(metrics.compute(), their_metrics)
    assert not weights.requires_grad and (weights * (1 - mask)).abs().sum() == 0
    assert (weights[mask.bool()] != weights[mask.bool()].max()).any()  # not all truncated: the test can tell


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "options, threshold",
    [(option, "0.7_1.4" if option.endswith("k1") else 0.05) for option in RS_OPTIONS]
    + [("token_k1,seq_max_k2", "0.6_1.6,0.5"), ("seq_sum_k1,seq_mean_k3", "2.0,0.1"), ("token_k3,token_k3", 0.04)],
)
def test_rejection_masks_and_their_metrics_equal_verls(seed, options, threshold):
    trained, rollout, mask = batch(seed)
    correction = settings(rollout_rs=options, rollout_rs_threshold=threshold)
    kept, metrics = rollout_correction.rejection_mask(trained - rollout, mask, correction)
    theirs, their_metrics = verl_helper()["compute_rollout_rejection_mask"](
        trained - rollout, mask, rollout_rs=options, rollout_rs_threshold=threshold
    )
    torch.testing.assert_close(kept, theirs)
    assert_metrics_equal(metrics.compute(), their_metrics)


@pytest.mark.parametrize("seed", range(3))
def test_the_whole_correction_and_the_off_policy_metrics_equal_verls(seed):
    trained, rollout, mask = batch(seed)
    given = dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="seq_mean_k1", rollout_rs_threshold=1.2)
    weights, kept, metrics = correct(trained, rollout, mask, settings(**given))
    proto, their_mask, their_metrics = verl_helper()["compute_rollout_correction_and_rejection_mask"](
        trained, rollout, mask, **given
    )
    torch.testing.assert_close(weights, proto.batch["rollout_is_weights"])
    torch.testing.assert_close(kept, their_mask)
    reduced = metrics.compute()
    assert_metrics_equal(reduced, their_metrics)
    assert {"rollout_corr/kl", "rollout_corr/chi2_seq", "rollout_corr/training_ppl"} <= set(reduced)
    assert 0 < reduced["rollout_corr/rollout_rs_masked_fraction"] < 1  # the rejection really bites


def test_two_ranks_halves_give_the_whole_batchs_weights_masks_and_metrics():
    """A step over several ranks: each rank corrects its share, the batch normalisation sums over ranks (here: what
    ``global_sum`` returns on every rank), the metrics merge as the step merges them: the whole batch's values."""
    trained, rollout, mask = batch(7, rows=12)
    correction = settings(
        rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="token_k2", rollout_rs_threshold=0.02
    )
    whole_weights, whole_mask, whole = correct(trained, rollout, mask, correction)
    halves = [slice(0, 5), slice(5, 12)]
    unnormalised = dataclasses.replace(correction, batch_normalize=False)
    weight_sum = sum(float(correct(trained[h], rollout[h], mask[h], unnormalised)[0].sum()) for h in halves)
    over_ranks = {"weights": weight_sum, "tokens": float(mask.sum())}
    calls: list[float] = []

    def global_sum(value: float) -> float:  # called for the weights' sum, then the token count
        calls.append(value)
        return over_ranks["weights" if len(calls) % 2 else "tokens"]

    merged = MetricAggregator()
    parts = []
    for h in halves:
        weights, kept, metrics = correct(trained[h], rollout[h], mask[h], correction, global_sum)
        merged.merge(metrics)
        parts.append((weights, kept))
    assert len(calls) == 4
    torch.testing.assert_close(torch.cat([w for w, _ in parts]), whole_weights)
    torch.testing.assert_close(torch.cat([k for _, k in parts]), whole_mask)
    ours, theirs = merged.compute(), whole.compute()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(
    "mode, verl_name",
    [
        ("vanilla", "compute_policy_loss_vanilla"),
        ("gspo", "compute_policy_loss_gspo"),
        ("cispo", "compute_policy_loss_cispo"),
    ],
)
def test_each_loss_with_importance_weights_equals_verls(mode, verl_name):
    trained, rollout, mask = batch(3)
    old = rollout + 0.05 * torch.randn_like(rollout)
    advantages = torch.randn(trained.shape[0], 1).expand_as(trained).clone()
    weights, _ = rollout_correction.importance_weights(old - rollout, mask, settings(rollout_is="token"))
    clip = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    agg = "seq-mean-token-mean" if mode == "gspo" else "token-mean"
    ours_input = trained.clone().requires_grad_()
    ours = algos.POLICY_LOSSES[mode](
        old, ours_input, advantages, mask, clip_ratio_c=3.0, loss_agg_mode=agg, is_weights=weights, **clip
    )
    ours.pg_loss.backward()
    verl = verl_losses(verl_name, "agg_loss")[verl_name]
    theirs_input = trained.clone().requires_grad_()
    config = ActorConfig(**clip, clip_ratio_c=3.0, global_batch_info={}, loss_agg_mode=agg)
    loss, _ = verl(old, theirs_input, advantages, mask, loss_agg_mode=agg, config=config, rollout_is_weights=weights)
    loss.backward()
    torch.testing.assert_close(ours.pg_loss, loss)
    torch.testing.assert_close(ours_input.grad, theirs_input.grad)


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
@pytest.mark.parametrize(
    "given",
    [
        dict(rollout_is="sequence", rollout_is_batch_normalize=True),
        dict(rollout_is="token", rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.6_1.6,0.5"),
    ],
)
def test_bypass_mode_loss_and_gradient_equal_verls(loss_type, given, monkeypatch):
    """The actor's bypass path (the correction from this forward against the rollout's log-probs, then the loss the
    loss type names) against verl's ``compute_policy_loss_bypass_mode``."""
    trained, rollout, mask = batch(5)
    advantages = torch.randn(trained.shape[0], 1).expand_as(trained).clone()
    correction = settings(**given, bypass_mode=True, loss_type=loss_type)

    ours_input = trained.clone().requires_grad_()
    weights, kept, _ = correct(ours_input.detach(), rollout, mask, correction)
    objective = algos.reinforce_policy_loss if loss_type == "reinforce" else algos.policy_loss
    ours = objective(
        rollout,
        ours_input,
        advantages,
        kept,
        clip_ratio=0.2,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        is_weights=weights if loss_type == "reinforce" else None,
    )
    ours.pg_loss.backward()

    helper = verl_helper()
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("verl.trainer.ppo.rollout_corr_helper")
    module.compute_rollout_correction_and_rejection_mask = helper["compute_rollout_correction_and_rejection_mask"]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    losses = verl_losses(
        "compute_policy_loss_bypass_mode", "compute_policy_loss_reinforce", "compute_policy_loss_vanilla", "agg_loss"
    )
    config = ActorConfig(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=3.0,
        global_batch_info={},
        loss_agg_mode="token-mean",
        policy_loss={"rollout_correction": {**given, "loss_type": loss_type}},
    )
    theirs_input = trained.clone().requires_grad_()
    loss, their_metrics = losses["compute_policy_loss_bypass_mode"](
        rollout, theirs_input, advantages, mask, loss_agg_mode="token-mean", config=config
    )
    loss.backward()
    torch.testing.assert_close(ours.pg_loss, loss)
    torch.testing.assert_close(ours_input.grad, theirs_input.grad)
    assert ours.ppo_kl.item() == pytest.approx(their_metrics["actor/ppo_kl"], abs=1e-6)


def test_every_bad_setting_is_named_in_one_line():
    with pytest.raises(ConfigError) as caught:
        validate(
            load_trainer_config(
                [
                    "--config-name=demo",
                    "algorithm.rollout_correction.rollout_is=tokens",
                    "algorithm.rollout_correction.rollout_is_threshold=2.0_0.5",
                    "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k1",
                    "algorithm.rollout_correction.loss_type=ppo",
                ]
            )
        )
    message = str(caught.value)
    assert "\n" not in message and message.startswith("4 problems: ")
    for expected in (
        "algorithm.rollout_correction.rollout_is='tokens': choose token, sequence or null",
        "algorithm.rollout_correction.rollout_is_threshold='2.0_0.5': a positive number u",
        "algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k1': options are token_k1, token_k2",
        "algorithm.rollout_correction.loss_type='ppo': choose ppo_clip or reinforce",
    ):
        assert expected in message
    with pytest.raises(ConfigError, match="rollout_rs_threshold=None: one threshold for all of token_k2"):
        validate(load_trainer_config(["--config-name=demo", "algorithm.rollout_correction.rollout_rs=token_k2"]))
    with pytest.raises(ConfigError, match=r"rollout_rs_threshold='0.5_2.0': token_k3 takes a positive number"):
        validate(
            load_trainer_config(
                [
                    "--config-name=demo",
                    "algorithm.rollout_correction.rollout_rs=token_k3",
                    "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
                ]
            )
        )


@pytest.mark.slow
@pytest.mark.parametrize("bypass", [False, True])
def test_two_ranks_train_with_the_correction_on_the_hf_rollouts_log_probs(tmp_path, bypass):
    """Two processes, two steps: the hf rollout returns its log-probs, the batch normalisation meets over ranks (once
    a step, or per micro-batch in bypass mode), the step logs the ``rollout_corr/*`` metrics; bypass mode
    recomputes no old log-probs."""
    import json
    import subprocess

    from conftest import ROOT, SMALL_RUN, free_port, subprocess_env, trainer_command

    prefix = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m")
    command = trainer_command(
        tmp_path,
        *SMALL_RUN,
        "trainer.total_training_steps=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # the second update is off-policy: weights away from 1
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        f"algorithm.rollout_correction.bypass_mode={bypass}",
        "algorithm.rollout_correction.loss_type=reinforce",
        prefix=prefix,
    )
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(row) for row in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout_corr/rollout_is_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["rollout_corr/rollout_is_batch_norm_factor"] > 0 and record["rollout_corr/training_ppl"] > 1
        assert ("timing_s/old_log_prob" in record) is not bypass
    if bypass:  # the second mini-batch's policy moved: its weights are not all 1
        assert any(r["rollout_corr/rollout_is_max"] != 1.0 or r["rollout_corr/rollout_is_min"] != 1.0 for r in steps)


def test_a_correction_on_a_backend_that_returns_no_log_probs_is_one_config_error(monkeypatch):
    from rlprof_train.workers.rollout import Rollout, registry
    from rlprof_train.workers.rollout.registry import register_rollout

    monkeypatch.setattr(registry, "_ROLLOUTS", dict(registry._ROLLOUTS))  # registrations of this test only

    @register_rollout("tokens_only")
    class TokensOnly(Rollout):
        def generate(self, prompts, sampling): ...

    chosen = ["--config-name=demo", "actor_rollout_ref.rollout.name=tokens_only"]
    validate(load_trainer_config(chosen))  # without a correction it needs none
    with pytest.raises(ConfigError) as raised:
        validate(load_trainer_config([*chosen, "algorithm.rollout_correction.rollout_is=token"]))
    message = str(raised.value)
    assert "\n" not in message and message.startswith("actor_rollout_ref.rollout.name='tokens_only': "), message
    assert "needs the rollout's log-probs" in message and message.endswith("(these do: hf, vllm)"), message
