"""Per-annotation totals of a trace folder computed by Holistic Trace Analysis (run with HTA on PYTHONPATH):
prints one JSON line {"seconds": load + totals, "peak_mb": its peak RSS, "totals": {name: [count, total µs]}}; with
``--gpu`` also HTA's temporal and kernel breakdowns (what rlprof's pass computes for the device).

    PYTHONPATH=.venv/hta HTA_DISABLE_NS_ROUNDING=1 python benchmarks/hta_totals.py TRACE_DIR [--gpu]
"""

from __future__ import annotations

import json
import sys
import time


def own_peak_mb() -> float:
    """This process's own peak RSS (VmHWM). Not ``ru_maxrss``: a child started by a process of large RSS inherits
    that high-water mark (Linux records the parent's at exec), so it would report the parent's peak."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def main(trace_dir: str, gpu: bool) -> None:
    start = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis

    analyzer = TraceAnalysis(trace_dir=trace_dir, include_last_profiler_step=True)
    trace = analyzer.t.get_trace(next(iter(analyzer.t.get_all_traces())))
    symbols = analyzer.t.symbol_table.get_sym_table()
    annotation = [i for i, s in enumerate(symbols) if s == "user_annotation"]
    totals = trace[trace["cat"].isin(annotation)].groupby("name")["dur"].agg(["count", "sum"])
    result = {symbols[int(name)]: [int(row["count"]), float(row["sum"])] for name, row in totals.iterrows()}
    if gpu:
        analyzer.get_temporal_breakdown(visualize=False)
        analyzer.get_gpu_kernel_breakdown(visualize=False)
    peak_mb = own_peak_mb()
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_mb, "totals": result}))


if __name__ == "__main__":
    main(sys.argv[1], "--gpu" in sys.argv[2:])
