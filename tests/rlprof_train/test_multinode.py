"""Two simulated nodes on this machine: two torchrun agents meeting through c10d rendezvous, each in its own working
directory (no shared outputs/, so each builds its own copy of the embedded model). They train the same steps, each
node's save_path holds its own rank's trace with a manifest naming host and rank, and rlprof report given both save
paths reports both ranks. A checkpoint folder that is not shared stops every rank at start with one line, no hang.

The command is the multi-node recipe of docs/multinode.md with both nodes' addresses set to this machine."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlprof.cli import main
from rlprof.manifest import read_manifest
from rlprof_train.tiny_model import embedded_model_name

from conftest import free_port, subprocess_env

pytestmark = pytest.mark.slow

TRAINING = (
    "trainer.total_training_steps=3",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    'trainer.logger=["file"]',
    "global_profiler.tool=torch",
    "global_profiler.steps=[2]",
    "actor_rollout_ref.actor.profiler.all_ranks=true",
)


def two_nodes(tmp_path: Path, *overrides: str, timeout: float = 600) -> list[tuple[Path, int, str]]:
    """Start both agents, wait for both; (node folder, exit code, output) per node."""
    port = free_port()
    agents = []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=my-run",
            "-m",
            "rlprof_train.main_ppo",
            "--config-name=demo",
            *overrides,
        ]
        env = subprocess_env(OMP_NUM_THREADS="1")
        log = (folder / "agent.log").open("w")
        agents.append(
            (folder, log, subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env))
        )
    results = []
    for folder, log, agent in agents:
        try:
            code = agent.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for _, _, other in agents:
                other.kill()
            raise AssertionError(f"{folder.name} did not finish in {timeout} s (a hang)") from None
        log.close()
        results.append((folder, code, (folder / "agent.log").read_text(errors="replace")))
    return results


@pytest.mark.long  # CI time: in the test command's long runs
def test_two_nodes_without_a_shared_disk_train_and_profile_both_ranks(tmp_path, capsys):
    nodes = two_nodes(tmp_path, *TRAINING, "trainer.save_freq=-1", "trainer.resume_mode=disable")
    for folder, code, output in nodes:
        assert code == 0, f"{folder.name}:\n{output[-4000:]}"
    (main_node,) = [folder for folder, _, _ in nodes if list(folder.rglob("metrics.jsonl"))]
    (metrics,) = main_node.rglob("metrics.jsonl")
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    save_paths, ranks = [], set()
    for folder, _, _ in nodes:
        model = folder / "outputs" / "models" / embedded_model_name("arithmetic", 4)
        assert (model / "model.safetensors").exists()  # its own copy
        save_path = folder / "outputs" / "profile"
        (entry,) = [e for e in read_manifest(save_path) if e.get("kind") != "session"]
        assert entry["host"] == os.uname().nodename and entry["steps"] == [2] and entry["run"] == "my-run"
        with gzip.open(save_path / entry["path"], "rt") as handle:
            trace = json.load(handle)
        assert trace["distributedInfo"]["rank"] == entry["rank"] and trace["distributedInfo"]["world_size"] == 2
        assert any(e.get("name") == "ProfilerStep#2" for e in trace["traceEvents"])  # both trained step 2
        ranks.add(entry["rank"])
        save_paths.append(str(save_path))
    assert ranks == {0, 1}
    assert main(["report", *save_paths, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(window["rank"] for window in report["traces"]) == [0, 1]


def test_a_checkpoint_folder_the_nodes_do_not_share_stops_every_rank_at_start(tmp_path):
    nodes = two_nodes(tmp_path, *TRAINING, "trainer.save_freq=2", timeout=300)
    for folder, code, output in nodes:
        assert code != 0, f"{folder.name} trained with checkpoints nobody else can read"
        (said,) = [line for line in output.splitlines() if line.startswith("config error:")]
        assert "trainer.default_local_dir=" in said and "is not shared between the nodes" in said
        assert "Traceback" not in output.split("config error:")[0]  # one line from the trainer, not a traceback
