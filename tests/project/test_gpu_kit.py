"""scripts/gpu_kit.sh on this CPU machine: prepare gathers the wheels the GPU machine lacks under 64 MiB, run stops at
once with one line (no CUDA device, exit 2), and run --dry-run lists what it would execute."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from conftest import ROOT

KIT = ROOT / "scripts" / "gpu_kit.sh"


def kit(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(KIT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_run_without_cuda_is_one_line_and_exit_2():
    result = kit("run", "--out", "/tmp/rlprof-gpu-kit-unused")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no CUDA device here" in result.stderr


def test_dry_run_lists_the_gpu_tests_the_trainer_and_the_summaries():
    result = kit("run", "--dry-run")
    assert result.returncode == 0, result.stderr
    for fragment in ("pip install --no-index --no-deps --target", "pytest -m gpu tests", "trainer.device=cuda",
                     "llama_shapes.py 155m", "global_profiler.tool=torch", "rlprof.cli report", "rlprof.cli memory",
                     "torch.distributed.run --standalone --nproc_per_node 1", "trainer.n_gpus_per_node=1",
                     "trainer.device=cpu", "pytest -m gpu benchmarks", "summary.txt"):  # fmt: skip
        assert fragment in result.stdout, fragment
    assert (  # --part speed's and --part async's are their own
        '-k "not static_decode and not compiled_rollout and not fast_paths and not pools_sharing"' in result.stdout
    )
    assert '-k "not fast_path and not one_step_off"' in result.stdout
    assert '"fast_paths and' not in result.stdout and "each_fast_path" not in result.stdout


@pytest.mark.parametrize(
    ("part", "selects", "table"),
    [
        ("speed", "fast_paths and 155m", "gpu_fast_155m.md"),
        ("speed-1b", "fast_paths and 1b", "gpu_fast_1b.md"),
        ("speed-each", "each_fast_path", "gpu_each_fast_path.md"),
        ("async", "one_step_off", "gpu_one_step_off.md"),
    ],
)
def test_each_speed_part_lists_its_benchmark(part, selects, table):
    result = kit("run", "--dry-run", "--part", part)
    assert result.returncode == 0, result.stderr
    assert "with a 540 s budget" in result.stdout
    assert f'-k "{selects}"' in result.stdout and table in result.stdout
    if part == "speed":  # the fast paths on the device first
        assert '-k "static_decode or compiled_rollout or fast_paths"' in result.stdout
    if part == "async":  # the one-step-off trainer on the device first
        assert 'tests/rlprof_train/test_one_step_off.py -k "pools_sharing"' in result.stdout


def test_an_unknown_part_is_one_line_naming_the_parts():
    result = kit("run", "--dry-run", "--part", "fast")
    assert result.returncode == 2
    assert (
        result.stderr == "gpu_kit: run: --part fast is not a part (allowed: kit, speed, speed-1b, speed-each, async)\n"
    )


@pytest.mark.slow
def test_prepare_gathers_cp312_wheels_under_64_mib():
    result = kit("prepare", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    wheels = sorted((ROOT / ".gpu_kit" / "wheels").glob("*.whl"))
    names = {w.name.split("-")[0].lower() for w in wheels}
    assert {"omegaconf", "nvtx", "deepspeed", "msgspec", "ijson", "plotly", "pydantic_core", "trl", "datasets"} <= names
    assert all(any(tag in w.name for tag in ("cp312", "py3-none", "py312-none", "abi3")) for w in wheels)
    for wheel in wheels:
        assert zipfile.ZipFile(wheel).testzip() is None
    size_mib = sum(w.stat().st_size for w in wheels) / 2**20
    assert size_mib < 64 and "MiB (limit 64 MiB)" in result.stdout
