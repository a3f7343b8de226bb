"""verl's policy loss modes of today (``actor.policy_loss.loss_mode``: gspo, cispo, and vanilla beside them) against
verl's own functions from its published ``core_algos.py`` (verl-project/verl 1dda039b, tests/data/verl, Apache-2.0):
the loss, its gradient and the clip fraction and KL on the same seeded ragged batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from verl_source import verl_functions

from rlprof_train import algos

CORE_ALGOS = Path(__file__).parents[1] / "data" / "verl" / "core_algos_1dda039b.py"


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Any = None) -> torch.Tensor:
    """verl's ``torch_functional.masked_sum`` (verl/utils/torch_functional.py at the same commit)."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Any = None) -> torch.Tensor:
    """verl's ``torch_functional.masked_mean``: the masked sum over the mask's count + 1e-8."""
    return _masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


class ActorConfig(SimpleNamespace):
    """The fields of verl's ``ActorConfig`` its losses read (``config.x`` or ``config.get("x", default)``)."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class AlgoConfig:
    """verl's algorithm config, which a loss must not be given (its functions assert so)."""


def verl_losses(*names: str) -> dict[str, Callable[..., Any]]:
    """verl's functions ``names`` from its ``core_algos.py``, in one namespace (the losses call its ``agg_loss``)."""
    namespace = {
        "torch": torch,
        "Optional": Optional,
        "Any": Any,
        "DictConfig": dict,
        "ActorConfig": ActorConfig,
        "AlgoConfig": AlgoConfig,
        "verl_F": SimpleNamespace(masked_sum=_masked_sum, masked_mean=_masked_mean),
    }
    return verl_functions(CORE_ALGOS, names, namespace)


def batch(seed: int, rows: int = 6, width: int = 9) -> tuple[torch.Tensor, ...]:
    """Ragged responses (lengths 1..width), log-probs near the old ones (a shift per response, so that some sequence
    ratios pass the clip too), advantages of both signs, one per response broadcast over its tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    old = -torch.rand(rows, width, generator=generator) * 3
    new = old + 0.4 * torch.randn(rows, 1, generator=generator) + 0.4 * torch.randn(rows, width, generator=generator)
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, width).clone()
    return old, new, advantages, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "mode, verl_name, agg",
    [
        ("gspo", "compute_policy_loss_gspo", "seq-mean-token-mean"),
        ("cispo", "compute_policy_loss_cispo", "token-mean"),
        ("cispo", "compute_policy_loss_cispo", "seq-mean-token-sum"),
        ("vanilla", "compute_policy_loss_vanilla", "token-mean"),
    ],
)
def test_each_loss_mode_equals_verls_loss_gradient_and_diagnostics(mode, verl_name, agg, seed):
    old, new, advantages, mask = batch(seed)
    clip = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    ours_input = new.clone().requires_grad_()
    ours = algos.POLICY_LOSSES[mode](old, ours_input, advantages, mask, clip_ratio_c=3.0, loss_agg_mode=agg, **clip)
    ours.pg_loss.backward()

    verl = verl_losses(verl_name, "agg_loss")[verl_name]
    config = ActorConfig(**clip, clip_ratio_c=3.0, global_batch_info={}, loss_agg_mode=agg)
    theirs_input = new.clone().requires_grad_()
    loss, metrics = verl(old, theirs_input, advantages, mask, loss_agg_mode=agg, config=config)
    loss.backward()

    torch.testing.assert_close(ours.pg_loss, loss)
    torch.testing.assert_close(ours_input.grad, theirs_input.grad)
    assert ours.pg_clipfrac.item() == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
    assert ours.ppo_kl.item() == pytest.approx(metrics["actor/ppo_kl"], abs=1e-6)
    assert ours.pg_clipfrac_lower.item() == pytest.approx(metrics["actor/pg_clipfrac_lower"], abs=1e-6)
    assert 0 < ours.pg_clipfrac.item() < 1  # the batch really reaches the clip


def test_a_loss_mode_verl_has_and_this_trainer_lacks_is_refused_naming_those_that_exist():
    from rlprof.typed_config import ConfigError
    from rlprof_train.config.load import load_trainer_config

    cfg = load_trainer_config(["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    with pytest.raises(ConfigError, match="loss_mode.*'clip_cov'.*vanilla, gspo, cispo"):
        load_trainer_config(["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"])
