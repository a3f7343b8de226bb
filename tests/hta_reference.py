"""Holistic Trace Analysis's numbers for one trace folder, as JSON on stdout (the peer the corpus tests compare with).

    PYTHONPATH=.venv/hta HTA_DISABLE_NS_ROUNDING=1 python tests/hta_reference.py TRACE_DIR

``cuda_sync`` events (CUPTI's synchronization records: a stream waiting, not device work; rlprof does not count
them) are removed first. Per rank: the CPU totals of each user annotation; the temporal breakdown, kernel-type sums,
communication/compute
overlap, launch delays and memory-copy statistics HTA computes; the correlation ids of the device operations HTA
keeps (so the comparison can apply HTA's filter); and per user annotation the device time of the kernels below it in
HTA's call graph (each kernel's parent is its launch; the launch's ancestors are its frames), counted once per name,
leaving out (and listing) the kernels whose launch HTA's call graph puts under a frame that does not hold it in time
(HTA nests some operators under a zero-length operator that ended before them).
"""

from __future__ import annotations

import json
import logging
import math
import sys


def clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "item"):
        return clean(value.item())
    return value


def main(folder: str) -> None:
    logging.disable(logging.WARNING)
    from hta.common.call_stack import CallGraph
    from hta.trace_analysis import TraceAnalysis

    analyzer = TraceAnalysis(trace_dir=folder, include_last_profiler_step=True)
    symbols = analyzer.t.symbol_table.get_sym_table()
    index = analyzer.t.symbol_table.get_sym_id_map()
    sync = index.get("cuda_sync")
    for rank, frame in analyzer.t.traces.items():  # CUPTI's synchronization records are waits, not device work
        analyzer.t.traces[rank] = frame[frame["cat"] != sync] if sync is not None else frame
    out: dict = {}
    try:
        temporal = analyzer.get_temporal_breakdown(visualize=False)
    except Exception:  # HTA fails on traces without device operations
        temporal = None
    try:
        overlap = analyzer.get_comm_comp_overlap(visualize=False)
    except Exception:  # HTA fails on traces without communication
        overlap = None
    try:
        _, kernels = analyzer.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True, num_kernels=10**9)
    except Exception:  # HTA fails on traces without kernels
        kernels = None
    ranks = list(analyzer.t.get_all_traces())
    try:
        launch = analyzer.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False)
    except Exception:  # HTA fails on traces without launches
        launch = {}
    CallGraph(analyzer.t)  # adds each event's parent to the trace (a kernel's parent is its launch)
    for rank in ranks:
        df = analyzer.t.get_trace(rank)
        found = temporal[temporal["rank"] == rank] if temporal is not None else []
        row = found.iloc[0].to_dict() if len(found) else None
        annotation = index.get("user_annotation", -2)
        cpu = df[df["cat"] == annotation].groupby("name")["dur"].agg(["count", "sum"])
        gpu = df[df["stream"].ne(-1)]
        names = [symbols[int(n)] for n in gpu["name"]]
        ordered: dict[str, float] = {}
        misnested = []
        parents = df["parent"].to_dict() if "parent" in df.columns else {}
        names_by_index, cats_by_index = df["name"].to_dict(), df["cat"].to_dict()
        starts, durations = df["ts"].to_dict(), df["dur"].to_dict()
        for position, kernel in enumerate(gpu.index):
            caller = parents.get(kernel, -1)
            chain, node = [], parents.get(caller, -1) if caller is not None and caller >= 0 else -1
            while node is not None and node >= 0 and node in names_by_index:
                chain.append(node)
                node = parents.get(node, -1)
            if any(not starts[n] <= starts[caller] < starts[n] + durations[n] for n in chain):
                misnested.append(int(gpu["correlation"].iloc[position]))  # a parent that does not hold the launch
                continue
            seen = set()
            for node in chain:
                if cats_by_index[node] == annotation:
                    label = symbols[int(names_by_index[node])]
                    if label not in seen:
                        seen.add(label)
                        ordered[label] = ordered.get(label, 0.0) + float(gpu["dur"].iloc[position])
        delays = launch.get(rank)
        out[str(rank)] = {
            "annotations": {symbols[int(name)]: [int(r["count"]), float(r["sum"])] for name, r in cpu.iterrows()},
            "temporal": row,
            "overlap": None
            if overlap is None or not len(overlap[overlap["rank"] == rank])
            else float(overlap[overlap["rank"] == rank].iloc[0]["comp_comm_overlap_pctg"]),
            "kernel_sums": None
            if kernels is None
            else {
                kind: float(kernels[(kernels["rank"] == rank) & (kernels["kernel_type"] == kind)]["sum (us)"].sum())
                for kind in set(kernels["kernel_type"])
            },
            "launch_delay": None
            if delays is None or not len(delays)
            else sorted(float(v) for v in delays["launch_delay"].tolist()),
            "device_correlations": sorted(int(c) for c in gpu["correlation"].tolist()),
            "device_names": sorted(set(names)),
            "annotation_device_us": ordered,
            "misnested_correlations": misnested,
        }
    print(json.dumps(clean(out)))


if __name__ == "__main__":
    main(sys.argv[1])
