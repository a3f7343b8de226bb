"""The test command's one-time builds (scripts/warm_builds.py), made beside its checks: the models it builds are the
ones the bundled configs' runs load, its DeepSpeed ops the ones a CPU run loads, and the test command waits for it
(a failure shown) before the tests, ending it on an early exit."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory  # where torch builds an extension of that name

from rlprof_train.config.load import load_trainer_config
from rlprof_train.prepare import EMBEDDED_MODEL_DIR
from rlprof_train.tiny_model import embedded_model_name

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("warm_builds", ROOT / "scripts" / "warm_builds.py")
assert spec is not None and spec.loader is not None
warm_builds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(warm_builds)


@pytest.mark.parametrize("config", warm_builds.CONFIGS)
def test_each_model_built_is_the_one_its_configs_runs_load(config):
    data = load_trainer_config([f"--config-name={config}"]).data
    expected = ROOT / EMBEDDED_MODEL_DIR / embedded_model_name(data.task, data.task_max_operand)
    assert warm_builds.build_model(config) == str(expected)
    assert (expected / "config.json").is_file()


def test_the_bundled_configs_are_every_config_with_an_embedded_model():
    """A new bundled config training another embedded model is warmed too, or this fails."""
    bundled = sorted(p.stem for p in (ROOT / "rlprof_train" / "config").glob("*.yaml") if p.stem != "ppo_trainer")
    assert sorted(warm_builds.CONFIGS) == bundled


@pytest.mark.slow  # a first call on a machine builds both ops (about 90 s); after the test command's, none
def test_the_deepspeed_ops_built_are_those_a_cpu_run_loads():
    """Built (or found built) in torch's extensions folder, then a process starting DeepSpeed's collectives and its
    CPU Adam finds both there and builds nothing: ninja's logs unchanged."""
    env = subprocess_env()
    warm = "import sys; sys.path.insert(0, 'scripts'); import warm_builds; warm_builds.build_deepspeed_ops()"
    subprocess.run([sys.executable, "-c", warm], check=True, env=env, cwd=ROOT, capture_output=True, timeout=900)
    folders = [Path(_get_build_directory(name, verbose=False)) for name in ("deepspeed_shm_comm", "cpu_adam")]
    logs = {folder: (folder / ".ninja_log").read_text() for folder in folders}
    run = (
        "import torch\n"
        "from rlprof_train.workers.engine import init_distributed\n"
        "init_distributed('cpu')\n"
        "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
        "DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))])\n"
    )
    subprocess.run([sys.executable, "-c", run], check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    assert {folder: (folder / ".ninja_log").read_text() for folder in folders} == logs


def test_the_test_command_waits_for_the_builds_before_the_tests_and_ends_them_on_an_early_exit():
    script = (ROOT / "scripts" / "test.sh").read_text()
    lines = [line for line in script.splitlines() if line and not line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if "scripts/warm_builds.py" in line and line.endswith("&"))
    waited = next(i for i, line in enumerate(lines) if line.startswith('wait "$warm"'))
    tests = next(i for i, line in enumerate(lines) if re.match(r"\.venv/bin/python -m pytest tests", line))
    assert lines[start].startswith("setsid ") and start < waited < tests
    assert 'trap \'kill -- -"$warm"' in lines[start + 2] and lines[waited + 1] == "trap - EXIT"
    assert "cat outputs/warm_builds.log" in lines[waited]
