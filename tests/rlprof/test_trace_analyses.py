"""The trace analyses' registry (docs/extending.md, "A trace analysis"): what an analysis does not read is let go
before it runs, ``after`` runs it after the analysis whose results it reads, and a registration naming a field or an
analysis that does not exist is refused."""

from __future__ import annotations

import pytest

from rlprof.analysis import trace_model
from rlprof.analysis.sources.chrome_trace import scan_trace
from rlprof.analysis.trace_model import register_trace_analysis, trace_analyses

from conftest import ROOT

TRACE = ROOT / "tests" / "data" / "traces" / "hta_trace_diff_v100_rank1.json.gz"
"""A V100 trace from HTA's test data: kernels, copies, launches and steps."""


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(trace_model, "_ANALYSES", dict(trace_model._ANALYSES))  # this test's registrations only


def test_an_analysis_sees_what_it_reads_and_runs_after_the_one_it_names(registry):
    seen = {}

    @register_trace_analysis("probe", reads=("op_duration",), after="steps")
    def probe(trace, scan):
        seen["op_duration"] = trace.op_duration is not None and len(trace.op_duration) > 0
        seen["released"] = [name for name in ("op_start", "launch_start", "instances") if getattr(trace, name) is None]
        seen["steps_done"] = scan.gpu is not None and bool(scan.gpu_by_step)

    scan_trace(TRACE)
    assert [a.name for a in trace_analyses()][-1] == "probe"
    assert seen == {"op_duration": True, "released": ["op_start", "launch_start", "instances"], "steps_done": True}


def test_a_registration_naming_what_does_not_exist_is_refused(registry):
    with pytest.raises(ValueError, match=r"reads=\['op_ends'\] are not fields of BuiltTrace"):
        register_trace_analysis("bad", reads=("op_ends",))
    register_trace_analysis("waits", reads=(), after="nowhere")(lambda trace, scan: None)
    with pytest.raises(ValueError, match=r"wait for analyses that are not registered: waits \(after='nowhere'\)"):
        trace_analyses()
