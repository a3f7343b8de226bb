"""An asynchronous pipeline's metrics (rlprof.metrics.pipeline) under verl's names: staleness, spans and partial
rollouts as verl v1's and fully-async trainer's formulas give them, computed here independently; the rollouter's idle
ratio over every wait of its window (verl #6693 counts the last one); and a real two-thread pipeline whose ratios
equal the count of its own logged waits."""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest

from rlprof.metrics.pipeline import PipelineSide, RolloutMeter, TrainerMeter, TrajectoryRecord
from rlprof.metrics.pipeline_records import PipelineLog
from rlprof.tracking.jsonl import read_jsonl


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rollouters_idle_ratio_counts_every_wait_of_the_window_not_the_last_one():
    clock = Clock()
    rollouter = RolloutMeter(clock)
    # a window of 10 s: generating 0-2, paused for the queue 2-4, generating 4-5, paused for weights 5-8, then 8-10
    clock.now = 2.0
    with rollouter.waiting("queue_full"):
        clock.now = 4.0
    clock.now = 5.0
    with rollouter.waiting("weights"):
        clock.now = 8.0
    clock.now = 10.0
    rollouter.finished(6)
    rollouter.finished(2, dropped_stale=True)
    metrics = rollouter.synced(1)
    assert metrics["fully_async/rollouter/version_time"] == 10.0
    assert metrics["fully_async/rollouter/active_time"] == 5.0  # 2 + 1 + 2
    assert metrics["fully_async/rollouter/idle_ratio"] == 0.5
    assert metrics["fully_async/rollouter/wait_s/queue_full"] == 2.0
    assert metrics["fully_async/rollouter/wait_s/weights"] == 3.0
    assert metrics["fully_async/count/total_generated_samples"] == 8
    assert metrics["fully_async/count/dropped_stale_samples"] == 2
    # verl's rollouter (reset_staleness): active = idle_start_time - step_start_time, idle_start_time being when it
    # last went idle: 5 s here, so it says 0.5 too, by chance: the 2 s paused for the queue are not in its sum
    clock.now = 11.0
    with rollouter.waiting("queue_full"):
        clock.now = 15.0
    clock.now = 20.0
    again = rollouter.synced(2)
    assert again["fully_async/rollouter/idle_ratio"] == pytest.approx(0.4)  # paused 4 of 10 s
    verl = 1 - (11.0 - 10.0) / 10.0  # it went idle at 11: verl counts the 9 s after as idle, the 5 s of work too
    assert verl == pytest.approx(0.9)


def test_a_wait_across_a_windows_end_counts_in_both_windows_by_its_time_in_each():
    clock = Clock()
    side = PipelineSide("trainer", clock)
    with side.waiting("samples"):
        clock.now = 3.0
        assert side.window() == (3.0, {"samples": 3.0})
        clock.now = 4.0
    clock.now = 10.0
    assert side.window() == (7.0, {"samples": 1.0})
    assert side.window() == (0.0, {})


def staleness_by_verl_v1(global_steps: int, min_steps: list[int], max_steps: list[int]) -> dict[str, float]:
    """verl/trainer/ppo/v1/trainer_base.py's off-policy block, written again with numpy (global_steps - 1: the
    weights' version)."""
    mins, maxs = np.array(min_steps), np.array(max_steps)
    out = {}
    for name, values in (
        ("trajectory_spans", maxs - mins + 1),
        ("trajectory_staleness", (global_steps - 1) - maxs),
        ("trajectory_staleness_worst", (global_steps - 1) - mins),
    ):
        out |= {f"training/off_policy/{name}/{f}": float(getattr(values, f)()) for f in ("mean", "max", "min")}
    return out


def test_staleness_spans_and_partial_rollouts_are_verls_formulas_and_counts_accumulate():
    rng = random.Random(3)
    trainer = TrainerMeter()
    stale_total = 0
    stale_groups_total = 0
    for version in range(6):
        batch = []
        for group in range(8):
            for _ in range(4):  # rollout.n = 4
                first = max(0, version - rng.randint(0, 2))
                last = min(version, first + rng.randint(0, 2))
                batch.append(TrajectoryRecord((version, group), first, last, rng.uniform(0.5, 3.0)))
        metrics = trainer.consumed(batch)
        verl = staleness_by_verl_v1(version + 1, [t.first_version for t in batch], [t.last_version for t in batch])
        assert {k: metrics[k] for k in verl} == pytest.approx(verl)
        diffs = [abs(t.last_version - t.first_version) for t in batch]  # detach_utils.py's partial block
        assert metrics["fully_async/partial/total_partial_num"] == len(diffs) - diffs.count(0)
        assert metrics["fully_async/partial/partial_ratio"] == pytest.approx((len(diffs) - diffs.count(0)) / len(diffs))
        assert metrics["fully_async/partial/max_partial_span"] == max(diffs)
        stale_total += sum(1 for t in batch if version - t.last_version >= 1)  # fully_async_trainer.py's count
        stale_groups_total += len({t.group for t in batch if version - t.last_version >= 1})
        assert metrics["fully_async/count/stale_trajectory_processed"] == stale_total
        assert metrics["fully_async/count/stale_samples_processed"] == stale_groups_total
        assert metrics["fully_async/count/current_param_version"] == version
        seconds = [t.seconds for t in batch]
        assert metrics["fully_async/processing_time/tp95"] == pytest.approx(np.percentile(seconds, 95))
        assert metrics["fully_async/processing_time/max"] == max(seconds)
        trainer.synced()
    assert stale_total > 0


@dataclass
class AsyncLoop:
    """A real asynchronous loop on two threads, the way a user writes one with the meters: a rollouter generating
    trajectories (``gen_s`` each) into a bounded queue, pausing while it is full and while a sync holds the weights,
    dropping a trajectory more than ``max_staleness`` versions old; a trainer taking ``batch`` of them, updating
    (``update_s``, or ``slow_update_s`` every third step), publishing its weights every ``sync_every`` updates
    (``sync_s``). Each thread also logs its own waits and when it closed each window, with time.monotonic: ``waits``
    (reason, read before the meter's wait began, read inside it at its start, inside at its end, after it ended) and
    ``windows`` (the meter's metrics, read before the window's end, read after)."""

    gen_s: float = 0.004
    update_s: float = 0.012
    slow_update_s: float = 0.002
    sync_s: float = 0.005
    sync_every: int = 2
    batch: int = 4
    queue_size: int = 6
    max_staleness: Optional[int] = None
    waits: dict[str, list[tuple[str, float, float, float, float]]] = field(
        default_factory=lambda: {"rollouter": [], "trainer": []}
    )
    windows: dict[str, list[tuple[dict[str, float], float, float]]] = field(
        default_factory=lambda: {"rollouter": [], "trainer": []}
    )

    def run(self, steps: int) -> list[dict[str, float]]:
        """Each step's metrics, as a trainer would log them (the rollouter's newest window joins each step's)."""
        rollouter, trainer = RolloutMeter(), TrainerMeter()
        samples: queue.Queue[TrajectoryRecord] = queue.Queue(maxsize=self.queue_size)
        version = [0]
        sync = threading.Lock()  # held by the trainer while it publishes: the rollouter waits for weights
        stop = threading.Event()

        def timed(side: str, meter, reason: str, action):
            before = time.monotonic()
            with meter.waiting(reason):
                start = time.monotonic()
                result = action()
                end = time.monotonic()
            self.waits[side].append((reason, before, start, end, time.monotonic()))
            return result

        def closed(side: str, close):
            before = time.monotonic()
            metrics = close()
            self.windows[side].append((metrics, before, time.monotonic()))
            return metrics

        def generate() -> None:
            while not stop.is_set():
                started, first = time.monotonic(), version[0]
                time.sleep(self.gen_s)
                record = TrajectoryRecord(started, first, version[0], time.monotonic() - started)
                stale = self.max_staleness is not None and version[0] - first > self.max_staleness
                rollouter.finished(dropped_stale=stale)
                while not stale and not stop.is_set():
                    try:
                        if samples.full():
                            timed("rollouter", rollouter, "queue_full", lambda r=record: samples.put(r, timeout=0.05))
                        else:
                            samples.put_nowait(record)
                        break
                    except queue.Full:
                        continue
                if version[0] != rollouter.version:  # a sync began: wait for its weights unless it is over
                    if sync.locked():
                        timed("rollouter", rollouter, "weights", lambda: (sync.acquire(), sync.release()))
                    closed("rollouter", lambda: rollouter.synced(version[0]))

        worker = threading.Thread(target=generate)
        worker.start()
        records = []
        try:
            for step in range(1, steps + 1):
                step_start = time.monotonic()
                batch = [timed("trainer", trainer, "samples", samples.get) for _ in range(self.batch)]
                metrics = trainer.consumed(batch)
                time.sleep(self.update_s if step % 3 else self.slow_update_s)
                if step % self.sync_every == 0:
                    with sync:
                        version[0] += 1
                        trainer.synced()
                        time.sleep(self.sync_s)
                metrics |= closed("trainer", lambda s=step: trainer.step_done(s))
                rollouter_windows = self.windows["rollouter"]
                records.append(
                    {
                        "timing_s/step": time.monotonic() - step_start,
                        **metrics,
                        **(rollouter_windows[-1][0] if rollouter_windows else {}),
                    }
                )
        finally:
            stop.set()
            worker.join()
        return records


def test_a_two_thread_pipeline_reports_the_waits_its_threads_logged():
    """A real two-thread loop (AsyncLoop): each window's waits lie between the sums of the threads' own readings
    inside and around each wait, and its idle ratio between the ratios those readings and the window's ends bound;
    the rollouter's idle ratio is its waits over its version time. (Read twice, a wait's two readings are as far
    apart as the interpreter or the machine keep a thread from running between two statements.)"""
    loop = AsyncLoop()
    loop.run(12)
    for side in ("trainer", "rollouter"):
        windows, waits = loop.windows[side], loop.waits[side]
        assert len(windows) >= 4 and waits
        for (metrics, close_before, close_after), (_, open_before, open_after) in zip(
            windows[1:], windows, strict=False
        ):
            inside = [w for w in waits if open_before <= w[1] and w[4] <= close_after]
            inner = sum(end - start for _, _, start, end, _ in inside)
            outer = sum(after - before for _, before, _, _, after in inside)
            waited = sum(v for k, v in metrics.items() if k.startswith(f"fully_async/{side}/wait_s/"))
            assert inner <= waited <= outer
            ratio = metrics[f"fully_async/{side}/idle_ratio"]
            assert inner / (close_after - open_before) <= ratio <= outer / (close_before - open_after)
            if side == "rollouter":
                version_time = metrics["fully_async/rollouter/version_time"]
                assert ratio == pytest.approx(waited / version_time)
                assert metrics["fully_async/rollouter/active_time"] == pytest.approx(version_time - waited)
            else:
                assert metrics["fully_async/total_wait_time"] == waited


def test_each_wait_and_window_is_recorded_whole_as_it_ends_and_a_new_run_keeps_the_old_records(tmp_path):
    """The records (rlprof.metrics.pipeline_records) of a trainer's two steps with a wait across their boundary:
    the clock line first, the wait once with its whole span, each window with its step; the wait's part in each window
    is what that window's metrics counted. A new run moves the file aside (kept); a resumed one appends a segment."""
    clock = Clock()
    log = PipelineLog(tmp_path, 3, "trainer", clock=clock)
    trainer = TrainerMeter(clock, record=log.write)
    clock.now = 1.0
    with trainer.waiting("samples"):
        clock.now = 4.0
        first = trainer.step_done(1)
        clock.now = 6.0
    clock.now = 8.0
    second = trainer.step_done(2)
    log.close()
    path = tmp_path / "pipeline" / "rank3.jsonl"
    records = read_jsonl(path)
    assert records[0]["event"] == "clock" and records[0]["rank"] == 3 and records[0]["monotonic"] == 0.0
    assert records[1:] == [
        {"event": "window", "side": "trainer", "began": 0.0, "ended": 4.0, "step": 1},
        {"event": "wait", "side": "trainer", "reason": "samples", "began": 1.0, "ended": 6.0},
        {"event": "window", "side": "trainer", "began": 4.0, "ended": 8.0, "step": 2},
    ]
    assert first["fully_async/trainer/idle_ratio"] == 3.0 / 4.0 and second["fully_async/trainer/idle_ratio"] == 0.5
    PipelineLog(tmp_path, 3, "trainer", resumed=True, clock=clock).close()
    assert [r["event"] for r in read_jsonl(path)] == ["clock", "window", "wait", "window", "clock"]
    with pytest.warns(RuntimeWarning, match="held the records of an earlier run"):
        PipelineLog(tmp_path, 3, "trainer", clock=clock).close()
    assert [r["event"] for r in read_jsonl(path)] == ["clock"]
    (kept,) = (tmp_path / "pipeline" / "previous").glob("rank3.*.jsonl")
    assert len(read_jsonl(kept)) == 5
