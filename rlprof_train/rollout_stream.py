"""The fully-async trainer's rollout pool: each rollout process samples prompt groups into its queue while the
trainer trains, and hands its queue over when the trainer pulls (:func:`serve_stream`); the trainer's
side is :class:`StreamedRollout`. Over the link between the pools (:mod:`rlprof_train.pools`).

The protocol adds to the one-step-off one (:mod:`rlprof_train.rollout_pool`: ``Start``, ``Weights``, ``Generate``
for validation, ``Stop``):

    trainer rank 0 --orders--> rollout processes:  Feed (prompts to sample), Pull (hand your queue over)
    rollout processes --batches--> every trainer rank:  one Handed per Pull

A rollout process samples the prompts fed to it, up to ``concurrent_samples_per_replica`` groups at once (verl's
requests in flight per replica), and asks the link between two samplings whether an order waits
(:meth:`~rlprof_train.pools.Link.pending`): a sync or a pull waits for the groups in flight, which finish on the
weights they started with (``partial_rollout=False``), or for their current segment (partial rollouts). The
stream's position ``p`` (1-based) is sampled by rollout process ``(p - 1) % R``. The trainer feeds the stream up to
``consumed + max_required`` positions (:class:`Budget`): the rollout pool runs ahead of the updates by at most
``max_required`` groups, as verl's rollouter pauses once ``staleness_samples`` reaches ``max_required_samples`` (the
groups sampled since a sync plus those queued at it), and its queue, bounded by the same number, holds no more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

import rlprof
from rlprof_train.batch import RolloutBatch
from rlprof_train.config import TrainerConfig
from rlprof_train.config.schema import AsyncTrainingConfig
from rlprof_train.data import Example
from rlprof_train.pools import Link, Pool
from rlprof_train.rollout_pool import Generate, PooledRollout, RolloutProcess, Stop, Weights, pool_lost
from rlprof_train.workers.engine import DistEnv
from rlprof_train.workers.rollout.base import (
    Completion,
    Completions,
    ContinuingRollout,
    SamplingParams,
    completions_batch,
    prompt_keys,
    trajectory_keys,
)
from rlprof_train.workers.rollout.multi_turn import MultiTurnRollout, Segments


@dataclass(frozen=True)
class Budget:
    """The fully-async pipeline's sizes, in prompt groups (verl's *samples*)."""

    required: int
    """Groups one local update takes (``actor.ppo_mini_batch_size * async_training.require_batches``)."""
    trigger: int
    """Local updates between syncs (``async_training.trigger_parameter_sync_step``)."""
    max_required: int
    """Groups the rollout pool may have sampled and the trainer not yet trained on, at most
    (``int(required * (1 + staleness_threshold) * trigger)``, verl's ``max_required_samples`` and
    ``max_queue_size``)."""

    @classmethod
    def of(cls, mini_batch: int, pipeline: AsyncTrainingConfig) -> Budget:
        required = mini_batch * pipeline.require_batches
        trigger = pipeline.trigger_parameter_sync_step
        return cls(required, trigger, int(required * (1 + pipeline.staleness_threshold) * trigger))

    @property
    def per_version(self) -> int:
        """Groups trained on between two syncs."""
        return self.required * self.trigger


@dataclass(frozen=True)
class Feed:
    """Positions ``first``, ``first + 1``, ... of the run's prompt stream, to be sampled with ``sampling``."""

    first: int
    prompts: list[Example]
    sampling: SamplingParams


@dataclass(frozen=True)
class Pull:
    """Hand the queue over (every trainer rank takes the groups), for the update of ``step``."""

    step: int


@dataclass(frozen=True)
class Group:
    """One prompt's ``rollout.n`` trajectories, as a rollout process sampled them."""

    position: int
    """Its place in the prompt stream (1-based; its trajectories' ``uid``)."""
    batch: RolloutBatch
    versions: list[tuple[int, int]]
    """Each trajectory's first and last parameter versions (the updates before the weights that drew its first and
    its last token; two apart only after a partial rollout resumed on new weights)."""
    rank: int
    """The rollout process's rank in its pool."""
    seconds: float
    """Its sampling's wall time, pauses included (verl's ``processing_time``)."""


@dataclass(frozen=True)
class Handed:
    rank: int
    groups: list[Group]


# ----------------------------------------------------------------------------------------------- rollout processes


class _Stopped(Exception):
    """Trainer rank 0 said stop while a group was in flight."""


def serve_stream(cfg: TrainerConfig, pool: Pool, link: Link, env: DistEnv, log: Callable[[str], None]) -> None:
    """A fully-async rollout process: sample the groups fed to it while no order waits, take orders between groups
    (and, with partial rollouts, between a group's segments), until trainer rank 0 says stop. Under the weights of
    version ``v`` it records rlprof step ``v + 1`` (the step the trainer trains meanwhile), each group in the
    ``rollout/generate_async`` range."""
    stream = Stream(RolloutProcess(cfg, pool, link, env, log), cfg)
    try:
        stream.run()
    finally:
        stream.close()


class Stream:
    """A rollout process's part of the stream: the prompts fed to it and not yet sampled, its queue of sampled
    groups, the weights' version it samples with."""

    def __init__(self, process: RolloutProcess, cfg: TrainerConfig) -> None:
        self.process, self.link, self.pool = process, process.link, process.pool
        pipeline = cfg.async_training
        self.segment = pipeline.partial_rollout_segment if pipeline.partial_rollout else None
        """Partial rollouts: tokens of the groups in flight sampled between two looks for an order."""
        share = math.ceil(
            Budget.of(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, pipeline).required / self.pool.size
        )
        self.concurrency = min(pipeline.concurrent_samples_per_replica, share)
        """Groups sampled at once: one batched call returns them together, so at most this process's share of a
        local update (the trainer takes the first update's groups while the next ones are sampled)."""
        self.todo: deque[tuple[int, Example]] = deque()
        self.queue: list[Group] = []
        self.sampling: Optional[SamplingParams] = None
        self.in_flight = False
        self.beside = contextlib.ExitStack()

    def run(self) -> None:
        try:
            while True:
                if self.todo and not self.link.pending():
                    groups = self.sample_next()  # a pull taken meanwhile replaces the queue
                    self.queue += groups
                    continue
                reason = "staleness" if not self.todo else "orders"  # nothing fed left: the budget holds it
                if not self.take(self.receive(reason)):
                    return
        except _Stopped:
            return

    def receive(self, reason: str) -> object:
        trainer = self.process.trainer
        with pool_lost("waited for the trainer's next order", trainer), self.process.meter.waiting(reason):
            return self.link.receive()

    def take(self, order: object) -> bool:
        """Carry out ``order``; False: it says stop."""
        process = self.process
        if isinstance(order, Stop):
            return False
        if isinstance(order, Feed):
            self.sampling = order.sampling
            mine = enumerate(order.prompts, order.first)
            self.todo.extend((p, ex) for p, ex in mine if (p - 1) % self.pool.size == self.pool.rank)
        elif isinstance(order, Weights):
            self.beside.close()
            process.take_weights(order)
            self.beside.enter_context(rlprof.step(process.version + 1))
        elif isinstance(order, Pull):
            if not self.queue and self.todo and not self.in_flight:  # every pull gets a group from a process
                self.queue = self.sample_next()  # that has one to sample
            handing = f"handed over its queue for step {order.step}"
            with pool_lost(handing, process.trainer), process.meter.waiting("handover"):
                self.link.exchange(Handed(self.pool.rank, self.queue))
            self.queue = []
        elif isinstance(order, Generate):
            process.answer(order)
        else:
            raise RuntimeError(f"unknown order from the trainer: {order!r}")
        return True

    def sample_next(self) -> list[Group]:
        """The next groups fed to this process, up to ``concurrent_samples_per_replica`` sampled at once."""
        return self.sample([self.todo.popleft() for _ in range(min(self.concurrency, len(self.todo)))])

    def sample(self, fed: list[tuple[int, Example]]) -> list[Group]:
        """The groups of the stream's prompts ``fed`` (position, prompt), sampled together on the host (groups cross
        over gloo), each recorded."""
        process, sampling = self.process, self.sampling
        assert sampling is not None, "a Feed says how to sample"
        process.seed_sampling()
        prompts = [_at(prompt, position) for position, prompt in fed]
        first = process.version
        self.in_flight = True
        with rlprof.profile_range("generate_async", role="rollout"):
            began = time.monotonic()
            if self.segment is None:
                batch = process.rollout.generate(prompts, sampling)
                versions = [(first, first)] * batch.size
            elif isinstance(process.rollout, MultiTurnRollout):
                batch, versions = self.sample_turns_in_segments(prompts, sampling, self.segment)
            else:
                batch, versions = self.sample_in_segments(prompts, sampling, self.segment)
            batch = batch.to(torch.device("cpu"))
            ended = time.monotonic()
        self.in_flight = False
        process.meter.finished(len(prompts))  # samples: verl's unit, a prompt group each
        groups = []
        for i, prompt in enumerate(prompts):
            rows = list(range(i * sampling.n, (i + 1) * sampling.n))
            mine = [versions[row] for row in rows]
            last = max(v for _, v in mine)
            process.records.write(
                {
                    "event": "generate",
                    "uid": prompt.index,
                    "step": last + 1,
                    "version": last,
                    "first_version": first,
                    "rows": sampling.n,
                    "began": began,
                    "ended": ended,
                }
            )
            groups.append(Group(prompt.index, batch.select(rows), mine, self.pool.rank, ended - began))
        return groups

    def sample_in_segments(
        self, prompts: list[Example], sampling: SamplingParams, segment: int
    ) -> tuple[RolloutBatch, list[tuple[int, int]]]:
        """verl's partial rollout: the groups' trajectories sampled ``segment`` tokens at a time, each continued from
        its context so far; between two segments the orders waiting are taken, a weight sync among them, so the
        groups pause for it and go on with the new weights (each trajectory's versions recorded)."""
        rollout, process = self.process.rollout, self.process
        assert isinstance(rollout, ContinuingRollout), "the preflight allows partial rollouts on continuing backends"
        eos = process.tokenizer.eos_token_id
        count = len(prompts) * sampling.n
        tokens: list[list[int]] = [[] for _ in range(count)]
        log_probs: list[list[float]] = [[] for _ in range(count)]
        first = process.version
        last = [first] * count
        open_rows = list(range(count))
        keys = prompt_keys(prompts, sampling)
        started = False
        while open_rows:
            budgets = [min(segment, sampling.response_length - len(tokens[row])) for row in open_rows]
            if not started:  # the first segment: n continuations of each prompt
                contexts = [prompt.prompt_ids for prompt in prompts]
                sampled = rollout.complete(contexts, sampling.n, budgets[: len(prompts)], sampling, keys).rows
                started = True
            else:
                contexts = [(*prompts[row // sampling.n].prompt_ids, *tokens[row]) for row in open_rows]
                own = trajectory_keys(keys, sampling.n, open_rows)
                sampled = rollout.complete(contexts, 1, budgets, sampling, own).rows
            still_open = []
            for row, budget, completion in zip(open_rows, budgets, sampled, strict=True):
                tokens[row] += completion.token_ids
                log_probs[row] += completion.log_probs or []
                last[row] = process.version
                ended = len(completion.token_ids) < budget or completion.token_ids[-1:] == [eos]
                if not ended and len(tokens[row]) < sampling.response_length:
                    still_open.append(row)
            open_rows = still_open
            self.pause_for_orders(sorted({prompts[row // sampling.n].index for row in open_rows}))
        rows = [Completion(t, lp or None) for t, lp in zip(tokens, log_probs, strict=True)]
        batch = completions_batch(prompts, Completions(rows), sampling, process.tokenizer.pad_token_id, eos)
        return batch, [(first, v) for v in last]

    def sample_turns_in_segments(
        self, prompts: list[Example], sampling: SamplingParams, segment: int
    ) -> tuple[RolloutBatch, list[tuple[int, int]]]:
        """Partial rollouts of multi-turn trajectories: the multi-turn loop samples ``segment`` tokens of each at a
        time (a turn cut goes on in the next call, :class:`~rlprof_train.workers.rollout.multi_turn.Segments`), and
        between two calls the groups still going pause for the orders waiting, as :meth:`sample_in_segments`."""
        rollout, process = self.process.rollout, self.process
        assert isinstance(rollout, MultiTurnRollout)
        first = process.version
        last = [first] * (len(prompts) * sampling.n)

        def between(sampled: list[int], going: list[int]) -> None:
            for row in sampled:
                last[row] = process.version
            self.pause_for_orders(sorted({prompts[row // sampling.n].index for row in going}))

        rollout.segments = Segments(segment, between)
        try:
            batch = rollout.generate(prompts, sampling)
        finally:
            rollout.segments = None
        return batch, [(first, v) for v in last]

    def pause_for_orders(self, uids: list[int]) -> None:
        """The groups ``uids``, still being sampled, pause for the orders waiting (a weight sync among them: they go
        on with the new weights), each pause across a sync recorded."""
        process = self.process
        while uids and self.link.pending():
            paused, version = time.monotonic(), process.version
            if not self.take(self.receive("orders")):
                raise _Stopped
            if process.version != version:
                for uid in uids:
                    process.records.write(
                        {
                            "event": "pause",
                            "uid": uid,
                            "version": process.version,
                            "began": paused,
                            "ended": time.monotonic(),
                        }
                    )

    def close(self) -> None:
        self.beside.close()
        self.process.close()


def _at(prompt: Example, position: int) -> Example:
    """``prompt`` named by its stream position (a prompt met again in a later epoch is its own group)."""
    return dataclasses.replace(prompt, index=position)


# ----------------------------------------------------------------------------------------------- the trainer's side


class StreamedRollout(PooledRollout):
    """The trainer's side of the fully-async rollout pool: :meth:`feed` the stream, :meth:`pull` the groups sampled
    so far (every trainer rank makes the same calls in the same order: each is a collective of the trainer pool and
    the link); weights, validation and the end as :class:`~rlprof_train.rollout_pool.PooledRollout`."""

    def feed(self, first: int, prompts: list[Example], sampling: SamplingParams) -> None:
        """Stream positions ``first ..`` to the rollout processes (the same ``prompts`` on every trainer rank)."""
        if prompts and self.env.is_main:
            with self._lost(f"fed it prompts {first}-{first + len(prompts) - 1}"):
                self.link.send(Feed(first, prompts, sampling))

    def pull(self, step: int) -> list[Group]:
        """Every group the rollout processes have sampled and not handed over yet (one or more: a process with fed
        prompts and an empty queue samples one first), in rollout rank order, each queue in sampling order."""
        if self.env.is_main:
            with self._lost(f"asked for its queue for step {step}"):
                self.link.send(Pull(step))
        with self._lost(f"waited for its queue for step {step}"):
            handed: list[Handed] = self.link.exchange(None)
        return [group for h in handed for group in h.groups]
