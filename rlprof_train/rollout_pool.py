"""The rollout pool of the one-step-off trainer: its processes' loop (:func:`serve`) and the trainer's side of it
(:class:`PooledRollout`), over the link between the pools (:mod:`rlprof_train.pools`).

The protocol, in the order every member of a group makes its calls:

    trainer rank 0 --orders--> rollout processes:  Start, then Weights | Generate | Stop, one at a time
    rollout processes --batches--> every trainer rank:  one Generated per Generate, one window's metrics per Weights

A ``Generate`` carries every trainer rank's prompts (gathered over the trainer pool) in trainer rank order; rollout
process ``r`` samples the ``r``-th of ``R`` near-equal contiguous parts of them; each trainer rank takes its own rows
of the joined batch. A rollout process answers one order after another: the trainer sends weights only once the
batch in flight is collected (:meth:`PooledRollout.publish_weights`), so no sample mixes two versions.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import psutil
import torch

import rlprof
from rlprof.metrics.pipeline import RolloutMeter
from rlprof.metrics.pipeline_records import PipelineLog
from rlprof_train.batch import RolloutBatch, concat_batches
from rlprof_train.config import TrainerConfig, as_dict
from rlprof_train.data import Example
from rlprof_train.models import load_causal_lm, load_tokenizer
from rlprof_train.pools import Link, Pool
from rlprof_train.prepare import make_rollout, rollout_tools
from rlprof_train.workers.engine import DistEnv, gathered_parameters
from rlprof_train.workers.rollout.base import Rollout, SamplingParams


@dataclass(frozen=True)
class Start:
    """What the rollout processes load: the policy's directory, and the run they record for."""

    model_path: str
    run_id: str
    log_probs: bool
    """Return the sampling distribution's log-probs (the trainer's rollout correction, verl's bypass mode)."""
    resumed: bool
    """The run resumes from a checkpoint: its pipeline records continue the earlier run's."""


@dataclass(frozen=True)
class Weights:
    """The policy's parameters follow (:meth:`~rlprof_train.pools.Link.send_weights`): ``names`` in order, the
    weights after ``version`` updates."""

    version: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class Generate:
    prompts: list[Example]
    sampling: SamplingParams
    step: Optional[int]
    """The training step the batch is for (None: validation)."""
    beside: Optional[int]
    """The training step it is sampled beside, the rlprof step the rollout processes record it in (what they did
    during that step, on one clock with the trainer's window; verl hands its rollout the same step); None: before
    the first step, or validation."""


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Member:
    """A rollout process, as it introduces itself once the run starts (named when it stops answering)."""

    rank: int
    """Its rank in the rollout pool."""
    global_rank: int
    host: str
    pid: int

    def __str__(self) -> str:
        return f"rollout rank {self.rank} (launch rank {self.global_rank}, pid {self.pid} on {self.host})"


class PoolLost(RuntimeError):
    """The other pool stopped answering: one of its processes died, hangs past the collective timeout, or lost its
    connection (the error of the link's collective is this one's cause)."""


@dataclass(frozen=True)
class Generated:
    """One rollout process's part of a ``Generate``: its rank in the pool, its rows (None when it had no prompts),
    the seconds it sampled them in and the weights' version it sampled them with."""

    rank: int
    batch: Optional[RolloutBatch]
    seconds: float
    version: int


@dataclass(frozen=True)
class Collected:
    """This trainer rank's rows of a ``Generate``, with what the rollout pool measured."""

    batch: RolloutBatch
    seconds: float
    """The longest of the rollout processes' sampling (verl's ``timing_s/generate_async``)."""
    versions: list[int]
    """Each row's weights' version, the updates before the weights that sampled it."""
    rollout_ranks: list[int]
    """Each row's rollout process (its rank in the rollout pool)."""


def part(items: list[Any], rank: int, size: int) -> list[Any]:
    """The ``rank``-th of ``size`` contiguous parts of ``items``, the first ``len % size`` one longer."""
    base, extra = divmod(len(items), size)
    start = rank * base + min(rank, extra)
    return items[start : start + base + (rank < extra)]


# ----------------------------------------------------------------------------------------------- rollout processes


@dataclass(frozen=True)
class PolicyCopy:
    """The rollout process's copy of the policy, the weights the trainer sends copied into it (the backend reads them
    from here, as from the actor in a synchronous run)."""

    module: Any


class RolloutProcess:
    """A rollout process's policy copy, backend and accounting, shared by the one-step-off loop (:func:`serve`) and
    the fully-async one (:func:`rlprof_train.rollout_stream.serve_stream`): it loads the policy when trainer rank 0
    says ``Start`` and starts the run's rollout backend on it (``rollout.name``, over several turns with its tools
    when ``multi_turn.enable``)."""

    def __init__(self, cfg: TrainerConfig, pool: Pool, link: Link, env: DistEnv, log: Callable[[str], None]) -> None:
        self.cfg, self.pool, self.link = cfg, pool, link
        with pool_lost("waited for the trainer's first order", "trainer rank 0 (launch rank 0)"):
            start = link.receive()
            assert isinstance(start, Start), f"the trainer's first order must be Start, not {start!r}"
            link.exchange(Member(pool.rank, pool.global_rank, socket.gethostname(), os.getpid()))
        self.start = start
        rlprof.init(
            as_dict(cfg), rank=pool.global_rank, world_size=pool.world_size, run_id=start.run_id, pool=pool.name
        )
        self.records = PipelineLog(cfg.trainer.log_dir, pool.global_rank, "rollouter", start.resumed)
        arr = cfg.actor_rollout_ref
        self.tokenizer = tokenizer = load_tokenizer(start.model_path)
        model = load_causal_lm(
            start.model_path, arr.model.dtype, device=env.device, overrides=arr.model.override_config
        )
        self.parameters = dict(model.named_parameters())
        whole = copy.deepcopy(cfg)
        whole.actor_rollout_ref.actor.zero_stage = 0  # the copy here is whole: nothing to gather under ZeRO
        tools = rollout_tools(cfg)
        self.rollout = make_rollout(
            whole, env, start.model_path, PolicyCopy(model), tokenizer, log, tools, start.log_probs
        )
        self.version, self.samplings = 0, 0
        self.meter = RolloutMeter(record=self.records.write)  # its waits: for orders, for weights
        self.trainer = f"the trainer pool (launch ranks 0-{pool.world_size - pool.size - 1})"

    def take_weights(self, order: Weights) -> None:
        """Load the weights that follow ``order``; report the window they end to every trainer rank."""
        if order.names != tuple(self.parameters):
            raise RuntimeError(
                f"the trainer's policy has other parameters than {self.start.model_path} loaded here: "
                f"{sorted(set(order.names) ^ set(self.parameters))[:5]}"
            )
        with pool_lost(f"received the weights of version {order.version}", self.trainer), self.meter.waiting("weights"):
            self.link.receive_weights(list(self.parameters.values()))
        with self.meter.waiting("weights"):  # a backend with its own copy (an engine) loads them
            self.rollout.sync_weights()
        self.version, window = order.version, self.meter.synced(order.version)
        reporting = f"reported its window before the weights of version {self.version}"
        with pool_lost(reporting, self.trainer), self.meter.waiting("weights"):  # the sync ends as every trainer rank
            self.link.exchange(window)  # has the window, logged with the step that synced

    def seed_sampling(self) -> None:
        """Seed torch's random state for the next sampling as the trainer seeds its steps: what samples from it (a
        model sampled by ``generate``, whose noise is not keyed) repeats from run to run."""
        self.samplings += 1
        seed = self.cfg.trainer.seed * 100_003 + self.samplings * self.pool.world_size + self.pool.global_rank
        torch.manual_seed(seed)

    def answer(self, order: Generate) -> None:
        """This process's part of ``order``'s prompts, sampled and handed to every trainer rank."""
        self.seed_sampling()
        generated = generate(self.rollout, order, self.pool, self.version, self.records)
        if generated.batch is not None and order.step is not None:
            self.meter.finished(generated.batch.size // order.sampling.n)  # prompt groups (verl's samples)
        with pool_lost(f"handed over the batch of step {order.step}", self.trainer), self.meter.waiting("queue_full"):
            self.link.exchange(generated)

    def close(self) -> None:
        self.rollout.close()
        self.records.close()


def serve(cfg: TrainerConfig, pool: Pool, link: Link, env: DistEnv, log: Callable[[str], None]) -> None:
    """A one-step-off rollout process: load weights and generate as trainer rank 0 orders, until it says stop. Each
    training batch is sampled inside ``rlprof.step(beside)`` (the step it runs beside), in the
    ``rollout/generate_async`` range."""
    process = RolloutProcess(cfg, pool, link, env, log)
    try:
        while True:
            with pool_lost("waited for the trainer's next order", process.trainer), process.meter.waiting("queue_full"):
                order = link.receive()
            if isinstance(order, Stop):
                break
            if isinstance(order, Weights):
                process.take_weights(order)
            elif isinstance(order, Generate):
                process.answer(order)
            else:
                raise RuntimeError(f"unknown order from the trainer: {order!r}")
    finally:
        process.close()


@contextlib.contextmanager
def pool_lost(doing: str, peers: str) -> Iterator[None]:
    """A link collective that fails (a peer gone or past the timeout) as :class:`PoolLost`, naming ``peers``."""
    try:
        yield
    except RuntimeError as exc:  # gloo's errors (DistBackendError and its kin are RuntimeErrors)
        if isinstance(exc, PoolLost):
            raise
        raise PoolLost(f"{stopped_answering(peers, doing)} (see the error above)") from exc


def stopped_answering(peers: str, doing: str) -> str:
    """What a lost pool's line says: who stopped answering, and what this process was doing."""
    return f"{peers} stopped answering while this process {doing}"


def ended_here(members: list[Member]) -> list[Member]:
    """The ``members`` on this host whose process has ended (gone, or a zombie its launcher has not reaped yet);
    those on other hosts cannot be seen from here."""
    host, ended = socket.gethostname(), []
    for member in members:
        if member.host != host:
            continue
        try:
            if psutil.Process(member.pid).status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            pass
        ended.append(member)
    return ended


def generate(rollout: Rollout, order: Generate, pool: Pool, version: int, records: PipelineLog) -> Generated:
    """This process's part of ``order``'s prompts, sampled (on the host: the batches cross over gloo)."""
    prompts = part(order.prompts, pool.rank, pool.size)
    if not prompts:
        return Generated(pool.rank, None, 0.0, version)
    step = rlprof.step(order.beside) if order.beside is not None else contextlib.nullcontext()
    with step, rlprof.profile_range("generate_async", role="rollout"):
        began = time.monotonic()
        batch = rollout.generate(prompts, order.sampling).to(torch.device("cpu"))
        ended = time.monotonic()
    records.write(
        {
            "event": "generate",
            "step": order.step,
            "beside": order.beside,
            "version": version,
            "rows": batch.size,
            "began": began,
            "ended": ended,
        }
    )
    return Generated(pool.rank, batch, ended - began, version)


# ----------------------------------------------------------------------------------------------- the trainer's side


class PooledRollout(Rollout):
    """The trainer's rollout when generation runs in the rollout pool: ``submit`` sends a batch's prompts, ``collect``
    waits for its rows; ``generate`` does both (validation, ReMax's greedy baselines). Every trainer rank makes the
    same calls in the same order (each is a collective of the trainer pool and the link)."""

    name = "pool"

    def __init__(self, link: Link, env: DistEnv, module: Callable[[], Any], zero_stage: int) -> None:
        self.link, self.env, self.module, self.zero_stage = link, env, module, zero_stage
        self.in_flight = False
        self.early: Optional[Collected] = None
        """A batch collected before its turn (a validation or weights sent while it was in flight)."""
        self.counts: list[int] = []
        self.members: list[Member] = []
        self.step_in_flight: Optional[int] = None
        self.lost = False
        self.abandoned = False
        """This rank failed (:meth:`abandon`): it is on its way out with its own error line."""
        self.doing: Optional[str] = None
        """The exchange with the rollout pool under way (None: this process works on its own)."""
        self.before_sigterm: Any = None
        """SIGTERM's handler before :meth:`_terminated` (None: not installed)."""

    def start(self, model_path: str, run_id: str, log_probs: bool, resumed: bool) -> None:
        """Have the rollout processes load the policy; learn who they are (to name one that stops answering)."""
        with self._lost("started the rollout pool"):
            if self.env.is_main:
                self.link.send(Start(model_path, run_id, log_probs, resumed))
            self.members = self.link.exchange(None)
        self.name_the_ended_on_sigterm()

    def name_the_ended_on_sigterm(self) -> None:
        """Install :meth:`_terminated` as SIGTERM's handler until :meth:`close` (the main thread only can)."""
        if threading.current_thread() is threading.main_thread():
            self.before_sigterm = signal.signal(signal.SIGTERM, self._terminated) or signal.SIG_DFL

    def _terminated(self, signum: int, frame: Any) -> None:
        """SIGTERM: where a rollout process of this host has ended, say so in the line a lost pool gets (torchrun
        ends the other processes of a node within 0.1 s of one dying, often before this one's next exchange with it
        fails); then what SIGTERM did before. A rank already unwinding its own error (:meth:`abandon`) lets it
        finish: SIGTERM would cut it before its line (torchrun's SIGKILL follows 30 s on if it does not end)."""
        if self.abandoned:
            return
        ended = ended_here(self.members)
        if ended:
            gone = "; ".join(str(m) for m in ended)
            doing = self.doing or "worked on its step"
            print(
                f"error on rank {self.env.rank}: {PoolLost.__name__}: {stopped_answering(self._peers(), doing)}: "
                f"{gone} ended, and the launcher ends this process (SIGTERM)",
                file=sys.stderr,
                flush=True,
            )
        previous, self.before_sigterm = self.before_sigterm, None
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    def _peers(self) -> str:
        return f"the rollout pool ({'; '.join(str(m) for m in self.members) or 'its processes'})"

    @contextlib.contextmanager
    def _lost(self, doing: str) -> Iterator[None]:
        self.doing = doing
        try:
            with pool_lost(doing, self._peers()):
                yield
        except PoolLost:
            self.lost = True  # nothing more to tell it, at close either
            raise
        finally:
            self.doing = None

    def publish_weights(self, version: int) -> dict[str, float]:
        """The actor's weights to every rollout process (after the batch in flight, if any, is collected), as
        version ``version`` (the updates before them); returns rollout rank 0's rollouter metrics of the window these
        weights ended (``fully_async/rollouter/*``, :class:`~rlprof.metrics.pipeline.RolloutMeter`)."""
        self._settle()
        module = self.module()
        with gathered_parameters(module, self.zero_stage):
            if self.env.is_main:
                named = list(module.named_parameters())
                with self._lost(f"sent the weights of version {version}"):
                    self.link.send(Weights(version, tuple(name for name, _ in named)))
                    self.link.send_weights([p for _, p in named])
        with self._lost(f"waited for its window before the weights of version {version}"):
            windows: list[dict[str, float]] = self.link.exchange(None)  # every trainer rank's sync phase ends here,
        return windows[0]  # once the weights are in, not only rank 0's

    def submit(
        self, prompts: list[Example], sampling: SamplingParams, step: Optional[int], beside: Optional[int] = None
    ) -> None:
        """Every trainer rank's ``prompts`` to the rollout pool; their rows come back with :meth:`collect`."""
        assert not self.in_flight, "collect the batch in flight first"
        parts = self.env.gather(prompts)
        self.counts = [len(p) for p in parts]
        if self.env.is_main:
            with self._lost(f"sent the prompts of step {step}"):
                self.link.send(Generate([example for p in parts for example in p], sampling, step, beside))
        self.in_flight = True
        self.step_in_flight = step

    def collect(self) -> Collected:
        """This rank's rows of the batch submitted last, once the rollout pool has sampled it."""
        if self.early is not None:
            collected, self.early = self.early, None
            return collected
        return self._receive()

    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch:
        """``prompts`` sampled now, the batch in flight kept for its :meth:`collect`."""
        self._settle()
        self.submit(prompts, sampling, None)
        return self._receive().batch

    def _receive(self) -> Collected:
        assert self.in_flight, "submit a batch first"
        self.in_flight = False
        with self._lost(f"waited for the batch of step {self.step_in_flight}"):
            generated: list[Generated] = self.link.exchange(None)
        parts = [(g, g.batch) for g in generated if g.batch is not None]
        joined = concat_batches([batch for _, batch in parts])
        first = sum(self.counts[: self.env.rank]) * joined.n
        rows = list(range(first, first + self.counts[self.env.rank] * joined.n))
        origin = [g for g, batch in parts for _ in range(batch.size)]  # the joined rows' makers
        return Collected(
            joined.select(rows).to(self.env.device),
            max(g.seconds for g in generated),
            [origin[row].version for row in rows],
            [origin[row].rank for row in rows],
        )

    def _settle(self) -> None:
        """Collect the batch in flight, kept for its :meth:`collect`: the rollout processes answer in order."""
        if self.in_flight:
            self.early = self._receive()

    def abandon(self) -> None:
        """This rank failed: :meth:`close` then waits for nothing and tells the pool nothing (its processes stop when
        this one's exit breaks their link), and SIGTERM no longer cuts the way out (:meth:`_terminated`)."""
        self.lost = self.abandoned = True

    def close(self) -> None:
        """Collect what is in flight and tell the rollout processes to stop (unless the pool was lost); SIGTERM's
        handler as before, unless this rank failed (then it stays, to the process's end)."""
        if self.before_sigterm is not None and not self.abandoned:
            signal.signal(signal.SIGTERM, self.before_sigterm)
            self.before_sigterm = None
        if self.lost:
            return
        self._settle()
        if self.env.is_main:
            with self._lost("told it to stop"):
                self.link.send(Stop())
