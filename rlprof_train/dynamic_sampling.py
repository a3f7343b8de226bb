"""A step's batch from generation rounds, and DAPO's dynamic sampling (``algorithm.filter_groups``), as verl's DAPO
trainer makes them (the DAPO recipe's ``RayDAPOTrainer.fit``; ``docs/algo/dapo.md``).

A step takes rounds of ``data.gen_batch_size`` prompts from the prompt stream, generates and scores each, and, with
``filter_groups.enable``, drops the prompt groups whose ``metric`` is the same for all of their responses (the
group's standard deviation is 0: GRPO's advantages would be 0, the group teaches nothing; a group of one response
stays). Rounds go on until ``data.train_batch_size`` groups are kept over all ranks; the step trains on the first
``train_batch_size`` of them in generation order (round by round, each round in prompt order: rank 0's share, then
rank 1's, ...), ``train_batch_size / world_size`` groups on each rank, and drops the rest (the surplus).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlprof_train.batch import RolloutBatch, concat_batches
from rlprof_train.config.schema import FilterGroupsConfig


class GenerationLimit(RuntimeError):
    """A step's generation rounds reached ``algorithm.filter_groups.max_num_gen_batches`` before it was full: the run
    stops, as the DAPO recipe stops (one line, no traceback: the data or the limit is what to change)."""


SEQUENCE_METRICS = ("seq_reward", "seq_final_reward")
"""Metrics read from the batch's scores rather than from the reward's numbers per response."""


def response_values(batch: RolloutBatch, per_response: dict[str, list[float]], metric: str) -> list[float]:
    """Each response's ``metric``: ``seq_reward`` (its score summed over tokens), ``seq_final_reward`` (the same, as
    the in-reward KL is not applied before groups are chosen here: the config check refuses the two together), or a
    number the reward gave per response (``acc``, ``score``, a dict reward's key)."""
    if metric in SEQUENCE_METRICS:
        assert batch.token_level_scores is not None, "score the batch first"
        return batch.token_level_scores.sum(-1).tolist()
    values = per_response.get(metric)
    if values is None or any(math.isnan(v) for v in values):
        given = ", ".join(sorted(per_response)) or "nothing but its score"
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r}: the reward did not give {metric!r} for every response (it "
            f"gives: {given}); choose one of those or seq_reward, or reward_model.reward_manager=dapo (which records "
            "a number reward as acc)"
        )
    return values


def groups_with_variance(uids: Sequence[Any], values: Sequence[float]) -> list[Any]:
    """The groups (``uid`` of each response) to keep, in order of first appearance: those whose values differ
    (population standard deviation > 0, as ``np.std``) or that hold one response."""
    grouped: dict[Any, list[float]] = {}
    for uid, value in zip(uids, values, strict=True):
        grouped.setdefault(uid, []).append(float(value))
    return [uid for uid, group in grouped.items() if len(group) == 1 or _std(group) > 0]


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


@dataclass
class Round:
    """One generation round's kept groups on this rank."""

    batch: RolloutBatch
    """Its responses whose groups were kept (``n`` consecutive rows per group)."""
    groups: int
    """Groups in ``batch``."""


@dataclass
class Rounds:
    """The rounds of one step (on this rank), and what the filter dropped."""

    kept: list[Round] = field(default_factory=list)
    dropped: int = 0
    """Groups without variance, over all ranks."""
    dropped_by_value: dict[float, int] = field(default_factory=dict)
    """Those groups by the value all of their responses shared (how many all succeeded, all failed), all ranks."""
    groups: int = 0
    """Kept groups over all ranks."""

    def keep(
        self,
        batch: RolloutBatch,
        filtering: FilterGroupsConfig,
        per_response: dict[str, list[float]],
        gather: Callable[[Any], list[Any]],
        round_groups: int,
    ) -> None:
        """Add a scored round of ``round_groups`` prompt groups (over all ranks). Without ``filtering.enable`` all
        are kept and nothing is exchanged; with it, the groups without variance are dropped and the counts of every
        rank gathered (one ``gather``: every rank calls it once per round, a point where ranks wait for each other:
        the caller keeps it out of any phase's time, so that a slow rank's phase stays its own)."""
        if not filtering.enable:
            self.kept.append(Round(batch, batch.size // batch.n))
            self.groups += round_groups
            return
        assert filtering.metric is not None, "the config check requires the metric"
        values = response_values(batch, per_response, filtering.metric)
        kept = set(groups_with_variance(batch.uid, values))
        shared = list({uid: values[i] for i, uid in enumerate(batch.uid) if uid not in kept}.values())
        batch = batch.select([i for i, uid in enumerate(batch.uid) if uid in kept])
        self.kept.append(Round(batch, batch.size // batch.n))
        for groups, dropped in gather((batch.size // batch.n, shared)):
            self.groups += groups
            self.dropped += len(dropped)
            for value in dropped:
                self.dropped_by_value[value] = self.dropped_by_value.get(value, 0) + 1


def assemble(
    rounds: Rounds, train_batch_size: int, rank: int, world_size: int, gather: Callable[[Any], list[Any]]
) -> tuple[RolloutBatch, int]:
    """This rank's share of the step's first ``train_batch_size`` kept groups in generation order, and how many
    kept groups were dropped as surplus (over all ranks).

    Every rank computes the same order from the kept counts of each (round, rank); groups another rank holds are
    sent through ``gather`` (every rank receives what is sent; only rows that change rank travel, via the host)."""
    counts = gather([r.groups for r in rounds.kept])  # [rank][round]
    order = [
        (j, owner, k) for j in range(len(rounds.kept)) for owner in range(world_size) for k in range(counts[owner][j])
    ]
    share = train_batch_size // world_size
    runs = [_runs(order[dest * share : (dest + 1) * share]) for dest in range(world_size)]
    outgoing = {
        dest: [_groups(rounds, j, ks).to(torch.device("cpu")) for j, owner, ks in runs[dest] if owner == rank]
        for dest in range(world_size)
        if dest != rank
    }
    received = gather(outgoing) if world_size > 1 else []
    arrived = {owner: iter(received[owner].get(rank, [])) for owner in range(world_size) if owner != rank}
    device = rounds.kept[0].batch.input_ids.device
    pieces = [
        _groups(rounds, j, ks) if owner == rank else next(arrived[owner]).to(device) for j, owner, ks in runs[rank]
    ]
    return concat_batches(pieces), len(order) - train_batch_size


def _runs(assigned: list[tuple[int, int, int]]) -> list[tuple[int, int, list[int]]]:
    """``(round, owner, group)`` entries as runs of the same round and owner: ``(round, owner, [groups])``."""
    runs: list[tuple[int, int, list[int]]] = []
    for j, owner, k in assigned:
        if runs and runs[-1][:2] == (j, owner):
            runs[-1][2].append(k)
        else:
            runs.append((j, owner, [k]))
    return runs


def _groups(rounds: Rounds, j: int, groups: list[int]) -> RolloutBatch:
    """The rows of groups ``groups`` of round ``j``'s kept batch."""
    batch = rounds.kept[j].batch
    return batch.select([k * batch.n + i for k in groups for i in range(batch.n)])
