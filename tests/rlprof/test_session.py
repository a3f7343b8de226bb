"""The session: step windows, role/rank gating, exceptions, nesting, threads and tool failures,
observed through the real tools' output files."""

from __future__ import annotations

import gzip
import json
import threading
import traceback
import warnings
from pathlib import Path

import pytest

import rlprof
from rlprof.manifest import read_manifest


def torch_config(save_path: Path, steps=None, roles=None, continuous=False, **torch_cfg):
    cfg = {
        "global_profiler": {
            "tool": "torch",
            "steps": steps,
            "profile_continuous_steps": continuous,
            "save_path": str(save_path),
            "global_tool_config": {"torch": torch_cfg},
        }
    }
    cfg.update(roles or {})
    return cfg


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return json.load(handle)["traceEvents"]


def names(path: Path, prefixes=("ProfilerStep", "actor/", "rollout/", "critic/", "ref/", "default/")) -> list[str]:
    return [e["name"] for e in trace_events(path) if e.get("ph") == "X" and e["name"].startswith(prefixes)]


@rlprof.profiled(role="actor")
def update(x):
    return x + 1


def run_steps(steps, body=lambda: update(1)):
    for n in steps:
        with rlprof.step(n):
            body()


def test_each_selected_step_is_a_window_of_its_own_by_default_as_in_verl(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[2, 3, 5]))
    run_steps(range(1, 7))
    rlprof.shutdown()
    assert [m["steps"] for m in read_manifest(tmp_path)] == [[2], [3], [5]]
    assert [m["path"] for m in read_manifest(tmp_path)][:2] == [
        "torch/step2/rank0.pt.trace.json.gz",
        "torch/step3/rank0.pt.trace.json.gz",
    ]


def test_a_process_of_a_pool_says_so_on_each_of_its_manifest_lines(tmp_path):
    """``rlprof.init(pool=...)``: the session line and every file of the process name its pool; without it, none."""
    rlprof.init(torch_config(tmp_path / "pooled", steps=[2]), pool="rollout")
    run_steps(range(1, 3))
    rlprof.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "pooled" / "manifest.jsonl").read_text().splitlines()]
    assert [(line.get("kind"), line["pool"]) for line in lines] == [("session", "rollout"), (None, "rollout")]
    rlprof.init(torch_config(tmp_path / "plain", steps=[2]))
    run_steps(range(1, 3))
    rlprof.shutdown()
    assert all("pool" not in line for line in read_manifest(tmp_path / "plain"))


def test_contiguous_selected_steps_form_one_window_each_with_profile_continuous_steps(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[2, 3, 5], continuous=True))
    run_steps(range(1, 7))
    rlprof.shutdown()
    files = sorted(m["path"] for m in read_manifest(tmp_path))
    assert files == ["torch/step2-3/rank0.pt.trace.json.gz", "torch/step5/rank0.pt.trace.json.gz"]
    assert names(tmp_path / files[0]).count("actor/update") == 2
    assert [n for n in names(tmp_path / files[0]) if n.startswith("ProfilerStep")] == [
        "ProfilerStep#2",
        "ProfilerStep#3",
    ]
    assert [m["steps"] for m in read_manifest(tmp_path)] == [[2, 3], [5]]


def test_window_from_the_tool_config_and_steps_called_without_with(tmp_path):
    rlprof.init(torch_config(tmp_path, step_start=3, step_end=4))
    for n in range(1, 7):
        rlprof.step(n)
        update(1)
    rlprof.shutdown()
    assert [m["path"] for m in read_manifest(tmp_path)] == ["torch/step3-4/rank0.pt.trace.json.gz"]


def test_open_window_is_written_at_shutdown(tmp_path):
    rlprof.init(torch_config(tmp_path, step_start=2))
    run_steps([1, 2, 3, 4])
    assert read_manifest(tmp_path) == []
    rlprof.shutdown()
    assert [m["path"] for m in read_manifest(tmp_path)] == ["torch/step2-4/rank0.pt.trace.json.gz"]


def test_no_tool_records_nothing_and_calls_still_work(tmp_path):
    rlprof.init({"global_profiler": {"tool": None, "save_path": str(tmp_path)}})
    run_steps([1, 2])
    assert update(1) == 2
    rlprof.shutdown()
    assert not (tmp_path / "manifest.jsonl").exists()


def test_without_init_decorators_and_steps_are_pass_through():
    assert rlprof.get_session() is None
    with rlprof.step(1):
        with rlprof.profile_range("x", role="rollout"):
            assert update(41) == 42


def test_declared_roles_are_the_only_ones_recorded(tmp_path):
    @rlprof.profiled(role="rollout", name="generate")
    def generate():
        return update(0)

    rlprof.init(
        torch_config(tmp_path, steps=[1], roles={"actor": {"profiler": {"enable": False}}, "rollout": {"profiler": {}}})
    )
    run_steps([1], generate)
    rlprof.shutdown()
    recorded = names(tmp_path / read_manifest(tmp_path)[0]["path"])
    assert "rollout/generate" in recorded and "actor/update" not in recorded


def test_rank_selection_from_role_blocks(tmp_path):
    roles = {"actor": {"profiler": {"ranks": [1]}}}
    on_rank0 = rlprof.init(torch_config(tmp_path, steps=[1], roles=roles), rank=0, world_size=2)
    assert on_rank0.tool_name is None and not on_rank0.role_enabled("actor")
    on_rank1 = rlprof.init(torch_config(tmp_path, steps=[1], roles=roles), rank=1, world_size=2)
    assert on_rank1.tool_name == "torch" and on_rank1.role_enabled("actor")
    run_steps([1])
    rlprof.shutdown()
    assert [m["path"] for m in read_manifest(tmp_path)] == ["torch/step1/rank1.pt.trace.json.gz"]


def test_rank_outside_the_world_records_nothing_and_says_so_at_init(tmp_path):
    with pytest.warns(RuntimeWarning, match="ranks\\[0\\]: rank 2 is outside the world"):
        rlprof.init(torch_config(tmp_path, roles={"actor": {"profiler": {"ranks": [2]}}}), rank=0, world_size=2)
    run_steps([1])
    rlprof.shutdown()
    assert read_manifest(tmp_path) == []


class Boom(RuntimeError):
    pass


calls = []


@rlprof.profiled(role="actor", name="explode")
def explode():
    calls.append(1)
    raise Boom("bad batch 7")


def test_exception_passes_through_unchanged_function_ran_once_and_ranges_closed(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[1]))
    calls.clear()
    with rlprof.step(1):
        with pytest.raises(Boom, match="^bad batch 7$") as info:
            with rlprof.profile_range("outer", role="rollout"):
                explode()
        update(1)  # the tool still records after the exception
    rlprof.shutdown()
    assert calls == [1]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames[-1] == "explode"  # the traceback ends where the user raised
    recorded = names(tmp_path / read_manifest(tmp_path)[0]["path"])
    assert recorded.count("actor/explode") == 1 and recorded.count("rollout/outer") == 1
    assert "actor/update" in recorded


def test_nesting_keeps_inner_ranges_inside_outer_ones(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[1]))
    with rlprof.step(1):
        with rlprof.profile_range("outer", role="rollout"):
            with rlprof.profile_range("inner", role="rollout"):
                update(1)
    rlprof.shutdown()
    events = {e["name"]: e for e in trace_events(tmp_path / read_manifest(tmp_path)[0]["path"]) if e.get("ph") == "X"}
    outer, inner, leaf = events["rollout/outer"], events["rollout/inner"], events["actor/update"]
    assert outer["ts"] <= inner["ts"] <= leaf["ts"]
    assert leaf["ts"] + leaf["dur"] <= inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_threads_each_record_their_ranges(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[1]))

    def worker():
        for _ in range(25):
            with rlprof.profile_range("worker", role="rollout"):
                update(1)

    with rlprof.step(1):
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    rlprof.shutdown()
    recorded = names(tmp_path / read_manifest(tmp_path)[0]["path"])
    assert recorded.count("rollout/worker") == 100 and recorded.count("actor/update") == 100


def test_async_functions_are_profiled(tmp_path):
    import asyncio

    @rlprof.profiled(role="rollout", name="agenerate")
    async def agenerate(x):
        await asyncio.sleep(0)
        return x * 2

    rlprof.init(torch_config(tmp_path, steps=[1]))
    with rlprof.step(1):
        assert asyncio.run(agenerate(4)) == 8
    rlprof.shutdown()
    assert "rollout/agenerate" in names(tmp_path / read_manifest(tmp_path)[0]["path"])


def test_tool_that_fails_at_run_time_warns_once_and_the_program_goes_on(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[1, 3]))
    (tmp_path / "torch").write_text("a file where the tool wants its folder")  # the write of step 1's trace fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps([1, 2, 3, 4])
        assert update(1) == 2
    rlprof.shutdown()
    failures = [w for w in caught if "failed while writing" in str(w.message)]
    assert len(failures) == 1 and "torch tool" in str(failures[0].message)
    assert rlprof.get_session() is None and read_manifest(tmp_path) == []


def test_unwritable_save_path_turns_the_tool_off_with_one_warning(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="could not start"):
        session = rlprof.init(torch_config(blocker / "sub", steps=[1]))
    assert session.tool_name is None
    run_steps([1])


def test_bad_arguments_fail_at_decoration_or_call_time():
    with pytest.raises(ValueError, match="role=''"):
        rlprof.profiled(role="")
    with pytest.raises(ValueError, match="color='chartreuse-ish'"):
        rlprof.profiled(role="actor", color="chartreuse-ish")
    with pytest.raises(ValueError, match="name=None"):
        rlprof.profile_range(None, role="actor")
    with pytest.raises(ValueError, match="step=-1"):
        rlprof.init({})
        rlprof.step(-1)


def test_torch_contents_turn_on_shapes_and_stacks(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[1], contents=["cpu", "shapes", "stack"]))
    import torch

    @rlprof.profiled(role="actor", name="matmul")
    def matmul():
        return torch.ones(8, 8) @ torch.ones(8, 8)

    run_steps([1], matmul)
    rlprof.shutdown()
    events = trace_events(tmp_path / read_manifest(tmp_path)[0]["path"])
    mm = [e for e in events if e.get("name") == "aten::mm"]
    assert mm and "Input Dims" in mm[0]["args"]
    assert any(e.get("ph") == "X" and e.get("cat") == "python_function" for e in events)


# ---------------------------------------------------------------------------------------------- windows (issue 10)


def test_a_window_records_what_runs_between_its_steps_as_such_and_nothing_after_its_last(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[2, 3], continuous=True))
    for n in range(1, 5):
        with rlprof.step(n):
            update(1)
        with rlprof.profile_range("validate", role="actor"):  # after each step, outside its scope
            pass
    rlprof.shutdown()
    events = [e for e in trace_events(tmp_path / read_manifest(tmp_path)[0]["path"]) if e.get("ph") == "X"]
    by_name = {}
    for e in events:
        by_name.setdefault(e["name"], []).append(e)
    assert len(by_name["actor/update"]) == 2
    (gap,) = by_name["step/between_steps"]  # between steps 2 and 3 only
    (validate,) = by_name["actor/validate"]  # step 2's validation; step 3's ran after the window closed
    assert gap["ts"] <= validate["ts"] and validate["ts"] + validate["dur"] <= gap["ts"] + gap["dur"]
    step3 = next(e for e in events if e["name"] == "ProfilerStep#3")
    assert gap["ts"] + gap["dur"] <= step3["ts"] + 1


def test_seed_block_for_the_actor_alone_also_records_rollout_and_ref_but_not_critic_or_reward(tmp_path):
    seed = {"actor_rollout_ref": {"actor": {"profiler": {"enable": True, "all_ranks": False, "ranks": [0]}}}}
    session = rlprof.init(torch_config(tmp_path, steps=[1], roles=seed))
    assert [session.role_enabled(r) for r in ("actor", "rollout", "ref", "critic", "reward")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    own = {"actor_rollout_ref": {"actor": {"profiler": {"ranks": [0]}}, "rollout": {"profiler": {"enable": False}}}}
    session = rlprof.init(torch_config(tmp_path, steps=[1], roles=own))
    assert session.role_enabled("ref") and not session.role_enabled("rollout")  # a block of its own wins


def test_a_step_number_seen_twice_gets_a_second_file(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[2]))
    run_steps([1, 2, 3, 1, 2, 3])  # e.g. a loop restarted in the same process
    rlprof.shutdown()
    records = read_manifest(tmp_path)
    assert [r["path"] for r in records] == [
        "torch/step2/rank0.pt.trace.json.gz",
        "torch/step2/rank0-2.pt.trace.json.gz",
    ]
    assert [r["window"] for r in records] == [1, 2]
    assert all((tmp_path / r["path"]).stat().st_size == r["bytes"] for r in records)


def test_trace_carries_its_final_name_in_the_gzip_header_and_as_trace_name(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[1]))
    run_steps([1])
    rlprof.shutdown()
    (record,) = read_manifest(tmp_path)
    path = tmp_path / record["path"]
    header = path.read_bytes()[:64]
    assert header[3] & 0x08  # FNAME flag
    assert header[10:].split(b"\0")[0] == b"rank0.pt.trace.json"
    with gzip.open(path, "rt") as handle:
        assert json.load(handle)["traceName"] == str(path)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_is_recording_and_window_listeners_follow_the_windows(tmp_path):
    from rlprof.window import WindowListener

    seen = []

    class Follower(WindowListener):
        def window_started(self, window):
            seen.append(("start", window.first, rlprof.is_recording("rollout")))

        def window_stopped(self, window):
            seen.append(("stop", window.name, rlprof.is_recording("rollout")))

    session = rlprof.init(torch_config(tmp_path, steps=[2, 3, 5], continuous=True))
    session.add_window_listener(Follower())
    recording = []
    for n in range(1, 7):
        with rlprof.step(n):
            recording.append(rlprof.is_recording("rollout"))
    rlprof.shutdown()
    assert recording == [False, True, True, False, True, False]
    assert seen == [("start", 2, True), ("stop", "step2-3", False), ("start", 5, True), ("stop", "step5", False)]


# ---------------------------------------------------------------------------------------------- decorators (issue 11)


def test_generator_functions_record_each_resumption_and_stay_generator_functions(tmp_path):
    import inspect

    @rlprof.profiled(role="rollout", name="stream")
    def stream(n):
        received = []
        for i in range(n):
            received.append((yield i))
        return received

    assert inspect.isgeneratorfunction(stream)
    rlprof.init(torch_config(tmp_path, steps=[1]))
    with rlprof.step(1):
        gen = stream(3)
        assert next(gen) == 0 and gen.send("a") == 1 and gen.send("b") == 2
        with pytest.raises(StopIteration) as stop:
            gen.send("c")
        assert stop.value.value == ["a", "b", "c"]
        assert list(stream(2)) == [0, 1]
    rlprof.shutdown()
    assert names(tmp_path / read_manifest(tmp_path)[0]["path"]).count("rollout/stream") == 4 + 3


def test_generator_sees_what_the_caller_throws_and_closes():
    closed = []

    @rlprof.profiled(role="rollout")
    def guarded():
        try:
            yield 1
        except KeyError:
            yield "caught"
        finally:
            closed.append(True)

    gen = guarded()
    assert next(gen) == 1 and gen.throw(KeyError("x")) == "caught"
    gen.close()
    assert closed == [True]


def test_profiled_above_staticmethod_and_classmethod(tmp_path):
    class Worker:
        @rlprof.profiled(role="actor", name="static")
        @staticmethod
        def static(x):
            return x + 1

        @rlprof.profiled(role="actor", name="klass")
        @classmethod
        def klass(cls, x):
            return (cls.__name__, x)

    rlprof.init(torch_config(tmp_path, steps=[1]))
    with rlprof.step(1):
        assert Worker.static(1) == 2 and Worker().static(2) == 3
        assert Worker.klass(5) == ("Worker", 5)
    rlprof.shutdown()
    recorded = names(tmp_path / read_manifest(tmp_path)[0]["path"])
    assert recorded.count("actor/static") == 2 and recorded.count("actor/klass") == 1


def test_async_generators_are_refused_at_decoration():
    async def agen():
        yield 1

    with pytest.raises(TypeError, match="async generator"):
        rlprof.profiled(role="rollout")(agen)


def test_nsys_without_nsys_attached_says_once_that_nothing_is_captured(tmp_path, monkeypatch):
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    with pytest.warns(RuntimeWarning, match="no Nsight Systems is attached"):
        rlprof.init({"global_profiler": {"tool": "nsys", "save_path": str(tmp_path)}})
    rlprof.shutdown()
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rlprof.init({"global_profiler": {"tool": "nsys", "save_path": str(tmp_path)}})


def test_torch_memory_on_cpu_under_threads_keeps_every_range(tmp_path):
    rlprof.init({"global_profiler": {"tool": "torch_memory", "steps": [1], "save_path": str(tmp_path)}})

    def worker():
        for _ in range(50):
            with rlprof.profile_range("worker", role="rollout"):
                pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rlprof.step(1):
            threads = [threading.Thread(target=worker) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        rlprof.shutdown()
    assert not [w for w in caught if "failed" in str(w.message)]
    records = read_manifest(tmp_path)
    assert len(records) == 2  # RSS per range and the host allocation timeline
    (rss,) = [r for r in records if r["path"].endswith(".host_memory.jsonl")]
    lines = [json.loads(line) for line in (tmp_path / rss["path"]).read_text().splitlines()]
    assert sum(1 for r in lines if r.get("name") == "worker") == 200


def test_a_second_init_over_a_running_session_warns_and_writes_the_first_sessions_window(tmp_path):
    import warnings

    rlprof.init(torch_config(tmp_path / "first", steps=[1]))
    with rlprof.step(1):
        update(1)
        with pytest.warns(RuntimeWarning, match="a session is already running in this process; it is shut down"):
            rlprof.init(torch_config(tmp_path / "second", steps=[1]))
    assert [m["steps"] for m in read_manifest(tmp_path / "first")] == [[1]]  # the open window was written
    rlprof.shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rlprof.init(torch_config(tmp_path / "third", steps=[1]))  # after shutdown: silent


def test_an_empty_step_list_warns_that_nothing_will_be_recorded(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"global_profiler.steps=\[\] selects no step: torch records nothing"):
        rlprof.init(torch_config(tmp_path, steps=[]))
    run_steps([1, 2])
    rlprof.shutdown()
    assert read_manifest(tmp_path) == []


def test_temporary_files_a_killed_export_left_are_removed_by_the_next_init(tmp_path):
    """A SIGKILL during a trace export leaves ``.name.HOST-PID.tmp`` (and kineto's own ``.tmp``); the next session
    on the save path removes those of this host whose process is gone, and keeps a live process's and another
    host's."""
    import os
    import subprocess
    import sys

    from rlprof.tools.base import _HOST

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    folder = tmp_path / "torch" / "step2"
    folder.mkdir(parents=True)
    left = [
        folder / f".rank0.pt.trace.json.{_HOST}-{dead_pid}.tmp",
        folder / f".rank0.pt.trace.json.{_HOST}-{dead_pid}.tmp.tmp",
    ]
    kept = [folder / f".rank1.pt.trace.json.{_HOST}-{os.getpid()}.tmp", folder / ".rank2.pt.trace.json.other-1.tmp"]
    for path in left + kept:
        path.write_bytes(b"x" * 4096)
    with pytest.warns(RuntimeWarning, match=r"removed 2 temporary files \(0\.0 MiB\) that killed processes left"):
        rlprof.init(torch_config(tmp_path, steps=[1]))
    assert [p.exists() for p in left] == [False, False] and [p.exists() for p in kept] == [True, True]


def test_a_step_begun_inside_a_with_step_block_is_an_error_and_the_outer_step_keeps_its_ranges(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[2]))
    with rlprof.step(2):
        with pytest.raises(ValueError, match=r"rlprof.step\(3\) inside `with rlprof.step\(2\):`: steps do not nest"):
            rlprof.step(3)
        assert rlprof.get_session().current_step == 2 and rlprof.get_session().step_open  # step 2 goes on
    run_steps([3, 4])  # after the block, steps begin as usual
    rlprof.shutdown()
    assert [m["steps"] for m in read_manifest(tmp_path)] == [[2]]


def test_steps_from_a_second_thread_are_refused_while_ranges_from_any_thread_are_counted(tmp_path):
    """Issue 27: ``with rlprof.step(n)`` from several threads used to turn ``range_times`` off (the range between
    steps began on one thread and ended on another) and was refused as "nesting". Now steps begin on one thread
    (another takes over once it has ended), ranges run on any thread and all are counted."""
    session = rlprof.init(
        {
            "global_profiler": {
                "tool": "range_times",
                "steps": list(range(1, 31)),
                "profile_continuous_steps": True,
                "save_path": str(tmp_path),
            }
        }
    )
    errors: list[str] = []

    def ranges(k: int) -> None:
        for _ in range(50):
            with rlprof.profile_range("work", role="actor"):
                pass

    def loop(steps) -> None:
        try:
            for n in steps:
                with rlprof.step(n):
                    workers = [threading.Thread(target=ranges, args=(k,)) for k in range(4)]
                    for worker in workers:
                        worker.start()
                    for worker in workers:
                        worker.join()
        except ValueError as exc:
            errors.append(str(exc))

    first = threading.Thread(target=loop, args=(range(1, 11),), name="loop")
    first.start()
    while session.step_thread is None:
        pass
    second = threading.Thread(target=loop, args=(range(11, 21),), name="intruder")
    second.start()
    second.join()
    first.join()
    assert errors == [
        "rlprof.step(11) on thread 'intruder': this session's steps are begun on thread 'loop'; call rlprof.step "
        "from one thread (the training loop); ranges may run on any thread"
    ]
    loop(range(21, 31))  # the loop's thread has ended: the main thread takes over, its between-steps range dropped
    assert session.tool_name == "range_times" and errors == [errors[0]]
    taken = session.tool.take()
    assert taken["ranges"]["actor/work"]["count"] == 20 * 4 * 50
    assert taken["ranges"]["step/between_steps"]["count"] == 9 + 9  # each thread's, ended on that thread
    rlprof.shutdown()


@pytest.mark.parametrize("tool", ["torch", "torch_memory"])
def test_a_windows_profiler_results_are_freed_when_it_ends_not_at_pythons_next_full_collection(
    tool, tmp_path, monkeypatch
):
    """torch.profiler.profile holds itself in a reference cycle, so what it recorded (torch's native event tree of the
    window) stayed until Python's full collection, which in a process holding torch runs once every many windows:
    resident memory grew per window (issue 27: +11.4 MiB over 400 windows of the library loop, +23 to +29 MiB over
    8 torch windows of the trainer). Checked with the collector off: each window's results are gone when it ends."""
    import gc
    import weakref

    import torch

    results: list[weakref.ref] = []

    class Watched(torch.profiler.profile):
        def start(self) -> None:
            super().start()
            results.append(weakref.ref(self.profiler))

    monkeypatch.setattr(torch.profiler, "profile", Watched)
    rlprof.init({"global_profiler": {"tool": tool, "steps": [1, 2], "save_path": str(tmp_path)}})
    gc.disable()
    try:
        for n in (1, 2, 3):
            with rlprof.step(n), rlprof.profile_range("work", role="actor"):
                torch.randn(64, 64).softmax(-1).sum()
        rlprof.shutdown()
        assert len(results) == 2 and [ref() for ref in results] == [None, None]
    finally:
        gc.enable()
    assert len({record["window"] for record in read_manifest(tmp_path)}) == 2  # both windows written
