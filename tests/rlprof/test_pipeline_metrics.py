"""An asynchronous pipeline's metrics (rlprof.metrics.pipeline) under verl's names: staleness, spans and partial
rollouts as verl v1's and fully-async trainer's formulas give them, computed here independently; the rollouter's idle
ratio over every wait of its window (verl #6693 counts the last one); and a real two-thread pipeline whose ratios
equal the count of its own logged waits."""

from __future__ import annotations

import queue
import random
import threading
import time

import numpy as np
import pytest

from rlprof.metrics.pipeline import PipelineSide, RolloutMeter, TrainerMeter, TrajectoryRecord


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


def test_a_two_thread_pipeline_reports_the_waits_its_threads_logged():
    """A rollouter thread generating into a bounded queue (pausing while it is full and for each sync) and a
    trainer thread taking batches of 4 (waiting for samples, publishing weights every 2 updates): every idle ratio
    equals the one computed from the waits each thread logged itself, with time.monotonic around each."""
    rollouter, trainer = RolloutMeter(), TrainerMeter()
    samples: queue.Queue[TrajectoryRecord] = queue.Queue(maxsize=6)
    version = [0]
    sync = threading.Lock()  # held by the trainer while it publishes: the rollouter waits for weights
    logged: dict[str, list[tuple[str, float, float]]] = {"rollouter": [], "trainer": []}
    stop = threading.Event()
    windows: list[tuple[dict[str, float], float, float]] = []

    def timed(side: str, meter, reason: str, action):
        start = time.monotonic()
        with meter.waiting(reason):
            result = action()
        logged[side].append((reason, start, time.monotonic()))
        return result

    def generate() -> None:
        window_start = time.monotonic()
        while not stop.is_set():
            started, first = time.monotonic(), version[0]
            time.sleep(0.004)  # generating
            record = TrajectoryRecord(started, first, version[0], time.monotonic() - started)
            rollouter.finished()
            while not stop.is_set():
                try:
                    if samples.full():
                        timed("rollouter", rollouter, "queue_full", lambda r=record: samples.put(r, timeout=0.05))
                    else:
                        samples.put_nowait(record)
                    break
                except queue.Full:
                    continue
            if sync.locked():
                timed("rollouter", rollouter, "weights", lambda: (sync.acquire(), sync.release()))
                end = time.monotonic()
                windows.append((rollouter.synced(version[0]), window_start, end))
                window_start = end

    worker = threading.Thread(target=generate)
    worker.start()
    trainer_windows = []
    try:
        for step in range(1, 13):
            step_start = time.monotonic()
            batch = [timed("trainer", trainer, "samples", samples.get) for _ in range(4)]
            trainer.consumed(batch)
            time.sleep(0.012 if step % 3 else 0.002)  # updating: sometimes slower than generation, sometimes not
            if step % 2 == 0:
                with sync:
                    version[0] += 1
                    trainer.synced()
                    time.sleep(0.005)
            trainer_windows.append((trainer.step_done(), step_start, time.monotonic()))
    finally:
        stop.set()
        worker.join()
    for metrics, start, end in trainer_windows[1:]:  # the first window opened when the meter was made
        waited = sum(min(e, end) - max(s, start) for _, s, e in logged["trainer"] if s < end and e > start)
        assert metrics["fully_async/trainer/idle_ratio"] == pytest.approx(waited / (end - start), abs=0.02)
    assert len(windows) >= 4
    for metrics, start, end in windows[1:]:
        waited = sum(min(e, end) - max(s, start) for _, s, e in logged["rollouter"] if s < end and e > start)
        assert metrics["fully_async/rollouter/idle_ratio"] == pytest.approx(waited / (end - start), abs=0.02)
        assert metrics["fully_async/rollouter/wait_s/weights"] > 0
