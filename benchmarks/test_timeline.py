"""``rlprof timeline``'s footprint: two ranks' GPU traces (the corpus's ``hta_trace_diff_v100_rank1``, V100 with
NCCL, tiled to ``RLPROF_BENCH_TIMELINE_MB`` uncompressed each, default 200) merged into one gzipped trace in a fresh
process. Target: whole-process peak RSS (VmHWM) at most 256 MiB, as ``rlprof report``'s reading; the time and the
rate are reported. Every event is in the output once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from test_report_speed import CORPUS, PEAK, ROOT, RSS_TARGET_MB, environment

MERGE = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from rlprof.analysis.run import find_run\n"
    "from rlprof.analysis.timeline import merge\n"
    "timeline = merge(find_run([Path(sys.argv[1])]), Path(sys.argv[2]))\n"
    f"print(json.dumps({{'events': timeline.events, 'lanes': len(timeline.lanes), 'peak_mb': {PEAK}}}))\n"
)


def test_timeline_merges_two_large_gpu_traces_in_bounded_memory(benchmark, tmp_path):
    from trace_tiling import tile

    megabytes = float(os.environ.get("RLPROF_BENCH_TIMELINE_MB", "200"))
    folder = tmp_path / "ranks"
    folder.mkdir()
    written = tile(CORPUS / "hta_trace_diff_v100_rank1.json.gz", folder / "rank-0.json.gz", megabytes)
    shutil.copy(folder / "rank-0.json.gz", folder / "rank-1.json.gz")
    out = tmp_path / "merged.pt.trace.json.gz"
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", MERGE, str(folder), str(out)],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=ROOT,
        timeout=3600,
    )
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    total_mb = 2 * written["uncompressed_bytes"] / 1e6
    print(
        f"\nrlprof timeline: 2 x {written['uncompressed_bytes'] / 1e6:.0f} MB ({facts['events']:,} events) in "
        f"{seconds:.1f} s ({total_mb / seconds:.0f} MB/s), whole-process peak {facts['peak_mb']:.0f} MiB, output "
        f"{out.stat().st_size / 1e6:.0f} MB gzipped"
    )
    benchmark.extra_info.update({"trace_mb": total_mb, "seconds": seconds, "peak_mb": facts["peak_mb"]})
    benchmark.pedantic(lambda: None, rounds=1)
    assert facts["lanes"] == 2 and facts["events"] >= 2 * written["events"]  # the tiles' events and the header's
    assert facts["peak_mb"] <= RSS_TARGET_MB
