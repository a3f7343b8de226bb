"""torch_memory without CUDA records the host allocation timeline: known tensors allocated under a named range appear
with their exact size at that range and at the line that allocated them; what was alive before the window is named
by the path that holds it; the bound on events holds and says what it dropped; on the trainer, a reward function's
known buffer is the peak's, and with ZeRO-Offload the optimizer states are the actor's largest host allocation."""

from __future__ import annotations

import gzip
import json
import textwrap
from pathlib import Path

import pytest
import torch

import rlprof
from rlprof.analysis.allocations import summarize
from rlprof.analysis.sources import read_histories
from rlprof.cli import main
from rlprof.manifest import read_manifest

from conftest import ROOT, subprocess_env, trainer_command

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the host timeline is the default without CUDA")

MiB = 2**20


class Worker:
    """Holds state made before any window, and allocates under its role's ranges."""

    def __init__(self) -> None:
        self.table = torch.empty(16 * MiB, dtype=torch.uint8)
        self.kept: list[torch.Tensor] = []

    @rlprof.profiled(role="actor", name="allocate")
    def allocate(self, megabytes: int) -> None:
        self.kept.append(torch.empty(megabytes * MiB, dtype=torch.uint8))  # ALLOCATE_LINE
        scratch = torch.empty(4 * MiB, dtype=torch.uint8)
        del scratch


ALLOCATE_LINE = next(
    number
    for number, line in enumerate(Path(__file__).read_text(encoding="utf-8").splitlines(), start=1)
    if "# ALLOCATE_LINE" in line
)


def timeline(save_path):
    (entry,) = [e for e in read_manifest(save_path) if e["path"].endswith(".host_alloc.json.gz")]
    return save_path / entry["path"]


def test_known_tensors_appear_at_their_range_and_line_and_the_state_before_the_window_is_named(tmp_path, capsys):
    worker = Worker()
    rlprof.init({"global_profiler": {"tool": "torch_memory", "steps": [2], "save_path": str(tmp_path)}})
    for step in range(1, 4):
        with rlprof.step(step):
            worker.allocate(8)
    rlprof.shutdown()
    path = timeline(tmp_path)
    with gzip.open(path, "rt") as handle:
        document = json.load(handle)
    assert document["format"] == "rlprof-host-alloc/1" and document["steps"] == [2] and document["dropped"] == 0

    summary = summarize(read_histories(path)[0])
    # by hand: step 2 adds one kept 8 MiB tensor, then a 4 MiB scratch one (the peak), freed at once; 16 MiB and
    # step 1's 8 MiB were alive before the window
    assert summary.by_tag["actor/allocate"] == 12 * MiB
    sites = {s.site.split(" < ")[0]: s.bytes for s in summary.top_sites if s.tag == "actor/allocate"}
    assert sites == {
        f"test_host_alloc.py:{ALLOCATE_LINE} allocate": 8 * MiB,
        f"test_host_alloc.py:{ALLOCATE_LINE + 1} allocate": 4 * MiB,
    }
    named = {s.site: s.bytes for s in summary.top_sites if s.tag == "actor"}
    assert named["Worker.table"] == 16 * MiB and named["Worker.kept[*]"] == 8 * MiB
    assert summary.peak_bytes - summary.start_bytes >= 12 * MiB  # 8 kept + 4 scratch at the peak
    assert summary.end_bytes - summary.start_bytes == pytest.approx(8 * MiB, abs=MiB)

    assert main(["memory", str(path), "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert f"test_host_alloc.py:{ALLOCATE_LINE} allocate" in out and "| Worker.table | actor | 16.0 MiB |" in out


def test_the_bound_keeps_the_newest_events_and_counts_the_dropped(tmp_path):
    config = {
        "global_profiler": {
            "tool": "torch_memory",
            "steps": [1],
            "save_path": str(tmp_path),
            "global_tool_config": {"torch_memory": {"trace_alloc_max_entries": 1000, "stack_depth": 0}},
        }
    }
    rlprof.init(config)
    kept = []
    with rlprof.step(1):
        with rlprof.profile_range("many", role="rollout"):
            for _ in range(3000):
                kept.append(torch.empty(1024, dtype=torch.uint8))
    rlprof.shutdown()
    with gzip.open(timeline(tmp_path), "rt") as handle:
        document = json.load(handle)
    assert len(document["events"]) == 1000 and document["dropped"] >= 2000
    assert document["stacks"] == [] and all(e["stack"] is None for e in document["events"])
    summary = summarize(read_histories(timeline(tmp_path))[0])
    alive_in_range = sum(a.size for a in read_histories(timeline(tmp_path))[0].alive_at_start.values() if a.tag)
    assert alive_in_range >= 2000 * 1024  # the dropped allocations are folded into the state at the start
    assert summary.end_bytes >= summary.start_bytes + 1000 * 1024 - 64 * 1024


REWARD = textwrap.dedent(
    """
    import rlprof
    import torch


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        with rlprof.profile_range("lookup_table", role="reward"):
            table = torch.empty(32 * 2**20, dtype=torch.uint8)  # TABLE_LINE
            del table
        return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
    """
)


@pytest.mark.long  # CI time: in the test command's long runs
def test_the_trainers_peak_holds_the_reward_buffer_and_zero_offload_states_lead_the_actor(tmp_path):
    reward = tmp_path / "reward_fn.py"
    reward.write_text(REWARD)
    table_line = next(n for n, line in enumerate(REWARD.splitlines(), start=1) if "# TABLE_LINE" in line)
    command = trainer_command(
        tmp_path,
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"custom_reward_function.path={reward}",
        "actor_rollout_ref.actor.offload_optimizer=true",
        "global_profiler.tool=torch_memory",
        "global_profiler.steps=[2]",
        f"global_profiler.save_path={tmp_path / 'profile'}",
    )
    result = subprocess_run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summarize(read_histories(timeline(tmp_path / "profile"))[0])

    assert summary.by_tag["reward/lookup_table"] == 32 * 2**20  # the one buffer alive at the peak, nothing else
    (site,) = [s for s in summary.top_sites if s.tag == "reward/lookup_table"]
    assert site.site.startswith(f"reward_fn.py:{table_line} compute_score") and site.count == 1

    actor = [s for s in summary.top_sites if s.tag.split("/")[0] == "actor"]
    parameters = next(s.bytes for s in actor if s.site == "ActorWorker.engine parameters")
    assert actor[0].site == "ActorWorker.engine.basic_optimizer.state", actor[:3]  # DeepSpeedCPUAdam's states
    assert actor[0].bytes == 2 * parameters  # exp_avg and exp_avg_sq, fp32 like the parameters


def subprocess_run(command):
    import subprocess

    env = subprocess_env(OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
