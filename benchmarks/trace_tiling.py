"""Scale a real torch trace to any size: copies of its complete events, shifted in time one after the other, with
step numbers and ids (correlation ids too) renumbered, between its own header and footer. The result has the
structure of the source (same ranges, operators, kernels and launches, same nesting), only more of it: what
``rlprof report`` and Holistic Trace Analysis meet on a long real run. With ``--disorder``, the thread with the most
CPU events is written in reverse order in every copy (a trace whose writer did not sort that thread).

    python benchmarks/trace_tiling.py SOURCE.json.gz TARGET.json.gz --mb 1024 [--disorder]
"""

from __future__ import annotations

import argparse
import gzip
import re
from pathlib import Path

_TS = re.compile(rb'"ts": ([0-9.]+)')
_THREAD = re.compile(rb'"pid": ([^,]+), "tid": ([^,\n]+)')
_CPU = (b'"cat": "cpu_op"', b'"cat": "user_annotation"', b'"cat": "python_function"')
_STEP = re.compile(rb'"ProfilerStep#(\d+)"')
_IDS = re.compile(rb'"(External id|Ev Idx|Record function id|correlation)": (\d+)')


def split_trace(source: Path) -> tuple[bytes, list[bytes], bytes]:
    """(header up to the event list, the complete ``"ph": "X"`` events, footer from the end of the list)."""
    if source.suffix == ".gz":
        with gzip.open(source, "rb") as handle:
            raw = handle.read()
    else:
        raw = source.read_bytes()
    start = raw.index(b"[", raw.index(b'"traceEvents"')) + 1
    end = raw.rindex(b"\n  ]")
    first = raw.index(b"\n  {", start)
    blocks = raw[first + 1 : end].split(b"\n  },\n  {")  # kineto: one top-level event per indented block
    events = [b"  {" + block if not block.startswith(b"  {") else block for block in blocks]
    events = [block if block.rstrip().endswith(b"\n  }") else block.rstrip() + b"\n  }" for block in events]
    return raw[:start], [block for block in events if b'"ph": "X"' in block], raw[end:]


def renumber(body: bytes, copy: int, span: float, step_count: int) -> bytes:
    """The ``copy``-th copy of the events: times shifted by ``copy`` spans, steps and ids past earlier copies'."""
    text = _TS.sub(lambda m: b'"ts": %.3f' % (float(m.group(1)) + copy * span), body)
    text = _STEP.sub(lambda m: b'"ProfilerStep#%d"' % (int(m.group(1)) + copy * step_count), text)
    return _IDS.sub(lambda m: b'"%s": %d' % (m.group(1), int(m.group(2)) + copy * 10_000_000), text)


def disorder(events: list[bytes]) -> list[bytes]:
    """The same events, the CPU events of the busiest thread reversed (written last, latest first)."""

    def thread(block: bytes) -> bytes:
        found = _THREAD.search(block)
        return found.group(0) if found and any(c in block for c in _CPU) else b""

    counts: dict[bytes, int] = {}
    for block in events:
        key = thread(block)
        if key:
            counts[key] = counts.get(key, 0) + 1
    busiest = max(counts, key=lambda key: counts[key])
    reversed_part = [block for block in events if thread(block) == busiest][::-1]
    return [block for block in events if thread(block) != busiest] + reversed_part


def tile(source: Path, target: Path, megabytes: float, scramble: bool = False) -> dict[str, float]:
    """Write ``target`` (gzip, level 1) of about ``megabytes`` MB uncompressed; returns what was written."""
    header, events, footer = split_trace(source)
    if scramble:
        events = disorder(events)
    times = [float(m.group(1)) for block in events for m in _TS.finditer(block)]
    span = max(times) - min(times) + 1000.0
    steps = [int(m.group(1)) for block in events for m in _STEP.finditer(block)]
    step_count = max(steps) - min(steps) + 1 if steps else 0
    body = b",\n".join(events)
    written, copies, goal = len(header) + len(footer), 0, megabytes * 1e6
    with gzip.open(target, "wb", compresslevel=1) as out:
        out.write(header)
        while written < goal:
            text = renumber(body, copies, span, step_count)
            chunk = (b",\n" if copies else b"\n") + text
            out.write(chunk)
            written += len(chunk)
            copies += 1
        out.write(b"\n" + footer.lstrip(b"\n"))
    return {
        "copies": copies,
        "events": copies * len(events),
        "uncompressed_bytes": written,
        "compressed_bytes": target.stat().st_size,
        "steps": copies * step_count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--mb", type=float, default=1024.0, help="uncompressed size to reach, in MB (default 1024)")
    parser.add_argument("--disorder", action="store_true", help="write the busiest thread's events in reverse")
    args = parser.parse_args()
    print(tile(args.source, args.target, args.mb, args.disorder))


if __name__ == "__main__":
    main()
