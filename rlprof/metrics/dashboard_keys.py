"""The seed's W&B dashboard keys (verl's monitoring guide), emitted beside verl's names from the same numbers.

| seed key | from |
|---|---|
| ``train/loss`` | ``actor/pg_loss`` |
| ``train/value_loss`` | ``critic/vf_loss`` |
| ``train/entropy`` | ``actor/entropy`` |
| ``train/kl_divergence`` | ``actor/kl_loss``, else ``actor/reward_kl_penalty``, else ``actor/ppo_kl`` |
| ``reward/{mean,std,max,min}`` | the sequence rewards of ``critic/rewards`` (:func:`compute_data_metrics`) |
| ``throughput/samples_per_sec``, ``throughput/tokens_per_sec`` | responses, tokens per second of step time (1) |
| ``memory/allocated`` | GB: ``perf/max_memory_allocated_gb`` on CUDA, the process's resident memory otherwise (2) |

(1) :func:`rlprof.metrics.compute_throughput_metrics`; (2) :func:`rlprof.metrics.compute_memory_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")
"""Where the KL comes from, first present first: the KL loss, the in-reward KL penalty, PPO's approximate KL."""

TRAINING_ALIASES: dict[str, tuple[str, ...]] = {
    "train/loss": ("actor/pg_loss",),
    "train/value_loss": ("critic/vf_loss",),
    "train/entropy": ("actor/entropy",),
    "train/kl_divergence": KL_KEYS,
}


def training_aliases(metrics: Mapping[str, float]) -> dict[str, float]:
    """The seed's ``train/*`` keys for the verl-named training metrics present in ``metrics``."""
    aliases = {}
    for alias, sources in TRAINING_ALIASES.items():
        for source in sources:
            value = metrics.get(source)
            if value is not None and not math.isnan(value):
                aliases[alias] = value
                break
    return aliases
