"""The figures of a GPU kit step, a line each (scripts/gpu_kit.sh puts them in its summary).

    python scripts/gpu_kit_show.py steps METRICS.jsonl [--last 6,7]   # per step: time, rollout, update, MFU, memory
    python scripts/gpu_kit_show.py report REPORT.json                  # per range: CUDA time and wall time; findings

``--last`` fails (exit 1) unless the last steps logged are those: a resumed run continued where it was saved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def steps(path: Path, last: str | None) -> int:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in records:
        print(
            f"step {int(r['training/global_step'])}: {r['timing_s/step']:.2f} s (gen {r['timing_s/gen']:.2f}, "
            f"update_actor {r.get('timing_s/update_actor', float('nan')):.2f}), MFU "
            f"{100 * r.get('perf/mfu/actor', float('nan')):.2f}%, peak {r.get('perf/max_memory_allocated_gb', 0):.1f} "
            f"GB, response length {r['response_length/mean']:.1f}, pg_loss {r.get('actor/pg_loss', float('nan')):.4f}"
        )
    if last:
        wanted = [int(s) for s in last.split(",")]
        logged = [int(r["training/global_step"]) for r in records][-len(wanted) :]
        if logged != wanted:
            print(f"the last steps logged are {logged}, not {wanted}")
            return 1
    return 0


def report(path: Path) -> int:
    data = json.loads(path.read_text())
    for window in data["traces"]:
        print(f"window {window['window']} rank {window['rank']} on {window.get('device')}:")
        for r in window["ranges"]:
            print(f"  {r['label']}: {r['cuda_ms']:.1f} ms of CUDA kernels in {r['total_ms']:.1f} ms ({r['count']}x)")
    for finding in data["findings"]:
        print(f"finding: {finding['message']}")
    return 0 if data["traces"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["steps", "report"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--last")
    args = parser.parse_args()
    return steps(args.path, args.last) if args.what == "steps" else report(args.path)


if __name__ == "__main__":
    sys.exit(main())
