"""Hostile traces in bounded memory: the whole-process peak (the reading process and any helper it starts) of
``scan_trace`` on two shapes a damaged or hostile file can take, at most 256 MiB each:

- **one event nested a million levels deep** (a 2 KB gzip'd file whose first event's args hold 1,000,000 nested
  arrays): 23 GB in 58 s before the nesting limit (the streaming parser built every level);
- **3.3 million operators each inside the previous** on one thread (400 MB inflated): 0.96 GB before the frame limit
  (a frame kept for every open operator).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MB = 256
READ = (
    "import json, resource, sys\n"
    "from rlprof.analysis.sources.chrome_trace import scan_trace\n"
    "scan = scan_trace(sys.argv[1])\n"
    "peak = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) / 1024\n"
    "peak += resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
    "print(json.dumps({'peak_mb': peak, 'skipped': scan.skipped, 'too_deep': scan.too_deep, 'events': scan.events}))\n"
)


def peak_of(path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", READ, str(path)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_million_levels_of_nesting_in_one_event(benchmark, tmp_path):
    depth = 1_000_000
    path = tmp_path / "deep.pt.trace.json.gz"
    event = '{\n    "ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1, "dur": 2, "args": '
    with gzip.open(path, "wt") as handle:
        handle.write('{\n  "schemaVersion": 1,\n  "traceEvents": [\n  ' + event + '{"x": ' + "[" * depth)
        handle.write("]" * depth + '}\n  },\n  {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, ')
        handle.write('"ts": 5, "dur": 2}\n  ]\n}\n')
    found = peak_of(path)
    print(f"\none event nested {depth:,} deep ({path.stat().st_size:,} bytes gzip'd): peak {found['peak_mb']:.0f} MiB")
    benchmark.extra_info.update(found)
    benchmark.pedantic(lambda: None, rounds=1)
    assert found["skipped"] == 1 and found["events"] == 1
    assert found["peak_mb"] <= LIMIT_MB


def test_three_million_operators_each_inside_the_previous(benchmark, tmp_path):
    count = 3_300_000
    path = tmp_path / "stack.pt.trace.json.gz"
    with gzip.open(path, "wb", compresslevel=1) as handle:
        handle.write(b'{\n  "schemaVersion": 1,\n  "traceEvents": [\n')
        line = (
            b'  {\n    "ph": "X", "cat": "cpu_op", "name": "aten::op", "pid": 1, "tid": 1, "ts": %d, "dur": %d\n  },\n'
        )
        for start in range(0, count, 100_000):
            handle.write(b"".join(line % (i, 2 * count - 2 * i) for i in range(start, min(start + 100_000, count))))
        handle.write(
            b'  {\n    "ph": "X", "cat": "cpu_op", "name": "aten::end", "pid": 1, "tid": 1, "ts": 0, "dur": 1\n'
        )
        handle.write(b"  }\n  ]\n}\n")
    found = peak_of(path)
    print(
        f"\n{count:,} nested operators on one thread: peak {found['peak_mb']:.0f} MiB, {found['too_deep']:,} not kept"
    )
    benchmark.extra_info.update(found)
    benchmark.pedantic(lambda: None, rounds=1)
    assert found["too_deep"] > count - 1000
    assert found["peak_mb"] <= LIMIT_MB
