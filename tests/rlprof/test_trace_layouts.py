"""The same trace reads the same whatever its layout: kineto's indented blocks or any other indentation (read by the
streaming parser), the trace-level values (``distributedInfo``, ``deviceProperties``) before the events or after
them, as kineto versions write them. Checked on a published A100 trace (HTA's alexnet trace, MIT)."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest

from rlprof.analysis.sources.chrome_trace import scan_trace

from conftest import ROOT

PUBLISHED = ROOT / "tests" / "data" / "traces" / "hta_alexnet_trace.json.gz"
METADATA = ("distributedInfo", "deviceProperties")


def kineto_layout(trace: dict) -> str:
    """kineto's own layout: each top-level value on its line, each event an indented block."""
    lines = []
    for key, value in trace.items():
        if key == "traceEvents":
            blocks = ",\n".join("  {\n    " + json.dumps(event)[1:-1] + "\n  }" for event in value)
            lines.append('  "traceEvents": [\n' + blocks + "\n  ]")
        else:
            lines.append(f'  "{key}": {json.dumps(value)}')
    return "{\n" + ",\n".join(lines) + "\n}\n"


def moved_after_the_events(trace: dict) -> dict:
    rest = {k: v for k, v in trace.items() if k not in METADATA}
    return {**rest, **{k: trace[k] for k in METADATA}}


def totals(path) -> dict:
    scan = scan_trace(path)
    return {
        "device": scan.device,
        "rank": scan.rank,
        "events": scan.events,
        "ranges": {label: dataclasses.astuple(r) for label, r in scan.ranges.items()},
        "gpu": dataclasses.asdict(scan.gpu) if scan.gpu else None,
    }


@pytest.mark.parametrize("where", ["before the events", "after the events"])
@pytest.mark.parametrize("layout", ["kineto's blocks", "indented by 4", "one line"])
def test_the_same_trace_reads_the_same_in_every_layout(tmp_path, layout, where):
    trace = json.loads(gzip.decompress(PUBLISHED.read_bytes()))
    expected = totals(PUBLISHED)
    assert expected["device"] == "NVIDIA A100-PG509-200" and expected["rank"] == 0
    if where == "after the events":
        trace = moved_after_the_events(trace)
    if layout == "kineto's blocks":
        text = kineto_layout(trace)
    elif layout == "indented by 4":
        text = json.dumps(trace, indent=4)
    else:
        text = json.dumps(trace)
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(text.encode()))
    assert totals(path) == expected
