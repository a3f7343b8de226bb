"""The example loop run as a real program with each tool: torch traces read by TensorBoard's PyTorch profiler
plugin, NVTX ranges recorded by a real nsys, and rank selection across two real processes."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from rlprof.analysis.sources.nsys_report import count_by_role, export_sqlite, read_nvtx_ranges
from rlprof.manifest import read_manifest

from conftest import ROOT, free_port, run_example, subprocess_env, torchrun

pytestmark = pytest.mark.slow

# Ranges the example records in one step, by (role, name).
RANGES_PER_STEP = Counter(
    {
        ("rollout", "generate"): 1,
        ("reward", "score"): 1,
        ("ref", "compute_ref_log_prob"): 1,
        ("critic", "compute_values"): 1,
        ("critic", "value_loss"): 1,
        ("actor", "update_policy"): 1,
    }
)


def test_torch_traces_for_steps_2_and_3_are_listed_and_served_by_tensorboard(tmp_path):
    run_example(
        "global_profiler.tool=torch",
        "global_profiler.steps=[2,3]",
        "global_profiler.profile_continuous_steps=true",
        save_path=tmp_path,
    )
    manifest = read_manifest(tmp_path)
    assert [(m["tool"], m["path"], m["steps"], m["rank"]) for m in manifest] == [
        ("torch", "torch/step2-3/rank0.pt.trace.json.gz", [2, 3], 0)
    ]
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["manifest.jsonl", "torch/step2-3/rank0.pt.trace.json.gz"]
    with gzip.open(tmp_path / manifest[0]["path"], "rt") as handle:
        trace = json.load(handle)
    assert trace["distributedInfo"]["rank"] == 0
    spans = Counter(e["name"] for e in trace["traceEvents"] if e.get("ph") == "X")
    assert spans["ProfilerStep#2"] == 1 and spans["ProfilerStep#3"] == 1 and spans["ProfilerStep#1"] == 0
    for (role, name), count in RANGES_PER_STEP.items():
        assert spans[f"{role}/{name}"] == 2 * count

    port = free_port()
    tensorboard = shutil.which("tensorboard", path=os.path.dirname(sys.executable))
    server = subprocess.Popen(
        [tensorboard, "--logdir", str(tmp_path / "torch"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        runs = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/runs", timeout=5
                ) as r:
                    runs = json.load(r)
                if runs.get("runs"):
                    break
            except OSError:
                pass
            time.sleep(1)
        assert runs is not None and "step2-3" in runs["runs"], runs
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/workers?run=step2-3&view=Overview", timeout=30
        ) as r:
            assert json.load(r) == ["rank0"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def nsys_profile(nsys: str, report: Path) -> tuple[str, ...]:
    # --sample/--cpuctxsw=none: without them the CPU-only run can hang (PLATFORM.md)
    return (
        "timeout",
        "600",
        nsys,
        "profile",
        "-t",
        "nvtx,osrt",
        "--sample=none",
        "--cpuctxsw=none",
        "--force-overwrite=true",
        "-o",
        str(report),
        sys.executable,
    )


def test_nsys_records_each_role_range_in_the_selected_steps_only(tmp_path, nsys):
    report = tmp_path / "rl"
    run_example(
        "global_profiler.tool=nsys",
        "global_profiler.steps=[2,3]",
        "global_profiler.profile_continuous_steps=true",
        save_path=tmp_path / "out",
        prefix=nsys_profile(nsys, report),
    )
    stats = subprocess.run(
        [nsys, "stats", "--report", "nvtxsum", "--format", "csv", f"{report}.nsys-rep"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = [line.split(",") for line in stats.splitlines() if line.startswith(tuple("0123456789"))]
    instances = {row[-1]: int(row[2]) for row in rows}
    assert instances["rlprof:step 2"] == 1 and instances["rlprof:step 3"] == 1 and "rlprof:step 1" not in instances
    for (_, name), count in RANGES_PER_STEP.items():
        assert instances[f"rlprof:{name}"] == 2 * count, (name, instances)

    by_role = count_by_role(read_nvtx_ranges(export_sqlite(nsys, f"{report}.nsys-rep")))
    for (role, name), count in RANGES_PER_STEP.items():
        assert by_role[(role, name)] == 2 * count


def test_nsys_closes_the_ranges_of_a_raising_function(tmp_path, nsys):
    script = tmp_path / "raising.py"
    script.write_text(
        "import rlprof\n"
        "@rlprof.profiled(role='actor', name='explode')\n"
        "def explode():\n"
        "    raise ValueError('x')\n"
        "rlprof.init({{'global_profiler': {{'tool': 'nsys', 'save_path': {!r}}}}})\n"
        "for n in range(3):\n"
        "    with rlprof.step(n):\n"
        "        with rlprof.profile_range('outer', role='actor'):\n"
        "            try:\n"
        "                explode()\n"
        "            except ValueError:\n"
        "                pass\n".format(str(tmp_path / "out"))
    )
    report = tmp_path / "raise"
    subprocess.run(
        [*nsys_profile(nsys, report), str(script)], check=True, capture_output=True, timeout=600, env=subprocess_env()
    )
    ranges = [r for r in read_nvtx_ranges(export_sqlite(nsys, f"{report}.nsys-rep")) if r.category == "actor"]
    outer = [r for r in ranges if r.name == "outer"]
    inner = [r for r in ranges if r.name == "explode"]
    assert len(outer) == 3 and len(inner) == 3  # every push was popped
    for o, i in zip(sorted(outer, key=lambda r: r.start_ns), sorted(inner, key=lambda r: r.start_ns), strict=False):
        assert o.start_ns <= i.start_ns and i.end_ns <= o.end_ns  # the pop of each range came in order


def test_two_ranks_with_ranks_1_write_only_rank_1_files(tmp_path):
    run_example(
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        "role_profiler.ranks=[1]",
        "loop.steps=3",
        save_path=tmp_path,
        prefix=torchrun(2),
    )
    manifest = read_manifest(tmp_path)
    assert [(m["path"], m["rank"]) for m in manifest] == [("torch/step2/rank1.pt.trace.json.gz", 1)]
    with gzip.open(tmp_path / manifest[0]["path"], "rt") as handle:
        info = json.load(handle)["distributedInfo"]
    assert info["rank"] == 1 and info["world_size"] == 2 and info["backend"] == "gloo"


def test_two_ranks_with_all_ranks_write_both_without_collisions(tmp_path):
    run_example(
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        "role_profiler.all_ranks=true",
        "loop.steps=3",
        save_path=tmp_path,
        prefix=torchrun(2),
    )
    paths = sorted(m["path"] for m in read_manifest(tmp_path))
    assert paths == ["torch/step2/rank0.pt.trace.json.gz", "torch/step2/rank1.pt.trace.json.gz"]
    assert all((tmp_path / p).stat().st_size > 0 for p in paths)


THREADS_LEFT = """
import os, runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(f"rank {os.environ['RANK']} threads left: {names}")
"""


def test_two_ranks_leave_no_gloo_thread_behind_at_exit(tmp_path):
    """Once the example's main returns, gloo's worker threads are gone: a worker still alive at exit may free the last
    collective's tensors while the interpreter finalizes, which aborts the process (SIGABRT, "terminate called without
    an active exception", seen about once in 30 two-rank runs under load) when torch._dynamo was imported after the
    group was made."""
    wrapper = tmp_path / "threads_left.py"
    wrapper.write_text(THREADS_LEFT)
    result = run_example(
        "global_profiler.tool=nsys", "loop.steps=2", save_path=tmp_path, prefix=(*torchrun(2), str(wrapper))
    )
    left = dict(re.findall(r"rank (\d) threads left: (\[[^]]*\])", result.stdout))  # the ranks' lines may interleave
    assert sorted(left) == ["0", "1"] and not any("gloo" in names for names in left.values()), result.stdout


def test_the_declared_nvtx_range_holds_what_the_nsys_tool_uses():
    from importlib.metadata import version

    import tomllib
    from nvtx._lib import lib
    from packaging.requirements import Requirement

    from rlprof.tools.nsys import NVTX_INTERNALS

    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (nvtx,) = [Requirement(r) for r in requirements if Requirement(r).name == "nvtx"]
    assert str(nvtx.specifier) in ("<0.3,>=0.2.12", ">=0.2.12,<0.3")  # 0.2.11 has no DummyDomain
    assert version("nvtx") in nvtx.specifier
    assert [name for name in NVTX_INTERNALS if not hasattr(lib, name)] == []


SEED_ACTOR_ONLY = """
actor_rollout_ref:
  actor:
    profiler:
      enable: true
      all_ranks: false
      ranks: [0]
"""


@pytest.mark.parametrize("critic_block", [False, True])
def test_the_seeds_actor_block_alone_records_actor_rollout_and_ref_on_the_example_loop(tmp_path, critic_block):
    config = tmp_path / "seed.yaml"
    config.write_text(SEED_ACTOR_ONLY + ("critic:\n  profiler: {enable: true, ranks: [0]}\n" if critic_block else ""))
    run_example(
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        save_path=tmp_path / "out",
        prefix=(sys.executable,),
        before=("--config", str(config)),
    )
    (record,) = read_manifest(tmp_path / "out")
    with gzip.open(tmp_path / "out" / record["path"], "rt") as handle:
        spans = Counter(e["name"] for e in json.load(handle)["traceEvents"] if e.get("ph") == "X")
    roles = {name.split("/")[0] for name in spans if "/" in name}
    assert roles == ({"actor", "rollout", "ref", "critic"} if critic_block else {"actor", "rollout", "ref"})
    assert spans["rollout/generate"] == 1 and spans["ref/compute_ref_log_prob"] == 1 and "reward/score" not in spans
