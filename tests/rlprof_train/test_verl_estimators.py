"""The estimators verl scripts name, against verl's own functions: ReMax, and GRPO / RLOO with one response per
prompt (verl runs them; the advantage is then the score). verl's functions are taken from its published
``core_algos.py`` (tests/data/verl, Apache-2.0, see SOURCES.tsv) by name and run on the same seeded inputs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from verl_source import verl_functions

from rlprof_train import algos

CORE_ALGOS = Path(__file__).parents[1] / "data" / "verl" / "core_algos.py"


def verl_function(name: str) -> Callable[..., Any]:
    """verl's function ``name`` from its ``core_algos.py``."""
    namespace = {"torch": torch, "np": np, "defaultdict": defaultdict, "Optional": Optional, "AlgoConfig": Any}
    return verl_functions(CORE_ALGOS, (name,), namespace)[name]


def ragged(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with the score on each response's last token, and the response masks (lengths 1..width)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(rows, width)
    rewards[torch.arange(rows), lengths - 1] = torch.randn(rows, generator=generator)
    return rewards, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_remax_equals_verls_compute_remax_outcome_advantage(seed):
    rewards, mask = ragged(12, 7, seed)
    rewards = rewards + 0.01 * torch.randn(rewards.shape, generator=torch.Generator().manual_seed(seed)) * mask
    baselines = torch.randn(12, generator=torch.Generator().manual_seed(100 + seed))
    ours = algos.compute_advantage("remax", rewards, mask, reward_baselines=baselines)
    theirs = verl_function("compute_remax_outcome_advantage")(rewards, baselines, mask)
    for mine, verls in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, verls)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("estimator, verl_name", [("grpo", "compute_grpo_outcome_advantage"),
                                                  ("rloo", "compute_rloo_outcome_advantage")])  # fmt: skip
def test_group_estimators_equal_verls_with_one_or_several_responses_per_prompt(estimator, verl_name, n):
    rewards, mask = ragged(8 * n, 5, seed=n)
    index = [i // n for i in range(8 * n)]
    ours = algos.compute_advantage(estimator, rewards, mask, index=index)
    theirs = verl_function(verl_name)(rewards, mask, np.array(index))
    for mine, verls in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, verls)
    if n == 1:  # no group to compare with: the advantage is the score itself
        torch.testing.assert_close(ours[0][:, 0], rewards.sum(-1) / (1 + 1e-6 if estimator == "grpo" else 1))


def test_grpo_with_one_response_per_prompt_is_accepted_as_verl_accepts_it():
    from rlprof_train.config.load import load_trainer_config
    from rlprof_train.preflight import validate

    validate(load_trainer_config(["--config-name=demo", "actor_rollout_ref.rollout.n=1"]))  # GRPO, n=1
    spec = algos.adv_estimator("remax")
    assert spec.needs_baseline and not spec.needs_critic
