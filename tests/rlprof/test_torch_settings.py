"""verl's per-role torch settings, honoured: a schedule over update mini-batches, discrete traces, and what must
agree when one torch profiler runs per process. The kept mini-batches are checked against torch's own schedule
function (``torch.profiler.schedule``) walked by hand, not against rlprof's naming of them."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerAction

import rlprof
from rlprof.manifest import read_manifest

MINI_BATCHES = 4


def annotations(path: Path) -> set[str]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return {e["name"] for e in events if e.get("cat") == "user_annotation"}


def run_loop(save_path: Path, config: dict, steps: tuple[int, ...] = (1,)) -> None:
    """A step: a rollout range, then an update range of MINI_BATCHES mini-batches of the actor, then an
    ``after`` range; each selected step is its own window."""
    rlprof.init({"global_profiler": {"tool": "torch", "steps": list(steps), "save_path": str(save_path)}} | config)
    try:
        for step in steps:
            with rlprof.step(step):
                with rlprof.profile_range("generate", role="rollout"):
                    torch.randn(64, 64) @ torch.randn(64, 64)
                with rlprof.profile_range("update", role="actor"):
                    for i in range(MINI_BATCHES):
                        with rlprof.mini_batch(i, role="actor"):
                            torch.randn(32, 32).sum()
                with rlprof.profile_range("after", role="actor"):
                    torch.randn(8).sum()
    finally:
        rlprof.shutdown()


def expected_cycles(schedule: dict) -> list[set[int]]:
    """The mini-batches of each saved trace, walking torch's schedule function over the window's mini-batches: a
    trace is written when a mini-batch in RECORD_AND_SAVE ends, and at the window's end while recording."""
    walk = torch.profiler.schedule(
        skip_first=schedule.get("skip_first", 0),
        wait=schedule.get("wait", 0),
        warmup=schedule.get("warmup", 0),
        active=schedule["active"],
        repeat=schedule.get("repeat", 0) or 1,
    )
    cycles: list[set[int]] = []
    kept: set[int] = set()
    for i in range(MINI_BATCHES):
        action = walk(i)
        if action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            kept.add(i)
        if action is ProfilerAction.RECORD_AND_SAVE:
            cycles.append(kept)
            kept = set()
    if walk(MINI_BATCHES) in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
        cycles.append(kept)  # the window ended mid-cycle: what it recorded is kept (verl flushes it)
    return cycles


SCHEDULES = [
    {"active": 1},  # verl's advice: every earlier stage in full plus the first mini-batch
    {"active": 2},
    {"skip_first": 1, "active": 1},  # the second mini-batch alone
    {"wait": 1, "active": 1, "repeat": 2},
    {"warmup": 1, "active": 2},
    {"skip_first": 3, "active": 2},  # the window ends inside the cycle
    {"active": 3, "repeat": 3},
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_a_roles_schedule_keeps_the_mini_batches_torchs_schedule_selects(tmp_path, schedule):
    run_loop(tmp_path, {"actor": {"profiler": {"tool_config": {"torch": {"schedule": schedule}}}}})
    records = read_manifest(tmp_path)
    traces = [tmp_path / r["path"] for r in records if r["tool"] == "torch"]
    kept = [{int(n.removeprefix("actor/mini_batch")) for n in annotations(p) if "mini_batch" in n} for p in traces]
    assert kept == expected_cycles(schedule), [p.name for p in traces]
    for path, mini_batches in zip(traces, kept, strict=True):
        held = annotations(path)
        assert not any(n.startswith("ProfilerStep#") for n in held)  # a schedule's steps are mini-batches (verl)
        # recording starts at the window's start: what ran before the first kept mini-batch is there only when
        # nothing was skipped (torch keeps a trace that ends in a saved cycle)
        skipped = schedule.get("skip_first", 0) + schedule.get("wait", 0) + schedule.get("warmup", 0)
        assert ("rollout/generate" in held) == (path == traces[0] and skipped == 0), (path.name, held)
        if mini_batches:
            first, last = min(mini_batches), max(mini_batches)
            assert path.name.startswith(f"rank0.mb{first}" + (f"-{last}" if last > first else "") + ".pt.trace")


def test_without_a_schedule_and_on_roles_without_one_the_window_is_whole(tmp_path):
    # the critic's schedule is walked by the critic's mini-batches only: the actor's leave the trace whole (with no
    # step spans: the process's profiler runs the schedule)
    critic = {"tool_config": {"torch": {"schedule": {"active": 1}}}}
    run_loop(tmp_path / "none", {})
    run_loop(tmp_path / "critic", {"actor": {"profiler": {"enable": True}}, "critic": {"profiler": critic}})
    for folder in ("none", "critic"):
        (trace,) = [tmp_path / folder / r["path"] for r in read_manifest(tmp_path / folder)]
        held = annotations(trace)
        assert trace.name == "rank0.pt.trace.json.gz" and ("ProfilerStep#1" in held) == (folder == "none")
        assert {f"actor/mini_batch{i}" for i in range(MINI_BATCHES)} | {"rollout/generate", "actor/after"} <= held


def test_the_global_schedule_applies_to_every_role_and_each_window_walks_its_own(tmp_path):
    schedule = {"skip_first": 1, "active": 1}
    rlprof.init(
        {
            "global_profiler": {
                "tool": "torch",
                "steps": [1, 3],
                "save_path": str(tmp_path),
                "global_tool_config": {"torch": {"schedule": schedule}},
            }
        }
    )
    try:
        for step in (1, 2, 3):
            with rlprof.step(step):
                for i in range(3):
                    with rlprof.mini_batch(i, role="critic"):
                        torch.randn(4).sum()
    finally:
        rlprof.shutdown()
    traces = sorted((r["steps"], tmp_path / r["path"]) for r in read_manifest(tmp_path))
    assert [(steps, p.parent.name, p.name) for steps, p in traces] == [
        ([1], "step1", "rank0.mb1.pt.trace.json.gz"),
        ([3], "step3", "rank0.mb1.pt.trace.json.gz"),
    ]
    assert all("critic/mini_batch1" in annotations(p) and "critic/mini_batch0" not in annotations(p) for _, p in traces)


def test_discrete_gives_each_outermost_range_its_own_trace_with_what_ran_inside_it(tmp_path):
    run_loop(tmp_path, {"actor": {"profiler": {"tool_config": {"torch": {"discrete": True}}}}}, steps=(1, 2))
    traces = {
        (tuple(r["steps"]), Path(r["path"]).name, r["role"]): tmp_path / r["path"] for r in read_manifest(tmp_path)
    }
    names = {
        ("rank0.rollout.generate.pt.trace.json.gz", "rollout"),
        ("rank0.actor.update.pt.trace.json.gz", "actor"),
        ("rank0.actor.after.pt.trace.json.gz", "actor"),
    }
    assert set(traces) == {((step,), name, role) for step in (1, 2) for name, role in names}
    update = annotations(traces[((1,), "rank0.actor.update.pt.trace.json.gz", "actor")])
    assert update == {"actor/update"} | {f"actor/mini_batch{i}" for i in range(MINI_BATCHES)}
    assert annotations(traces[((2,), "rank0.rollout.generate.pt.trace.json.gz", "rollout")]) == {"rollout/generate"}


def test_a_roles_own_discrete_traces_its_ranges_inside_a_range_of_a_role_that_is_not(tmp_path):
    # verl's actor worker with discrete=True: its stages are traces of their own; the driver's step (here a range
    # of role "trainer") starts none, and the rollout's range outside them is not in any
    discrete = {"profiler": {"tool_config": {"torch": {"discrete": True}}}}
    config = {"trainer": {"profiler": {"enable": True}}, "rollout": {"profiler": {"enable": True}}, "actor": discrete}
    rlprof.init({"global_profiler": {"tool": "torch", "steps": [1], "save_path": str(tmp_path)}} | config)
    try:
        with rlprof.step(1), rlprof.profile_range("step", role="trainer"):
            with rlprof.profile_range("gen", role="rollout"):
                torch.randn(8).sum()
            for phase in ("old_log_prob", "update_actor"):
                with rlprof.profile_range(phase, role="actor"), rlprof.profile_range("inner", role="rollout"):
                    torch.randn(8).sum()
    finally:
        rlprof.shutdown()
    traces = {Path(r["path"]).name: annotations(tmp_path / r["path"]) for r in read_manifest(tmp_path)}
    assert traces == {
        "rank0.actor.old_log_prob.pt.trace.json.gz": {"actor/old_log_prob", "rollout/inner"},
        "rank0.actor.update_actor.pt.trace.json.gz": {"actor/update_actor", "rollout/inner"},
    }


def test_discrete_a_range_on_another_thread_inside_an_open_one_is_in_its_trace(tmp_path):
    def score() -> None:
        with rlprof.profile_range("score", role="reward"):
            torch.randn(16).sum()

    config = {"tool": "torch", "steps": [1], "save_path": str(tmp_path)}
    rlprof.init({"global_profiler": config | {"global_tool_config": {"torch": {"discrete": True}}}})
    try:
        with rlprof.step(1):
            with rlprof.profile_range("generate", role="rollout"):
                worker = threading.Thread(target=score)
                worker.start()
                worker.join()
    finally:
        rlprof.shutdown()
    (record,) = read_manifest(tmp_path)
    assert Path(record["path"]).name == "rank0.rollout.generate.pt.trace.json.gz"
    assert annotations(tmp_path / record["path"]) == {"rollout/generate", "reward/score"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {
                "actor": {"profiler": {"tool_config": {"torch": {"schedule": {"active": 1}}}}},
                "critic": {"profiler": {"tool_config": {"torch": {"schedule": {"active": 2}}}}},
            },
            "torch schedules differ",
        ),
        (
            {"actor": {"profiler": {"tool_config": {"torch": {"schedule": {"active": 1}, "discrete": True}}}}},
            "the actor role's profiler.tool_config.torch.schedule: a schedule over mini-batches with discrete",
        ),
        (
            {"rollout": {"profiler": {"tool_config": {"torch": {"profile_token_start": 4, "profile_token_end": 4}}}}},
            "the rollout role's profiler.tool_config.torch.profile_token_end: 4 is not after profile_token_start=4",
        ),
        (
            {"actor": {"profiler": {"tool_config": {"torch": {"schedule": {"active": -1}}}}}},
            r"actor.profiler.tool_config.torch.schedule.active: -1 is out of range; allowed: a number >= 0",
        ),
        (
            {"rollout": {"profiler": {"tool_config": {"torch": {"profile_token_start": -2}}}}},
            r"rollout.profiler.tool_config.torch.profile_token_start: -2 is out of range",
        ),
    ],
)
def test_settings_that_one_profiler_per_process_cannot_honour_are_one_error(tmp_path, config, message):
    active = {"tool": "torch", "steps": [1], "save_path": str(tmp_path)}
    config = config | {"global_profiler": active | config.get("global_profiler", {})}
    with pytest.raises(rlprof.ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        rlprof.init(config)


def test_a_mini_batch_index_is_checked():
    with pytest.raises(ValueError, match="mini_batch: index=-1 must be an integer >= 0"):
        with rlprof.mini_batch(-1):
            pass


def test_a_roles_setting_for_another_tool_is_checked_but_not_applied(tmp_path):
    # verl's role blocks list every tool's settings: nsys' discrete does not make the torch tool's traces discrete
    both = {"nsys": {"discrete": True}, "torch": {"discrete": False}}
    run_loop(tmp_path, {"actor": {"profiler": {"tool_config": both}}})
    assert [Path(r["path"]).name for r in read_manifest(tmp_path)] == ["rank0.pt.trace.json.gz"]
    with pytest.raises(rlprof.ConfigError, match="nsys.discrete: 'maybe' is not allowed"):
        run_loop(tmp_path, {"actor": {"profiler": {"tool_config": {"nsys": {"discrete": "maybe"}}}}})
