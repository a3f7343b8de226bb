"""``rlprof report``'s reading against Holistic Trace Analysis, and its footprint, as whole-process figures.

- **Start-up**: ``rlprof report`` on a small trace recorded on a GPU (the corpus's ``hta_event_sync_trace``) in a
  fresh process: its peak RSS (VmHWM, the whole process) under 100 MB, and no torch imported.
- **Large traces**: a GPU trace from the corpus (``hta_trace_diff_v100_rank1``: V100, NCCL, one kernel or copy in
  four events) tiled to ``RLPROF_BENCH_TRACE_MB`` uncompressed (default 400; the 1 GB figures of
  docs/performance_tuning.md: ``RLPROF_BENCH_TRACE_MB=1024 .venv/bin/python -m pytest benchmarks/test_report_speed.py
  -s``), as written and with
  its busiest thread written in reverse order. Each is read in a fresh process by rlprof's one pass (ranges, self
  times, operators, steps, device time per range, the GPU summaries) and by HTA (load, per-annotation totals,
  temporal and kernel breakdowns). Targets: rlprof at least 10x faster, whole-process peak RSS at most 256 MiB
  (rlprof's: its own peak plus its helper process's, which reads two batches in three of a large trace).
  The ratio is the best of up to three alternating pairs (a noisy machine retries; the bound stays).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTA = ROOT / ".venv" / "hta"
CORPUS = ROOT / "tests" / "data" / "traces"
SPEED_TARGET = 10.0
RSS_TARGET_MB = 256
STARTUP_TARGET_MB = 100
PEAK = "int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) / 1024"
CHILDREN_PEAK = "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024"
"""The largest peak of the process's children (rlprof's helper process), added to its own: whole-process figures."""
OURS = (
    "import json, resource, sys, time\n"
    "from rlprof.analysis.sources.chrome_trace import scan_trace\n"
    "start = time.perf_counter(); scan = scan_trace(sys.argv[1])\n"
    "print(json.dumps({'seconds': time.perf_counter() - start, 'events': scan.events, "
    f"'device_ops': scan.gpu.operations if scan.gpu else 0, 'peak_mb': {PEAK} + {CHILDREN_PEAK}}}))\n"
)
STARTUP = (
    "import json, sys\n"
    "from rlprof.cli import main\n"
    "code = main(['report', sys.argv[1], '--format', 'json'])\n"
    f"print(json.dumps({{'code': code, 'torch': 'torch' in sys.modules, 'peak_mb': {PEAK}}}), file=sys.stderr)\n"
)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}", OMP_NUM_THREADS="1")
    return env


def child(command: list[str], env: dict[str, str]) -> tuple[float, dict[str, float]]:
    """(wall seconds of the whole child process, the JSON it printed last)."""
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    return seconds, json.loads(result.stdout.strip().splitlines()[-1])


def test_report_starts_without_torch_in_under_100_mb(benchmark):
    trace = CORPUS / "hta_event_sync_trace.json.gz"
    result = subprocess.run(
        [sys.executable, "-c", STARTUP, str(trace)], capture_output=True, text=True, env=environment(), cwd=ROOT
    )
    facts = json.loads(result.stderr.strip().splitlines()[-1])
    print(f"\nrlprof report on {trace.name}: whole-process peak {facts['peak_mb']:.0f} MiB, torch: {facts['torch']}")
    benchmark.extra_info.update(facts)
    benchmark.pedantic(lambda: None, rounds=1)
    assert facts["code"] == 0 and not facts["torch"]
    assert facts["peak_mb"] < STARTUP_TARGET_MB


@pytest.mark.parametrize(
    "order",
    ["as written", pytest.param("one thread out of order", marks=pytest.mark.long)],  # CI time: in the long runs
)
def test_report_reads_a_large_gpu_trace_10x_faster_than_hta_in_bounded_memory(benchmark, tmp_path, order, speed_target):
    if not (HTA / "hta").is_dir():
        pytest.skip("Holistic Trace Analysis is not installed in .venv/hta (scripts/setup.sh installs it)")
    megabytes = float(os.environ.get("RLPROF_BENCH_TRACE_MB", "400"))
    env = environment()
    folder = tmp_path / "big"
    folder.mkdir()
    trace = folder / "rank1.json.gz"
    from trace_tiling import tile

    written = tile(CORPUS / "hta_trace_diff_v100_rank1.json.gz", trace, megabytes, scramble=order != "as written")
    hta_env = {**env, "PYTHONPATH": f"{HTA}{os.pathsep}{ROOT}", "HTA_DISABLE_NS_ROUNDING": "1"}
    pairs = []
    for _ in range(3):  # alternating pairs; a pair meeting the target ends the run
        ours_s, ours = child([sys.executable, "-c", OURS, str(trace)], env)
        hta_s, theirs = child(
            [sys.executable, str(ROOT / "benchmarks" / "hta_totals.py"), str(folder), "--gpu"], hta_env
        )
        pairs.append(
            {
                "rlprof_s": ours_s,
                "rlprof_peak_mb": ours["peak_mb"],
                "hta_s": hta_s,
                "hta_peak_mb": theirs["peak_mb"],
                "ratio": hta_s / ours_s,
            }
        )
        print(
            f"\n{order}: trace {written['uncompressed_bytes'] / 1e6:.0f} MB uncompressed ({written['events']} events, "
            f"{ours['device_ops']} device operations): rlprof {ours_s:.1f} s / {ours['peak_mb']:.0f} MiB peak, HTA "
            f"{hta_s:.1f} s / {theirs['peak_mb']:.0f} MiB -> {hta_s / ours_s:.1f}x"
        )
        if hta_s / ours_s >= SPEED_TARGET:
            break
    best = max(pairs, key=lambda p: p["ratio"])
    benchmark.extra_info.update(
        {"trace_mb": written["uncompressed_bytes"] / 1e6, "events": written["events"], "order": order, "pairs": pairs}
    )
    out_dir = ROOT / "outputs" / "benchmarks"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "report_speed" if order == "as written" else "report_speed_out_of_order"
    (out_dir / f"{name}.json").write_text(json.dumps({"trace": written, "pairs": pairs}, indent=1))
    benchmark.pedantic(lambda: None, rounds=1)
    assert max(p["rlprof_peak_mb"] for p in pairs) <= RSS_TARGET_MB
    spread = f"{min(p['ratio'] for p in pairs):.1f}-{best['ratio']:.1f}x"
    speed_target(best["ratio"] >= SPEED_TARGET, f"{order}: {spread} faster than HTA (target >= {SPEED_TARGET:g}x)")
