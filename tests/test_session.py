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


def torch_config(save_path: Path, steps=None, roles=None, **torch_cfg):
    cfg = {"global_profiler": {"tool": "torch", "steps": steps, "save_path": str(save_path),
                               "global_tool_config": {"torch": torch_cfg}}}
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


def test_contiguous_selected_steps_form_one_window_each(tmp_path):
    rlprof.init(torch_config(tmp_path, steps=[2, 3, 5]))
    run_steps(range(1, 7))
    rlprof.shutdown()
    files = sorted(m["path"] for m in read_manifest(tmp_path))
    assert files == ["torch/step2-3/rank0.pt.trace.json.gz", "torch/step5/rank0.pt.trace.json.gz"]
    assert names(tmp_path / files[0]).count("actor/update") == 2
    assert [n for n in names(tmp_path / files[0]) if n.startswith("ProfilerStep")] == ["ProfilerStep#2", "ProfilerStep#3"]
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

    rlprof.init(torch_config(tmp_path, steps=[1], roles={"actor": {"profiler": {"enable": False}},
                                                        "rollout": {"profiler": {}}}))
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


def test_rank_outside_the_world_fails_at_init(tmp_path):
    with pytest.raises(rlprof.ConfigError, match="ranks\\[0\\].*rank 2.*world_size=2"):
        rlprof.init(torch_config(tmp_path, roles={"actor": {"profiler": {"ranks": [2]}}}), rank=0, world_size=2)


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
