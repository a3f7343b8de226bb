"""The knobs ``tune`` may turn: each changes how the work is cut or where memory goes, never what is computed.

Every knob here is covered by an equivalence test (``tests/rlprof_train/test_knobs.py``: packed == padded, token-budget
micro-batches == fixed ones, gradient and entropy checkpointing == plain, chunked entropy == whole; the loss is
normalised by the mini-batch's global token counts, so any micro-batch split gives the same gradient; the compiled
decode and the compiled training forward == eager in ``test_static_decode.py`` and ``test_fast_paths.py``; the hf
rollout's prompts per call == the whole batch in ``test_hf_rollout.py``: each response's noise is keyed), and the
verification at the end of a search checks it again on the first steps of the real run. Keys that change the
algorithm (batch sizes per optimizer step, learning rates, clipping, KL, ``n``, sampling) are not in the space, and
asking for one is refused naming the allowed keys.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from rlprof.typed_config import ConfigError
from rlprof_train import algos, preflight
from rlprof_train.config.schema import TrainerConfig
from rlprof_train.workers.rollout import rollout_spec

ARR = "actor_rollout_ref"
Applies = Callable[[TrainerConfig], bool]


@dataclass(frozen=True)
class Knob:
    key: str
    """The dotted trainer key (or keys joined by ``+`` for a coupled pair: use_dynamic_bsz + its budget)."""
    group: str
    """``micro_batching``, ``log_prob``, ``packing``, ``token_budget``, ``memory``, ``rollout``, ``compile`` or
    ``pools``."""
    candidates: Callable[[TrainerConfig, int], list[dict[str, Any]]]
    """The overrides to try, given the base config and the number of processes (the base's value left out): the
    trainer's processes for its knobs, the launch's for the split between the pools."""
    applies: Applies
    """Whether the knob does anything for this config (the critic's knobs only with a critic, ...)."""


def _get(cfg: TrainerConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _powers_of_two(limit: int) -> list[int]:
    values, value = [], 1
    while value < limit:
        values.append(value)
        value *= 2
    return [*values, limit]


def _per_rank_responses(cfg: TrainerConfig, world: int, prompts: int) -> int:
    return max(1, prompts * cfg.actor_rollout_ref.rollout.n // world)


def micro_batch(key: str, group: str, prompts: Callable[[TrainerConfig], int], applies: Applies) -> Knob:
    """Powers of two up to the responses one rank holds in the pass (more would change nothing)."""

    def candidates(cfg: TrainerConfig, world: int) -> list[dict[str, Any]]:
        limit = _per_rank_responses(cfg, world, prompts(cfg))
        return [{key: v} for v in _powers_of_two(limit) if v != _get(cfg, key)]

    return Knob(key, group, candidates, applies)


def prompts_per_call(key: str, applies: Applies) -> Knob:
    """The hf rollout's prompts per sampling call: powers of two below the prompts one rank samples (all of them is
    the default, null)."""

    def candidates(cfg: TrainerConfig, world: int) -> list[dict[str, Any]]:
        prompts = max(1, cfg.data.train_batch_size // world)
        return [{key: v} for v in _powers_of_two(prompts)[:-1] if v != _get(cfg, key)]

    return Knob(key, "rollout", candidates, applies)


def flag(key: str, applies: Applies) -> Knob:
    """A memory switch, tried flipped."""
    return Knob(key, "memory" if "checkpoint" in key or "chunking" in key else "packing", _flipped(key), applies)


def _flipped(key: str) -> Callable[[TrainerConfig, int], list[dict[str, Any]]]:
    return lambda cfg, world: [{key: not _get(cfg, key)}]


def token_budget(switch: str, budget: str, prompts: Callable[[TrainerConfig], int], applies: Applies) -> Knob:
    """use_dynamic_bsz on, with budgets of 4x, 16x, ... one longest sequence, up to the rank's whole pass."""

    def candidates(cfg: TrainerConfig, world: int) -> list[dict[str, Any]]:
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        limit = _per_rank_responses(cfg, world, prompts(cfg)) * longest
        budgets, value = [], 4 * longest
        while value < limit:
            budgets.append(value)
            value *= 4
        budgets.append(limit)
        current = (_get(cfg, switch), _get(cfg, budget))
        return [{switch: True, budget: b} for b in budgets if current != (True, b)]

    return Knob(f"{switch}+{budget}", "token_budget", candidates, applies)


def choices(key: str, values: Sequence[Any], applies: Applies) -> Knob:
    """A rollout engine setting, tried at each of ``values``."""
    return Knob(key, "rollout", lambda cfg, world: [{key: v} for v in values if v != _get(cfg, key)], applies)


def pool_split() -> Knob:
    """The asynchronous trainers' split of the launch's processes (one node): the rollout pool's
    ``rollout.n_gpus_per_node`` at every size that leaves the trainer one, ``trainer.n_gpus_per_node`` set to the
    rest (as verl's scripts give it). What each pool computes stays the same: the rollout samples each prompt from
    its own noise key (the same tokens whichever process samples it) and the losses are normalised by the whole
    batch's counts."""

    def candidates(cfg: TrainerConfig, world: int) -> list[dict[str, Any]]:
        current = cfg.rollout.n_gpus_per_node
        return [
            {"rollout.n_gpus_per_node": size, "trainer.n_gpus_per_node": world - size}
            for size in range(1, world)
            if size != current
        ]

    return Knob("rollout.n_gpus_per_node+trainer.n_gpus_per_node", "pools", candidates, _has_rollout_pool)


def _has_rollout_pool(cfg: TrainerConfig) -> bool:
    return cfg.rollout.n_gpus_per_node > 0 and cfg.rollout.nnodes == 1


def _always(cfg: TrainerConfig) -> bool:
    return True


def _has_critic(cfg: TrainerConfig) -> bool:
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return algos.adv_estimator(cfg.algorithm.adv_estimator).needs_critic


def _has_ref(cfg: TrainerConfig) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def _read_by_rollout(setting: str, device: Optional[str] = None) -> Callable[[TrainerConfig], bool]:
    """Applies when the run's rollout backend reads ``actor_rollout_ref.rollout.<setting>`` (its registration's
    ``reads``), and, with ``device``, only on that kind of machine (``cuda`` or ``cpu``)."""

    def applies(cfg: TrainerConfig) -> bool:
        import torch

        if setting not in rollout_spec(cfg.actor_rollout_ref.rollout.name).reads:
            return False
        return device is None or (device == "cuda") == torch.cuda.is_available()

    return applies


def compiled(key: str, applies: Applies) -> Knob:
    """A compile switch (``torch.compile``: fewer launches for a compile paid once), tried flipped where the trainer
    accepts the flipped setting with the rest of the config (its preflight: not with ZeRO 3)."""

    def accepted(cfg: TrainerConfig) -> bool:
        if not applies(cfg):
            return False
        flipped = copy.deepcopy(cfg)
        *parents, leaf = key.split(".")
        setattr(_get(flipped, ".".join(parents)), leaf, not _get(cfg, key))
        return not preflight.strategy_conflicts(flipped)

    return Knob(key, "compile", _flipped(key), accepted)


def _mini(cfg: TrainerConfig) -> int:
    return cfg.actor_rollout_ref.actor.ppo_mini_batch_size


def _critic_mini(cfg: TrainerConfig) -> int:
    return cfg.critic.ppo_mini_batch_size


def _batch(cfg: TrainerConfig) -> int:
    return cfg.data.train_batch_size


KNOBS = (
    micro_batch(f"{ARR}.actor.ppo_micro_batch_size_per_gpu", "micro_batching", _mini, _always),
    micro_batch("critic.ppo_micro_batch_size_per_gpu", "micro_batching", _critic_mini, _has_critic),
    micro_batch("critic.forward_micro_batch_size_per_gpu", "micro_batching", _batch, _has_critic),
    micro_batch(f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu", "log_prob", _batch, _always),
    micro_batch(f"{ARR}.ref.log_prob_micro_batch_size_per_gpu", "log_prob", _batch, _has_ref),
    flag(f"{ARR}.model.use_remove_padding", _always),
    flag("critic.model.use_remove_padding", _has_critic),
    token_budget(f"{ARR}.actor.use_dynamic_bsz", f"{ARR}.actor.ppo_max_token_len_per_gpu", _mini, _always),
    token_budget("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", _critic_mini, _has_critic),
    flag(f"{ARR}.model.enable_gradient_checkpointing", _always),
    flag("critic.model.enable_gradient_checkpointing", _has_critic),
    flag(f"{ARR}.actor.entropy_checkpointing", _always),
    flag(f"{ARR}.actor.entropy_from_logits_with_chunking", _always),
    flag(f"{ARR}.ref.entropy_from_logits_with_chunking", _has_ref),
    prompts_per_call(f"{ARR}.rollout.micro_batch_size", _read_by_rollout("micro_batch_size")),
    choices(
        f"{ARR}.rollout.max_num_batched_tokens",
        (2048, 4096, 8192, 16384, 32768),
        _read_by_rollout("max_num_batched_tokens"),
    ),
    choices(
        f"{ARR}.rollout.gpu_memory_utilization",
        (0.3, 0.5, 0.7, 0.9),
        _read_by_rollout("gpu_memory_utilization", "cuda"),
    ),
    choices(f"{ARR}.rollout.kv_cache_space_gb", (1, 2, 4), _read_by_rollout("kv_cache_space_gb", "cpu")),
    compiled(f"{ARR}.rollout.enforce_eager", _read_by_rollout("enforce_eager")),
    compiled(f"{ARR}.model.torch_compile", _always),
    pool_split(),
)
TUNABLE = tuple(part for knob in KNOBS for part in knob.key.split("+"))
"""Every key a trial may change."""
ROLLOUT_FIRST = ("rollout", "pools", "log_prob", "micro_batching", "packing", "token_budget", "compile", "memory")
TRAINING_FIRST = ("micro_batching", "pools", "log_prob", "packing", "token_budget", "rollout", "compile", "memory")
GROUP_ORDER = {
    "async-rollout-bound": ROLLOUT_FIRST,
    "async-train-bound": TRAINING_FIRST,
    "rollout-bound": ROLLOUT_FIRST,
    "training-bound": TRAINING_FIRST,
    "memory-bound": ("memory", "token_budget", "packing", "micro_batching", "log_prob", "rollout", "compile", "pools"),
}
"""Which knob groups are searched first, by what ``rlprof report`` diagnosed on the base trial (an asynchronous
trainer's own rules first, :func:`ordered_groups`: the pool's own speed knobs, then the split between the pools, as
the report advises)."""
DEFAULT_ORDER = GROUP_ORDER["training-bound"]


def knobs_for(cfg: TrainerConfig, space: Sequence[str] | None) -> list[Knob]:
    """The knobs to search: those in ``space`` (every tunable one by default) that apply to this config. A key of
    ``space`` that is not tunable is refused, naming the allowed keys."""
    if space:
        refused = [key for key in space if key not in TUNABLE]
        if refused:
            raise ConfigError(
                f"tune.space: {', '.join(refused)} would change what is computed (the algorithm, not its cost), so "
                f"tune does not search it; allowed keys: {', '.join(TUNABLE)}"
            )
    chosen = [k for k in KNOBS if not space or any(part in space for part in k.key.split("+"))]
    return [k for k in chosen if k.applies(cfg)]


def ordered_groups(findings: Sequence[str]) -> tuple[str, ...]:
    """The group order for ``findings`` (rule names of ``rlprof report``): an asynchronous trainer's own rule first
    (which pool sets the pace), else the first of them that has an order."""
    for finding in sorted(findings, key=lambda name: not name.startswith("async-")):
        if finding in GROUP_ORDER:
            return GROUP_ORDER[finding]
    return DEFAULT_ORDER


def as_overrides(changes: dict[str, Any]) -> list[str]:
    """``key=value`` overrides (booleans lower-case, as OmegaConf reads them)."""
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in changes.items()]
