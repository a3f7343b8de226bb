"""The stall watchdog: a phase of a step (``gen``, ``reward``, ``update_actor``, a weight sync, ...) that runs far
longer than it usually does makes every rank write all its threads' Python stacks, so that a hang names its rank and
line instead of waiting out the collective timeout in silence. The trainer watches its phases with it
(``trainer.watchdog``); in your own loop::

    with rlprof.watchdog("outputs/logs", min_s=60) as dog:
        for step in range(1, steps + 1):
            with dog.phase(step, "generate"):
                ...

Each rank times its own phases. A thread checks the innermost open phase every ``POLL_S``: stalled once it has run
``factor`` times its median over the steps before (and at least ``min_s``), or ``limit_s`` whatever its median. The
first rank to see a stall announces it in the process group's store (a counter and the event); every rank's thread
sees the counter move and writes ``{log_dir}/stalls/step{N}/rank{R}.txt``; rank 0 names the rank furthest behind (the
one in its current phase longest), logs one line and writes ``stall.json`` beside the stacks, which ``rlprof report``
reads (:mod:`rlprof.analysis.stalls`). With ``abort_after_s``, a rank still in the phase it was in when it wrote its
stacks that many seconds later ends the process (exit code :data:`ABORT_EXIT`), freeing the cluster.

As it starts and once a second, the thread also writes the rank's innermost phase to ``{log_dir}/live/rank{R}.json``
(:mod:`rlprof.live_state`, what ``rlprof top`` shows), and once more when the watchdog closes.

Cost with nothing stalled: a list append and pop per phase (and, without a ``positions`` source, one store write),
one store read per ``POLL_S`` per rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlprof.live_state import LiveState, write_live
from rlprof.session import get_session
from rlprof.stall_files import EVENT_FILE, stall_folder
from rlprof.tracking.base import LiveSample
from rlprof.typed_config import bounds, build

POLL_S = 1.0
PY_SPY_TIMEOUT_S = 30.0
"""The longest one py-spy dump may take."""
EVENT_WAIT_S = 10.0
"""The longest the thread waits for a stall's event after the counter moved (its announcer sets it right after)."""
COUNT_KEY = "rlprof/stall/count"
EVENT_KEY = "rlprof/stall/{n}"
AT_KEY = "rlprof/watchdog/at/{rank}"
ABORT_EXIT = 3
HISTORY = 20
"""Durations per phase the median is taken over (the latest)."""


@dataclass
class WatchdogConfig:
    """When a phase counts as stalled, and what then."""

    enable: bool = True
    """Watch every phase of every step."""
    factor: float = field(default=10.0, metadata=bounds(gt=1))
    """A phase is stalled after this many times its median over the steps before (the first step's duration, with
    compilation and cache filling, counts only until there are others)."""
    min_s: float = field(default=60.0, metadata=bounds(gt=0))
    """... and never before this many seconds."""
    limit_s: Optional[float] = field(default=None, metadata=bounds(gt=0))
    """A phase running this long is stalled whatever its median, in the first step too (null: no absolute limit)."""
    abort_after_s: Optional[float] = field(default=None, metadata=bounds(gt=0))
    """After writing its stacks, a rank still in the same phase this many seconds later ends the job (exit code 3),
    freeing the cluster (null: keep waiting)."""


@dataclass(frozen=True)
class Position:
    rank: int
    step: int
    phase: str
    since: float
    """Wall-clock time the rank entered the phase."""
    ordinal: int = 0
    """Phases the rank entered in this step before this one: ranks run the same phases in the same order, so the
    lowest (step, ordinal) is the rank behind, whichever entered its phase first on the clock."""

    def order(self) -> tuple[int, int, float]:
        return (self.step, self.ordinal, self.since)


class Ordinal:
    """Counts the phases entered per step (:attr:`Position.ordinal`)."""

    def __init__(self) -> None:
        self.step, self.count = -1, -1

    def next(self, step: int) -> int:
        self.count = self.count + 1 if step == self.step else 0
        self.step = step
        return self.count


@dataclass(frozen=True)
class Stall:
    """One stall, as announced by the rank that saw it."""

    step: int
    phase: str
    rank: int
    """The rank that saw it (its own phase ran too long)."""
    elapsed_s: float
    threshold_s: float
    median_s: Optional[float]
    """The phase's median before (None: no earlier step; the absolute limit applied)."""


class Watchdog:
    """This rank's phases, timed and watched (see the module doc)."""

    def __init__(
        self,
        config: WatchdogConfig,
        log_dir: Path,
        rank: int = 0,
        world_size: int = 1,
        store: Any = None,
        positions: Optional[Callable[[], list[Position]]] = None,
        warn: Optional[Callable[[str], None]] = None,
        setting: str = "watchdog",
    ) -> None:
        """``store``: the process group's key-value store (None: a world of one); ``positions``: every rank's
        current phase, where the caller already publishes them (else the watchdog does, one store write per phase);
        ``setting``: how messages name the settings (``trainer.watchdog``)."""
        self.config, self.log_dir, self.rank, self.world_size = config, Path(log_dir), rank, world_size
        self.store, self.setting = store, setting
        self._positions = positions
        self._ordinal = Ordinal()
        self.warn = warn or (lambda line: print(f"[WARN] {line}", file=sys.stderr, flush=True))
        self.open: list[tuple[int, str, float]] = []
        """(step, phase, monotonic start) of the phases open now, outermost first."""
        self.durations: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.stalled_steps: set[int] = set()
        """Steps with a stall (any rank's)."""

        self._fired: set[tuple[int, str]] = set()
        self._seen = 0
        self._local: list[Stall] = []  # a world of one has no store: its events stay here
        self._stop = threading.Event()
        self._writing = False
        """A stall's files are being written (close waits for them)."""
        self._thread: Optional[threading.Thread] = None
        if config.enable:
            self._thread = threading.Thread(target=self._watch, name="rlprof-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self.close)  # a daemon thread inside a store call when Python finalizes aborts it

    @contextlib.contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        """Time ``name`` of ``step``: its duration joins the phase's median when it ends."""
        entry = (step, name, time.monotonic())
        self.open.append(entry)
        ordinal = self._ordinal.next(step)
        if self._positions is None and self.store is not None and self.config.enable:
            try:
                self.store.set(AT_KEY.format(rank=self.rank), json.dumps([step, name, time.time(), ordinal]))
            except Exception:  # noqa: BLE001  (the store's host is gone: the stall report says less, no more)
                self.store = None
        try:
            yield
        finally:
            self.open.remove(entry)
            history = self.durations[name]
            history.append((step, time.monotonic() - entry[2]))
            del history[:-HISTORY]

    def close(self) -> None:
        """Stop watching and wait for the thread: a store call it is in (at most ``EVENT_WAIT_S``), a stall being
        written (stacks, py-spy's dump, the event). Called before the interpreter winds down where nobody did: a
        daemon thread still inside a store call when Python finalizes aborts the process ("terminate called without
        an active exception") as it returns into the interpreter."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S + EVENT_WAIT_S)
            if self._thread.is_alive() and self._writing:
                self._thread.join(timeout=2 * PY_SPY_TIMEOUT_S + POLL_S)
            self._thread = None
            atexit.unregister(self.close)
            self._publish(closed=True)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def positions(self) -> list[Position]:
        """Every rank's current phase (the ones that published one)."""
        if self._positions is not None:
            return self._positions()
        here = _innermost(self.open)
        since = time.time() - (time.monotonic() - here[2]) if here else 0.0
        mine = [Position(self.rank, here[0], here[1], since, self._ordinal.count)] if here else []
        if self.store is None:
            return mine
        found = []
        for rank in range(self.world_size):
            key = AT_KEY.format(rank=rank)
            try:
                if self.store.check([key]):
                    step, phase, since, ordinal = json.loads(self.store.get(key))
                    found.append(Position(rank, int(step), str(phase), float(since), int(ordinal)))
            except Exception:  # noqa: BLE001
                continue
        return found or mine

    def live_samples(self) -> list[LiveSample]:
        """This rank's innermost open phase, for a live backend (``Tracker.add_live``): ``watchdog/phase_seconds``
        (how long it has run) and ``watchdog/phase_limit_seconds`` (when it counts as stalled, once known), both
        labelled ``phase`` and ``step``; none between steps. The limit is the thread's own: the phase runs past it
        exactly when the watchdog calls it stalled."""
        here = _innermost(list(self.open))
        if here is None:
            return []
        step, name, start = here
        labels = {"phase": name, "step": str(step)}
        samples = [LiveSample("watchdog/phase_seconds", labels, time.monotonic() - start)]
        limit, _ = self.threshold(step, name)
        if limit is not None and self.config.enable:
            samples.append(LiveSample("watchdog/phase_limit_seconds", labels, limit))
        return samples

    # ------------------------------------------------------------------------------------------ the thread

    def threshold(self, step: int, name: str) -> tuple[Optional[float], Optional[float]]:
        """(seconds after which ``name`` of ``step`` is stalled, the median it comes from); (None, None): not yet."""
        earlier = [seconds for s, seconds in self.durations.get(name, []) if s < step]
        if len(earlier) > 1:
            earlier = earlier[1:]  # the first step's (compilation, caches) only until there are others
        limits = []
        median = statistics.median(earlier) if earlier else None
        if median is not None:
            limits.append(max(self.config.min_s, self.config.factor * median))
        if self.config.limit_s is not None:
            limits.append(self.config.limit_s)
        return (min(limits) if limits else None), median

    def _watch(self) -> None:
        abort: Optional[tuple[float, tuple[int, str, float]]] = None
        self._publish()  # at once: ``rlprof top`` shows the rank from its start, not a second later
        while not self._stop.wait(POLL_S):
            try:
                self._publish()
                self._check_own_phase()
                for stall in self._new_events():
                    here = _innermost(self.open)
                    self._writing = True
                    try:
                        self._write_stacks(stall, here)
                        if self.rank == 0:
                            self._announce(stall)
                    finally:
                        self._writing = False
                    if self.config.abort_after_s is not None and here is not None:
                        abort = (time.monotonic() + self.config.abort_after_s, here)
                if abort is not None and time.monotonic() >= abort[0]:
                    if _innermost(self.open) == abort[1]:
                        self._abort(abort[1])
                    abort = None
            except Exception as exc:  # noqa: BLE001  (the watchdog must never stop training)
                self.warn(f"the stall watchdog stopped ({type(exc).__name__}: {exc})")
                return

    def _publish(self, closed: bool = False) -> None:
        """This rank's innermost phase to ``{log_dir}/live/rank{R}.json`` (for ``rlprof top``); a write that fails
        (a full disk) is left for the next second."""
        here = _innermost(list(self.open))
        since = time.time() - (time.monotonic() - here[2]) if here else None
        state = LiveState(
            self.rank,
            self.world_size,
            socket.gethostname(),
            os.getpid(),
            here[0] if here else None,
            here[1] if here else None,
            since,
            time.time(),
            closed,
        )
        with contextlib.suppress(OSError):
            write_live(self.log_dir, state)

    def _check_own_phase(self) -> None:
        here = _innermost(self.open)
        if here is None:
            return
        step, name, start = here
        if (step, name) in self._fired or step in self.stalled_steps:  # one stall per step: the others wait for it
            return
        limit, median = self.threshold(step, name)
        elapsed = time.monotonic() - start
        if limit is None or elapsed < limit:
            return
        self._fired.add((step, name))
        stall = Stall(step, name, self.rank, round(elapsed, 3), round(limit, 3), median)
        if self.store is None:
            self._local.append(stall)
            return
        n = self.store.add(COUNT_KEY, 1)
        self.store.set(EVENT_KEY.format(n=n), json.dumps(asdict(stall)))

    def _new_events(self) -> list[Stall]:
        if self.store is None:
            found, self._local = self._local, []
        else:
            count = self.store.add(COUNT_KEY, 0)
            found = []
            for n in range(self._seen + 1, count + 1):
                key = EVENT_KEY.format(n=n)
                try:
                    self.store.wait([key], datetime.timedelta(seconds=EVENT_WAIT_S))
                except Exception:  # noqa: BLE001  (its announcer died in between)
                    continue
                found.append(Stall(**json.loads(self.store.get(key))))
            self._seen = max(self._seen, count)
        first = []
        for stall in found:  # two ranks may see the same step's stall at once: the first announced is the one
            if stall.step not in self.stalled_steps:
                self.stalled_steps.add(stall.step)
                first.append(stall)
        return first

    def folder(self, step: int) -> Path:
        return stall_folder(self.log_dir) / f"step{step}"

    def _write_stacks(self, stall: Stall, here: Optional[tuple[int, str, float]]) -> None:
        folder = self.folder(stall.step)
        folder.mkdir(parents=True, exist_ok=True)
        where = f"in {here[1]} of step {here[0]} for {time.monotonic() - here[2]:.1f} s" if here else "between phases"
        lines = [
            f"rank {self.rank} of {self.world_size}, pid {os.getpid()} on {socket.gethostname()}: {where}",
            f"(stall seen by rank {stall.rank}: {stall.phase} of step {stall.step} ran {stall.elapsed_s:.1f} s, "
            f"threshold {stall.threshold_s:.1f} s)",
            "",
            thread_stacks(),
        ]
        stacks = folder / f"rank{self.rank}.txt"
        stacks.write_text("\n".join(lines))  # at once: py-spy may take seconds on a loaded host
        seen_by_py_spy = _py_spy_dump()
        if seen_by_py_spy:
            with stacks.open("a") as file:
                file.write(f"\n\n{seen_by_py_spy}")

    def _announce(self, stall: Stall) -> None:
        """Rank 0: name the rank furthest behind, log one line, write the event."""
        positions = sorted(self.positions(), key=Position.order)
        behind = positions[0] if positions and self.world_size > 1 else None  # alone: the stall's own phase
        now = time.time()
        culprit = (
            {"rank": behind.rank, "phase": behind.phase, "step": behind.step, "for_s": round(now - behind.since, 1)}
            if behind is not None
            else {"rank": stall.rank, "phase": stall.phase, "step": stall.step, "for_s": stall.elapsed_s}
        )
        folder = self.folder(stall.step)
        record = {
            **asdict(stall),
            "behind": culprit,
            "positions": [
                {"rank": p.rank, "step": p.step, "phase": p.phase, "for_s": round(now - p.since, 1)} for p in positions
            ],
            "world_size": self.world_size,
        }
        (folder / EVENT_FILE).write_text(json.dumps(record, indent=1))
        session = get_session()
        if session is not None and session.tool is not None:  # a profile's manifest lists it (often another folder)
            try:
                session.record_event(
                    "stall", step=stall.step, phase=stall.phase, behind=culprit, folder=str(folder.resolve())
                )
            except OSError as exc:
                self.warn(f"the stall could not be listed in the profile's manifest ({exc})")
        median = f"its median {stall.median_s:.2f} s, " if stall.median_s is not None else ""
        self.warn(
            f"stall: rank {culprit['rank']} has been in {culprit['phase']} of step {culprit['step']} for "
            f"{culprit['for_s']:.0f} s (rank {stall.rank} saw {stall.phase} run {stall.elapsed_s:.0f} s: "
            f"{median}threshold {stall.threshold_s:.0f} s); every rank's threads: {folder}"
        )

    def _abort(self, here: tuple[int, str, float]) -> None:
        self.warn(
            f"stall: rank {self.rank} is still in {here[1]} of step {here[0]} "
            f"{self.setting}.abort_after_s={self.config.abort_after_s:g} s after its stacks were written; ending "
            f"the job (exit code {ABORT_EXIT})"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ABORT_EXIT)


def _innermost(open_phases: list[tuple[int, str, float]]) -> Optional[tuple[int, str, float]]:
    """The innermost open phase, read from the watchdog's thread while the training thread opens and closes them."""
    snapshot = list(open_phases)  # one atomic copy: the list may change between a length check and an index
    return snapshot[-1] if snapshot else None


def thread_stacks() -> str:
    """Every thread's Python stack, innermost frame last, headed by the thread's name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == "rlprof-watchdog":
            continue
        stack = "".join(traceback.format_stack(frame))
        blocks.append(f"Thread {names.get(ident, '?')} ({ident}), innermost last:\n{stack}")
    return "\n".join(blocks)


def py_spy() -> Optional[str]:
    """The ``py-spy`` executable, or None."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)


def _py_spy_dump() -> str:
    """Every thread of this process as py-spy sees it, headed by the command: with C frames (``--native``), or
    without them when native unwinding fails (it sometimes does), the failure named; '' where py-spy is not
    installed (on PATH or beside this interpreter, as in a virtual environment not activated)."""
    spy = py_spy()
    if spy is None:
        return ""
    failures = []
    for flags in (["--native"], []):
        name = " ".join(["py-spy dump", *flags])
        try:
            done = subprocess.run(
                [spy, "dump", *flags, "--pid", str(os.getpid())],
                check=False,
                capture_output=True,
                text=True,
                timeout=PY_SPY_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            failures.append(f"({name} failed: {exc})")
            continue
        if done.returncode == 0:
            return "\n".join([*failures, f"{name}:", done.stdout])
        failures.append(f"({name} failed: {done.stderr.strip()[-500:]})")
    return "\n".join(failures)


def watchdog(log_dir: str | Path, **settings: Any) -> Watchdog:
    """A running :class:`Watchdog` writing under ``log_dir``, with :class:`WatchdogConfig`'s ``settings``
    (``factor``, ``min_s``, ``limit_s``, ``abort_after_s``; a bad one is a :class:`~rlprof.ConfigError` naming it).
    Under an initialised torch.distributed it watches this rank and meets the others in the default group's store.
    Use it as a context manager (or call ``close``)."""
    config = build(WatchdogConfig, settings, "watchdog")
    rank, world_size, store = 0, 1, None
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        rank, world_size = dist.get_rank(), dist.get_world_size()
        store = distributed_c10d._get_default_store() if world_size > 1 else None
    return Watchdog(config, Path(log_dir), rank, world_size, store)
