"""Regression runs with pytest-benchmark: the ``rlprof_benchmark`` fixture in a user's test file outside the
repository, ``scripts/bench.sh save/compare`` catching an injected slowdown (and naming the role it hit) while passing
an unchanged tree, and ``rlprof compare`` on two benchmark files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlprof.analysis.bench_compare import compare_benchmarks
from rlprof.cli import main

from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench.sh"
USER_TEST = """
import os, time
import rlprof

SLEEP = 0.010

@rlprof.profiled(role="actor")
def update():
    time.sleep(SLEEP * (2 if os.environ.get("SLOW_ACTOR") else 1))

@rlprof.profiled(role="rollout")
def generate():
    time.sleep(SLEEP)

def train_step():
    generate()
    update()

def test_train_step(rlprof_benchmark):
    rlprof_benchmark.pedantic(train_step, rounds=15, iterations=1)
"""


def bench(project: Path, *args: str, slow: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in subprocess_env().items() if k not in ("SLOW_ACTOR", "RLPROF_BENCH_STORAGE")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    if slow:
        env["SLOW_ACTOR"] = "1"
    return subprocess.run(
        ["bash", str(BENCH), *args, "test_user_bench.py"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "my_project"
    folder.mkdir()
    (folder / "test_user_bench.py").write_text(USER_TEST)
    return folder


def saved_runs(project: Path) -> list[Path]:
    return sorted((project / ".benchmarks").glob("*/*.json"))


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_the_fixture_stores_the_time_per_role_in_a_users_benchmark(project):
    done = bench(project, "save", "base")
    assert done.returncode == 0, done.stdout + done.stderr
    [saved] = saved_runs(project)
    [entry] = json.loads(saved.read_text())["benchmarks"]
    info = entry["extra_info"]["rlprof"]
    assert info["calls"] == 15
    assert info["ranges_per_call"]["actor/update"] == 1.0 and info["ranges_per_call"]["rollout/generate"] == 1.0
    for role in ("actor", "rollout"):
        assert 9.5 <= info["ms_per_call_by_role"][role] <= 30, info
    assert entry["stats"]["data"], "the rounds are saved (intervals need them)"


@pytest.mark.slow  # over 7 s: kept out of the quick loop
def test_bench_compare_catches_an_injected_slowdown_and_names_the_role(project):
    assert bench(project, "save", "base").returncode == 0
    unchanged = bench(project, "compare", "base")
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
    assert "no regression beyond 1.2x" in unchanged.stdout
    slowed = bench(project, "compare", "base", slow=True)
    assert slowed.returncode == 1, slowed.stdout + slowed.stderr
    verdict = " ".join(slowed.stdout.split())
    assert "REGRESSED test_user_bench.py::test_train_step" in verdict
    assert "most of it in role actor" in verdict


def test_bench_sh_names_what_is_wrong(project):
    missing = bench(project, "compare", "never-saved")
    assert missing.returncode == 2 and "no run saved as 'never-saved'" in missing.stderr
    assert bench(project, "bogus", "x").returncode == 2
    bad_name = bench(project, "save", "a/b")
    assert bad_name.returncode == 2 and "NAME 'a/b'" in bad_name.stderr


def benchmark_file(path: Path, median: float, extra: dict, rounds: list[float] | None = None) -> Path:
    stats = {"median": median, "mean": median, "min": median, "max": median, "rounds": 1}
    if rounds is not None:
        stats["data"] = rounds
    data = {
        "machine_info": {"node": "n1", "cpu": {"brand_raw": "cpu"}},
        "benchmarks": [{"name": "test_a", "fullname": "t.py::test_a", "stats": stats, "extra_info": extra}],
    }
    path.write_text(json.dumps(data))
    return path


def test_a_stored_ratio_that_grows_is_a_regression_even_when_the_median_is_steady(tmp_path):
    old = benchmark_file(tmp_path / "old.json", 1.0, {"overhead_ratio": 1.05, "note": "x", "flag_ratio": True})
    new = benchmark_file(tmp_path / "new.json", 1.0, {"overhead_ratio": 1.50})
    result = compare_benchmarks(old, new, fail_above=1.2)
    [change] = result.regressed
    assert [s.key for s in change.stored_ratios] == ["overhead_ratio"]
    assert change.regressions == ["overhead_ratio 1.05 -> 1.5 (1.43x, limit 1.2x)"]
    assert not compare_benchmarks(old, new, fail_above=1.5).regressed


def test_a_slower_median_within_noise_is_not_a_regression(tmp_path):
    noisy_old = [1.0, 1.6, 0.9, 1.5, 1.0, 1.4]
    noisy_new = [1.3, 1.0, 1.6, 1.2, 1.5, 1.4]
    old = benchmark_file(tmp_path / "old.json", 1.2, {}, noisy_old)
    new = benchmark_file(tmp_path / "new.json", 1.45, {}, noisy_new)
    [change] = compare_benchmarks(old, new, fail_above=1.1).benchmarks
    assert change.ratio > 1.1 and change.interval is not None and change.interval.low <= 1.0
    assert not change.regressions


def test_compare_reads_benchmark_files_as_json_and_rejects_misuse(tmp_path, capsys):
    old = benchmark_file(tmp_path / "old.json", 1.0, {})
    new = benchmark_file(tmp_path / "new.json", 2.0, {})
    assert main(["compare", str(old), str(new), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "rlprof-bench-compare/1" and data["benchmarks"][0]["ratio"] == 2.0
    assert main(["compare", str(old), str(new), "--fail-above", "1.5", "--format", "md"]) == 1
    assert "REGRESSED t.py::test_a" in capsys.readouterr().out
    assert main(["compare", str(old), str(new), "--fail-above", "0.5"]) == 2
    assert "--fail-above 0.5: expected a ratio of at least 1.0" in capsys.readouterr().err
    assert main(["compare", str(old), str(new), str(new)]) == 2
    assert "compare in pairs" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"machine_info": {}, "benchmarks": [{"fullname": "x"}]}))
    assert main(["compare", str(old), str(broken)]) == 2
    assert "broken.json: not a pytest-benchmark JSON file" in capsys.readouterr().err


def test_range_times_counts_each_range_and_a_role_once_through_nested_ranges(tmp_path):
    import time

    import rlprof
    from rlprof.tools.range_times import RangeTimesTool

    config = {"global_profiler": {"tool": "range_times", "save_path": str(tmp_path), "steps": None}}
    session = rlprof.init(config)
    try:
        assert isinstance(session.tool, RangeTimesTool)
        for n in (1, 2):
            with rlprof.step(n):
                with rlprof.profile_range("update", role="actor"):
                    with rlprof.profile_range("forward", role="actor"):
                        time.sleep(0.02)
                    with rlprof.profile_range("generate", role="rollout"):
                        time.sleep(0.01)
        taken = session.tool.take()
        assert session.tool.take() == {"ranges": {}, "roles": {}}, "take starts from zero"
    finally:
        rlprof.shutdown()
    ranges, roles = taken["ranges"], taken["roles"]
    assert {label: r["count"] for label, r in ranges.items()} == {
        "actor/update": 2,
        "actor/forward": 2,
        "rollout/generate": 2,
        "step/between_steps": 1,  # the session's own range from the end of step 1 to the start of step 2
    }
    assert ranges["actor/update"]["seconds"] >= 0.06 and ranges["actor/forward"]["seconds"] >= 0.04
    assert roles["actor"] == pytest.approx(ranges["actor/update"]["seconds"]), "the inner actor range counts once"
    assert roles["rollout"] == pytest.approx(ranges["rollout/generate"]["seconds"])
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.jsonl"], "range_times writes no trace"
