"""CUDA snapshots as a user has them, read by ``rlprof memory`` and ``rlprof report``: the bytes a range's backward
allocates on autograd's thread (no metadata, no Python stack) owned by that range, an OOM told first with what to
try, every device of a snapshot, torch 2.0's format, and sites that are never native frames.

The snapshots are built here in torch's own format (torch's ``_memory_viz`` reads each), as a GPU records them: the
main thread's allocations tagged with the range and its stack, the backward's with neither, the ranges' starts and
ends as ``external_annotations``; the numbers are checked against a replay by hand. torch 2.0's format is checked on
a snapshot published by FlexGen's authors (``tests/data/snapshots``, Apache-2.0)."""

from __future__ import annotations

import json
import lzma
import pickle

import pytest
import yaml
from torch.cuda import _memory_viz

from rlprof.analysis.allocations import summarize
from rlprof.analysis.sources import read_histories
from rlprof.analysis.sources.cuda_snapshot import AUTOGRAD_ENGINE, NO_PYTHON_STACK, NO_USER_FRAME
from rlprof.cli import main

from conftest import ROOT


def frames(function: str, line: int) -> list[dict]:
    return [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
        {"filename": "/home/me/rl/train.py", "line": line, "name": function},
        {"filename": "/home/me/rl/main.py", "line": 9, "name": "main"},
    ]


class Recorder:
    """Records a snapshot in torch's format: one segment per device, allocations at rising addresses; ``segment_alloc``
    events for each segment, the blocks alive at the end tiling it with free blocks between them."""

    SEGMENT = 64 << 30

    def __init__(self, devices: int = 1) -> None:
        self.time = 1_700_000_000_000_000  # µs since the epoch, as torch's allocator clock
        self.traces: list[list[dict]] = [[] for _ in range(devices)]
        self.annotations: list[dict] = []
        self.next = [(d + 1) << 40 for d in range(devices)]
        self.live: dict[int, tuple[int, int, dict]] = {}  # addr -> (device, size, event)
        for device in range(devices):
            self._event(device, {"action": "segment_alloc", "addr": self.next[device], "size": self.SEGMENT})

    def _event(self, device: int, event: dict) -> dict:
        self.time += 10
        event.setdefault("stream", 0)
        event["time_us"] = self.time
        self.traces[device].append(event)
        return event

    def alloc(self, size: int, tag: str = "", stack: list | None = None, device: int = 0) -> int:
        addr = self.next[device]
        self.next[device] += size
        event = {"action": "alloc", "addr": addr, "size": size, "frames": stack or [], "user_metadata": tag}
        self.live[addr] = (device, size, self._event(device, event))
        return addr

    def free(self, addr: int) -> None:
        device, size, _ = self.live.pop(addr)
        for action in ("free_requested", "free_completed"):
            self._event(device, {"action": action, "addr": addr, "size": size, "frames": []})

    def oom(self, size: int, free: int, tag: str = "", stack: list | None = None, device: int = 0) -> None:
        event = {"action": "oom", "device_free": free, "size": size, "frames": stack or [], "user_metadata": tag}
        self._event(device, event)

    def range(self, stage: str, name: str, device: int = 0) -> None:
        self.time += 10
        self.annotations.append({"stage": stage, "name": name, "device": device, "time_us": self.time})

    def snapshot(self) -> dict:
        segments = []
        for device in range(len(self.traces)):
            base, blocks, at = (device + 1) << 40, [], (device + 1) << 40
            for addr, (on, size, event) in sorted(self.live.items()):
                if on != device:
                    continue
                if addr > at:
                    blocks.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive"})
                state = {"address": addr, "size": size, "requested_size": size, "state": "active_allocated"}
                blocks.append({**state, "frames": event["frames"]})
                at = addr + size
            blocks.append({"address": at, "size": base + self.SEGMENT - at, "requested_size": 0, "state": "inactive"})
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            segment = {"device": device, "address": base, "total_size": self.SEGMENT, "stream": 0, "blocks": blocks}
            segments.append({**segment, "allocated_size": allocated, "active_size": allocated, "segment_type": "large"})
        return {"segments": segments, "device_traces": self.traces, "external_annotations": self.annotations}


def an_update_with_its_backward() -> tuple[Recorder, dict[str, int]]:
    """Parameters, then ``actor/update_actor``: the forward's activations (tagged, with stacks), the backward's
    gradients and temporaries (on autograd's thread: no tag, no stack), the activations freed, a tagged optimizer
    state; after the range, a stackless allocation of another thread outside every range."""
    record = Recorder()
    record.alloc(1000, stack=frames("load_params", 5))
    record.range("START", "actor/update_actor")
    activations = [record.alloc(4000, "actor/update_actor", frames("forward", 20)) for _ in range(2)]
    backward = [record.alloc(3000) for _ in range(3)]  # the peak: 1000 + 2 x 4000 + 3 x 3000
    for addr in activations:
        record.free(addr)
    record.alloc(500, "actor/update_actor", frames("optimizer_step", 30))
    record.range("END", "actor/update_actor")
    record.free(backward[0])
    record.alloc(200)  # a data loader's thread, outside every range
    return record, {"peak": 18000, "update_at_peak": 17000, "backward_at_peak": 9000}


@pytest.mark.parametrize("annotated", [True, False], ids=["range starts and ends recorded", "older snapshot"])
def test_a_ranges_backward_belongs_to_the_range(tmp_path, capsys, annotated):
    record, expected = an_update_with_its_backward()
    snapshot = record.snapshot()
    _memory_viz.segsum(snapshot)  # torch's own readers accept it
    assert _memory_viz.trace_plot(snapshot)
    if not annotated:
        del snapshot["external_annotations"]
    path = tmp_path / "rank0_pid1.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    (summary,) = [summarize(h) for h in read_histories(path)]
    assert summary.peak_bytes == expected["peak"]
    owned = summary.by_tag["actor/update_actor"]
    assert abs(owned - expected["update_at_peak"]) <= 0.01 * expected["update_at_peak"]
    assert summary.by_role["actor"] == owned and summary.by_tag[""] == 1000  # the parameters, outside
    backward = [s for s in summary.top_sites if s.site == NO_PYTHON_STACK]
    assert backward == [type(backward[0])(NO_PYTHON_STACK, "actor/update_actor", expected["backward_at_peak"], 3)]
    if annotated:  # the other thread's allocation after the range is nobody's
        assert summarize(read_histories(path)[0]).by_tag.get("", 0) == 1000
        assert read_histories(path)[0].events[-1].allocation.tag == ""

    # the report's memory per role: the same ownership
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / path.name).write_bytes(path.read_bytes())
    assert main(["report", str(folder), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (timeline,) = report["memory"]["timelines"]
    assert timeline["by_role"]["actor"] == owned


def test_a_ranges_backward_belongs_to_it_when_the_annotations_hold_only_torchs_own_ranges(tmp_path):
    """The allocations carry rlprof's range, the annotations only what torch writes itself (the optimizer's
    ``Optimizer.step#AdamW.step``, after the backward): the backward's stackless allocations, between two of the
    range's, are the range's, as in a snapshot without annotations; the optimizer's ranges own nothing."""
    record, expected = an_update_with_its_backward()
    snapshot = record.snapshot()
    snapshot["external_annotations"] = [  # torch's own range only, around the optimizer's allocation
        {**mark, "name": "Optimizer.step#AdamW.step"} for mark in snapshot["external_annotations"]
    ]
    path = tmp_path / "rank0_pid1.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    (summary,) = [summarize(h) for h in read_histories(path)]
    backward = [s for s in summary.top_sites if s.site == NO_PYTHON_STACK]
    assert backward == [type(backward[0])(NO_PYTHON_STACK, "actor/update_actor", expected["backward_at_peak"], 3)]
    assert summary.by_tag["actor/update_actor"] == expected["update_at_peak"]
    assert "Optimizer.step#AdamW.step" not in summary.by_tag


def an_oom_in_the_backward(devices: int = 1, failing: int = 0) -> Recorder:
    """A micro-batch's forward and backward on ``failing``: the backward's allocation (no tag, no stack) fails; the
    other devices allocate a little."""
    record = Recorder(devices)
    for device in range(devices):
        record.alloc(2 << 30 if device == failing else 1 << 20, stack=frames("load_params", 5), device=device)
    record.range("START", "actor/update_actor", failing)
    record.range("START", "actor/micro_batch_forward_backward", failing)
    record.alloc(3 << 30, "actor/micro_batch_forward_backward", frames("forward", 20), failing)
    record.alloc(1 << 30, "actor/micro_batch_forward_backward", frames("entropy_from_logits", 44), failing)
    record.alloc(2 << 30, device=failing)  # the backward
    record.oom(8 << 30, free=1 << 30, device=failing)
    return record


def test_an_oom_leads_with_the_request_the_free_bytes_the_range_the_holders_and_what_to_try(tmp_path, capsys):
    snapshot = an_oom_in_the_backward().snapshot()
    snapshot["rlprof"] = {"devices": {0: {"name": "NVIDIA H200", "total_memory": 150 << 30}}}
    path = tmp_path / "rank0_pid7.pickle"  # an ordinary window's name: the oom action tells
    path.write_bytes(pickle.dumps(snapshot))
    assert main(["memory", str(path), "--format", "md"]) == 0
    text = capsys.readouterr().out
    head = text[: text.index("Live at the failure per role")]
    for fragment in (
        "cuda:0 ran out of memory",
        "8.000 GiB requested in actor/micro_batch_forward_backward",
        "1.000 GiB free of 150.000 GiB",
        "alive then: 8.000 GiB allocated",
    ):
        assert fragment in head, (fragment, text[:1500])
    assert text.index("Out of memory") < text.index("Top allocation sites alive at the peak")  # the failure first
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=true" in text
    assert "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true" in text

    assert main(["memory", str(path), "--format", "json"]) == 0
    (device,) = json.loads(capsys.readouterr().out)["devices"]
    moment = device["summary"]["oom"]
    assert moment["failure"]["requested"] == 8 << 30 and moment["failure"]["device_free"] == 1 << 30
    assert moment["failure"]["tag"] == "actor/micro_batch_forward_backward"  # by time: the backward has none
    assert moment["by_role"] == {"actor": 6 << 30, "": 2 << 30}
    assert moment["largest"][0]["bytes"] == 3 << 30 and "train.py:20 forward" in moment["largest"][0]["site"]
    assert moment["reserved_unallocated"] == (64 << 30) - (8 << 30)  # one 64 GiB segment, 8 GiB of it allocated
    fixes = [f["override"] for f in device["remedies"]]
    assert fixes[0] in (  # what the failing pass's own 6 GiB are lowered by comes before the entropy's 1 GiB
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.model.enable_activation_offload=true",
    )
    assert [f["bytes"] for f in device["remedies"]] == sorted((f["bytes"] for f in device["remedies"]), reverse=True)

    page = tmp_path / "oom.html"
    assert main(["memory", str(path), "--html", str(page)]) == 0
    assert "ran out of memory" in page.read_text()


def test_a_run_with_an_oom_reports_it_first_and_offers_only_what_is_not_on(tmp_path, capsys):
    import jsonschema

    from rlprof.analysis.render.jsonout import schema

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "rank0_pid7.pickle").write_bytes(pickle.dumps(an_oom_in_the_backward().snapshot()))
    (folder / "run.json").write_text('{"run_id": "oom"}')  # a trainer's log folder: its config.yaml is read
    (folder / "config.yaml").write_text(
        "actor_rollout_ref:\n  model: {enable_gradient_checkpointing: true}\n"
        "  actor: {ppo_micro_batch_size_per_gpu: 8, use_dynamic_bsz: false, zero_stage: 0}\n"
    )
    assert main(["report", str(folder), "--format", "md"]) == 0
    text = capsys.readouterr().out
    assert text.index("Out of memory") < text.index("run: ")  # the failure leads the report
    assert main(["report", str(folder), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    jsonschema.validate(report, schema())
    fixes = [f["override"] for f in report["memory"]["remedies"]]
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4" in fixes
    assert "actor_rollout_ref.actor.zero_stage=1 actor_rollout_ref.actor.offload_optimizer=true" in fixes
    assert not any("enable_gradient_checkpointing" in fix for fix in fixes)  # already on
    finding = next(f for f in report["findings"] if f["rule"] == "memory-bound")
    assert finding["message"].startswith("out of memory: cuda:0 could not allocate 8.00 GiB in actor/")
    assert finding["overrides"] == fixes


def test_every_device_is_read_the_failing_one_first(tmp_path, capsys):
    path = tmp_path / "three.pickle"
    path.write_bytes(pickle.dumps(an_oom_in_the_backward(devices=3, failing=1).snapshot()))
    histories = read_histories(path)
    assert [h.device for h in histories] == ["cuda:1", "cuda:0", "cuda:2"]
    assert histories[0].oom is not None and all(h.oom is None for h in histories[1:])
    assert main(["memory", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.index("Out of memory (cuda:1)") < text.index("Memory (cuda:0)") < text.index("Memory (cuda:2)")


def test_native_frames_are_never_a_site(tmp_path):
    """A ``stacks='all'`` stack: C++ unwinding, the threading runtime's object file, torch's Python, then the user's
    frame (its site); a stack of native frames alone names autograd's engine when its frames are there."""
    native = [
        {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
        {"filename": "thread48.o", "line": 0, "name": "execute_native_thread_routine"},
        {"filename": "/usr/lib/libc.so.6", "line": 0, "name": "start_thread"},
    ]
    record = Recorder()
    record.alloc(100, "actor/update_actor", native + frames("forward", 20))
    engine = {"filename": "", "line": 0, "name": "torch::autograd::Engine::thread_main(std::shared_ptr<...>)"}
    record.alloc(50, stack=[*native, engine])
    record.alloc(25, stack=native)
    path = tmp_path / "native.pickle"
    path.write_bytes(pickle.dumps(record.snapshot()))
    sites = {s.site: s.bytes for s in summarize(read_histories(path)[0]).top_sites}
    assert sites == {"train.py:20 forward < main.py:9 main": 100, AUTOGRAD_ENGINE: 50, NO_USER_FRAME: 25}


def test_torch_2_0s_format_blocks_without_addresses_and_stacks_in_their_history(tmp_path):
    """FlexGen's published snapshot (torch 2.0: blocks without ``address``, frames under ``history``, no times)."""
    published = ROOT / "tests" / "data" / "snapshots" / "torch2.0" / "flexgen_oom_snapshot.pickle.xz"
    data = lzma.decompress(published.read_bytes())
    snapshot = pickle.loads(data)
    assert not any("address" in b for s in snapshot["segments"] for b in s["blocks"])
    path = tmp_path / "oom_snapshot.pickle"
    path.write_bytes(data)
    (history,) = read_histories(path)
    summary = summarize(history)
    alive = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert summary.end_bytes == alive and summary.timed is False and summary.peak_time_us is None
    assert summary.segments is not None and summary.segments.reserved == sum(
        s["total_size"] for s in snapshot["segments"]
    )
    assert summary.top_sites[0].site.startswith("FlexGen/flexgen/pytorch_backend.py:190 allocate")  # from history
    blocks = sum(1 for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert len(history.alive_at_start) == blocks  # each block at an address of its own


def test_the_trainers_oom_line_names_the_snapshot_and_its_analysis_override(tmp_path):
    """With torch_memory on, the trainer's last line on an OOM points at the OOM snapshot the tool wrote and takes its
    override from that snapshot's analysis (the failing pass's own bytes lead here), with the run's settings."""
    from rlprof_train.out_of_memory import out_of_memory_line

    folder = tmp_path / "profile" / "torch_memory"
    folder.mkdir(parents=True)
    snapshot = folder / "oom_rank0_pid7_step3.pickle"
    snapshot.write_bytes(pickle.dumps(an_oom_in_the_backward().snapshot()))
    config = {
        "global_profiler": {"tool": "torch_memory", "save_path": str(tmp_path / "profile")},
        "actor_rollout_ref": {"model": {"enable_gradient_checkpointing": True}},
    }
    error = RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 79.19 GiB of "
                         "which 1.00 GiB is free.")  # fmt: skip
    line = out_of_memory_line(error, config, 0, 3, "actor", "update_actor", held_at_start=5 << 30)
    assert f"its OOM snapshot: {snapshot} (rlprof memory {snapshot} says what held the memory)" in line
    assert "(8.000 GiB requested, 1.000 GiB free, 5.000 GiB held on the device before the run started)" in line
    assert "try actor_rollout_ref.model.enable_activation_offload=true" in line  # checkpointing is on already


def test_a_request_larger_than_the_device_is_said_first_with_only_what_makes_it_smaller(tmp_path, capsys):
    """A 1 PiB request on a 141 GiB device: no memory freed makes room for it. The memory page, the report's finding
    and the trainer's line say so first; what to try is only what asks for less (the pass's micro-batch), not
    offloading or ZeRO 3, which free held bytes."""
    record = an_oom_in_the_backward()
    record.traces[0][-1]["size"] = 1 << 50
    snapshot = record.snapshot()
    snapshot["rlprof"] = {"devices": {0: {"name": "NVIDIA H200", "total_memory": 141 << 30}}}
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / "oom_rank0_pid7_step3.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    (folder / "config.yaml").write_text(
        yaml.safe_dump({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 8, "zero_stage": 1}}})
    )
    (folder / "run.json").write_text(json.dumps({"run_id": "crafted"}))
    assert main(["memory", str(path), "--format", "md"]) == 0
    text = capsys.readouterr().out
    head = text[: text.index("Live at the failure per role")]
    assert "the request alone is larger than the device (1.000 PiB of 141.000 GiB): no memory freed makes room" in head
    assert "What to try: a smaller request" in text and "offload" not in text and "zero_stage" not in text
    assert main(["report", str(folder), "--format", "json"]) == 0
    (finding,) = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["rule"] == "memory-bound"]
    assert "1048576.00 GiB (more than the device's 141.00 GiB: no memory freed makes room for it" in finding["message"]
    assert finding["overrides"] == ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], finding["overrides"]

    from rlprof_train.out_of_memory import out_of_memory_line

    error = RuntimeError("CUDA out of memory. Tried to allocate 1024.00 TiB. GPU 0 has a total capacity of 139.72 GiB "
                         "of which 120.00 GiB is free.")  # fmt: skip
    config = {"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 8}}}
    line = out_of_memory_line(error, config, 0, 3, "actor", "update_actor")
    assert "; the request alone is more than the device's 139.720 GiB: no memory freed makes room for it" in line, line
    micro_batch = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"
    assert line.endswith(f"try {micro_batch}, then resume: the last checkpoint is intact"), line
