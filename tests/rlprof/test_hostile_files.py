"""Files from outside are untrusted: damaged or hostile ones cost what they touch, in bounded time and memory, and
say so in one line, never with a traceback. Each case is a file someone could send: wrong types inside events, a
NaN mid-file, nesting deeper than any parser's stack, a 100 MB string, a gzip bomb named like a host allocation
timeline, a saved config whose YAML aliases expand exponentially, and manifest paths that leave the save path."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from rlprof.analysis.run import find_run
from rlprof.analysis.sources.chrome_trace import scan_trace
from rlprof.analysis.trace_builder import MAX_FRAME_DEPTH
from rlprof.cli import main

from conftest import ROOT, subprocess_env


def good(i: int) -> dict[str, object]:
    return {"ph": "X", "cat": "user_annotation", "name": "actor/update", "pid": 1, "tid": 1, "ts": 10 * i, "dur": 5}


def write(path, text: str) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(text)


def as_blocks(events: list[str]) -> str:
    """Raw event texts in kineto's indented block layout (``\\n  {`` ... ``\\n  },``)."""
    blocks = ",\n".join("  {\n    " + e.strip()[1:-1].strip() + "\n  }" for e in events)
    return '{\n  "schemaVersion": 1,\n  "traceEvents": [\n' + blocks + "\n  ]\n}\n"


@pytest.mark.parametrize("layout", ["blocks", "one line"])
def test_events_with_wrong_types_are_skipped_and_counted(tmp_path, layout):
    bad = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": "abc", "dur": 1},
        {"ph": "X", "cat": ["not", "hashable"], "name": "x", "pid": 1, "tid": 1, "ts": 1, "dur": 1},
        {"ph": "X", "cat": "user_annotation", "name": 42, "pid": 1, "tid": 1, "ts": 3, "dur": 1},
        "not an event",
        [1, 2, 3],
    ]
    events = [good(1), *bad, good(2)]
    path = tmp_path / "rank0.json.gz"
    if layout == "blocks":
        write(path, as_blocks([json.dumps(e) for e in events]))
    else:
        write(path, json.dumps({"traceEvents": events}))
    scan = scan_trace(path)
    assert scan.ranges["actor/update"].count == 2
    assert scan.skipped == 5  # the three with wrong types and the two that are not objects
    assert any("5 events could not be read" in p for p in scan.problems)


@pytest.mark.parametrize("layout", ["blocks", "one line"])
def test_the_timeline_copies_odd_events_as_they_are_and_skips_what_is_not_an_event(tmp_path, layout):
    """Wrong types (a text for ts, a list for cat and ph, a number for pid) are copied unchanged, a NaN and nesting
    deeper than the decoder's stack lose only their event, non-objects are skipped and counted in a note."""
    odd = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": "abc", "dur": 1},
        {"ph": ["s"], "cat": ["not", "hashable"], "name": "x", "pid": [1], "tid": 1, "ts": 1, "dur": 1, "id": 3},
    ]
    texts = [json.dumps(e) for e in (good(1), *odd, "not an event", [1, 2, 3], good(2))]
    if layout == "blocks":
        texts.insert(2, '{"ph": "X", "cat": "cpu_op", "name": "nan", "pid": 1, "tid": 1, "ts": NaN, "dur": 5}')
        texts.insert(
            3, '{"ph": "X", "name": "deep", "pid": 1, "tid": 1, "ts": 1, "args": ' + "[" * 5000 + "]" * 5000 + "}"
        )
        write(tmp_path / "rank0.json.gz", as_blocks(texts))
    else:
        write(tmp_path / "rank0.json.gz", '{"traceEvents": [' + ", ".join(texts) + "]}")
    from rlprof.analysis.timeline import merge

    timeline = merge(find_run([tmp_path / "rank0.json.gz"]), tmp_path / "merged.json")
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    copied = {e["name"]: e for e in merged if e.get("ph") != "M"}
    names = ["actor/update", "aten::mm", "nan", "x"] if layout == "blocks" else ["actor/update", "aten::mm", "x"]
    assert [e["name"] for e in merged if e.get("ph") != "M"] == [*names, "actor/update"]
    assert copied["aten::mm"]["ts"] == "abc" and copied["x"]["cat"] == ["not", "hashable"] and copied["x"]["id"] == 3
    skipped = 3 if layout == "blocks" else 2  # the two non-objects, and the event nested too deep
    assert any(f"{skipped} events could not be read" in note for note in timeline.notes), timeline.notes


def test_a_nan_mid_file_loses_only_that_event(tmp_path):
    texts = [json.dumps(good(i)) for i in range(1, 4)]
    texts.insert(
        1, '{"ph": "X", "cat": "user_annotation", "name": "actor/update", "pid": 1, "tid": 1, "ts": NaN, "dur": 5}'
    )
    texts.insert(3, '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 25, "dur": Infinity}')
    path = tmp_path / "rank0.json.gz"
    write(path, as_blocks(texts))
    scan = scan_trace(path)
    assert scan.ranges["actor/update"].count == 3 and scan.skipped == 2
    assert not any("truncated" in p for p in scan.problems)


@pytest.mark.parametrize("layout", ["blocks", "the deep event first", "one line"])
def test_nesting_deeper_than_the_parsers_stack_loses_only_that_event(tmp_path, layout):
    """100,000 nested arrays in one event's args: skipped and counted, the rest read. The deep event first puts the
    reading on the streaming parser (kineto's layout is not seen in the first 64 KiB), which reads it without building
    it (a million levels passed 23 GB before: benchmarks/test_hostile_memory.py)."""
    deep = (
        '{"ph": "X", "cat": "cpu_op", "name": "x", "pid": 1, "tid": 1, "ts": 1, "dur": 1, "args": {"x": '
        + "[" * 100_000
        + "]" * 100_000
        + "}}"
    )
    events = [json.dumps(good(1)), deep, json.dumps(good(2))]
    path = tmp_path / "rank0.json.gz"
    if layout == "blocks":
        write(path, as_blocks(events))
    elif layout == "the deep event first":
        write(path, as_blocks(events[1:2] + events[0:1] + events[2:]))
    else:
        write(path, '{"traceEvents": [' + ", ".join(events) + "]}")
    scan = scan_trace(path)
    assert scan.ranges["actor/update"].count == 2 and scan.skipped == 1
    assert any("nested deeper than 64 levels" in p for p in scan.problems)


def test_frames_nested_past_the_stack_limit_are_counted_not_kept(tmp_path):
    """A range holding 2000 operators each inside the previous: the first 511 kept under it, the rest counted; the
    range's totals stay right."""
    depth = 2000
    events = [{"ph": "X", "cat": "user_annotation", "name": "actor/update", "pid": 1, "tid": 1, "ts": 0, "dur": 10_000}]
    events += [
        {"ph": "X", "cat": "cpu_op", "name": "aten::op", "pid": 1, "tid": 1, "ts": 1 + i, "dur": 4000 - 2 * i}
        for i in range(depth)
    ]
    path = tmp_path / "rank0.json.gz"
    write(path, as_blocks([json.dumps(e) for e in events]))
    scan = scan_trace(path)
    update = scan.ranges["actor/update"]
    assert update.count == 1 and update.total_us == 10_000 and update.self_us == 10_000 - 4000
    assert scan.too_deep == depth + 1 - MAX_FRAME_DEPTH
    assert any(f"nested more than {MAX_FRAME_DEPTH} deep" in p for p in scan.problems)


HUGE = (
    "import gzip, json, sys, resource\n"
    "from rlprof.analysis.sources.chrome_trace import scan_trace\n"
    "scan = scan_trace(sys.argv[1])\n"
    "peak = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) / 1024\n"
    "peak += resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # a helper process, if one ran\n"
    "print(json.dumps({'problems': scan.problems, 'ranges': sorted(scan.ranges), 'peak_mb': peak}))\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["blocks", "one line"])
def test_a_100_mb_string_stops_the_reading_in_one_line_within_bounded_memory(tmp_path, layout):
    """One event holding a 100 MB name (larger than the 64 MiB an event may have): the events before it are kept,
    the reading stops with one line, and the whole process stays under 256 MiB."""
    path = tmp_path / "rank0.json.gz"
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as handle:
        head = json.dumps(good(1))
        if layout == "blocks":
            handle.write('{\n  "traceEvents": [\n  {\n    ' + head.strip()[1:-1] + '\n  },\n  {\n    "name": "')
        else:
            handle.write('{"traceEvents": [' + head + ', {"name": "')
        for _ in range(100):
            handle.write("x" * (1 << 20))
        handle.write('", "ph": "X", "ts": 1, "dur": 1}\n  ]\n}\n')
    result = subprocess.run(
        [sys.executable, "-c", HUGE, str(path)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert out["ranges"] == ["actor/update"] and len(out["problems"]) == 1
    assert "larger than 64 MiB" in out["problems"][0]
    assert out["peak_mb"] < 256


@pytest.mark.slow  # over 7 s: kept out of the quick loop
def test_a_gzip_bomb_named_as_a_host_allocation_timeline_is_refused_in_one_line(tmp_path, capsys):
    """2 MB of gzip that decompresses to 2 GB: refused when the first 256 MiB are out, in one line."""
    path = tmp_path / "rank0_pid1.host_alloc.json.gz"
    with gzip.open(path, "wb", compresslevel=9) as handle:
        handle.write(b'{"format": "rlprof-host-alloc/1", "events": [')
        block = b'{"t_us": 1, "action": "alloc", "addr": 1, "bytes": 1, "range": "", "stack": null},' * 10_000
        for _ in range(2600):
            handle.write(block)
        handle.write(b"{}]}")
    assert path.stat().st_size < 8 << 20
    assert main(["memory", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "decompresses to more than 256 MiB" in err


def test_a_saved_config_with_exponential_yaml_aliases_is_skipped_not_expanded(tmp_path, capsys):
    """The billion laughs in a run's config.yaml: rlprof compare names the file and goes on without it."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 12)]
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.yaml").write_text("\n".join(lines) + "\n")
        with (folder / "metrics.jsonl").open("w") as handle:
            for step in range(1, 9):
                handle.write(json.dumps({"step": step, "timing_s/step": 1.0, "critic/score/mean": 0.1 * step}) + "\n")
    run = find_run([tmp_path / "a"])
    assert run.config is None and any("uses YAML aliases" in note for note in run.notes)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--format", "md"]) == 0


def test_manifest_paths_and_links_that_leave_the_save_path_are_not_followed(tmp_path):
    """A crafted manifest line (``../../secret/...``) and a symbolic link in the save path to a file outside it: the
    run reads neither, says so, and ``rlprof view`` links neither for TensorBoard to serve."""
    import shutil

    from rlprof.cli.view import link_logdir
    from rlprof.manifest import Manifest

    corpus = ROOT / "tests" / "data" / "traces" / "hta_alexnet_trace.json.gz"
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(corpus, secret / "creds.pt.trace.json.gz")
    save = tmp_path / "run" / "profile"
    (save / "torch").mkdir(parents=True)
    shutil.copy(corpus, save / "torch" / "rank0.pt.trace.json.gz")
    (save / "torch" / "link.pt.trace.json.gz").symlink_to(secret / "creds.pt.trace.json.gz")
    manifest = Manifest(save, run="r1")
    manifest.record("torch", save / "torch" / "rank0.pt.trace.json.gz", steps=[1], rank=0, format="chrome_trace")
    manifest.record("torch", save / "torch" / "link.pt.trace.json.gz", steps=[2], rank=0, format="chrome_trace")
    line = json.loads((save / "manifest.jsonl").read_text().splitlines()[-1])
    line.update(path="../../secret/creds.pt.trace.json.gz", steps=[3])
    with (save / "manifest.jsonl").open("a") as handle:
        handle.write(json.dumps(line) + "\n")
    run = find_run([save], None)
    assert [t.path.name for t in run.traces] == ["rank0.pt.trace.json.gz"]
    notes = " ".join(run.notes)
    assert "'torch/link.pt.trace.json.gz' leaves the save path; not followed" in notes
    assert "'../../secret/creds.pt.trace.json.gz' leaves the save path; not followed" in notes
    logdir = tmp_path / "logdir"
    link_logdir([run], logdir)
    served = [p.resolve() for p in logdir.rglob("*") if p.is_symlink()]
    assert served and all(secret not in p.parents for p in served)


def test_malformed_manifest_lines_and_non_finite_timings_are_skipped_not_a_traceback(tmp_path, capsys):
    save = tmp_path / "profile"
    save.mkdir()
    lines = [
        '{"kind": "file", "tool": "torch"}',  # no path
        '{"kind": "file", "path": 5, "role": 3, "rank": "x", "steps": "a", "bytes": "b"}',  # every type wrong
        '{"kind": "file", "path": "gone.pt.trace.json.gz", "role": null, "steps": [1, "2"], "rank": true}',
        "[1, 2]",
        '"a string"',
    ]
    (save / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["summary", str(save)]) == 0
    out = capsys.readouterr().out
    assert "gone.pt.trace.json.gz" in out and "2 manifest lines were skipped (no file path)" in out
    assert main(["report", str(save)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "manifest lines were skipped" in err and "Traceback" not in err
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text(
        '{"step": 1, "timing_s/step": NaN, "timing_s/gen": 1.0}\n'
        '{"step": 2, "timing_s/step": Infinity, "timing_s/gen": 1e999}\n'
        '{"step": 3, "timing_s/step": 1.0, "timing_s/gen": 0.5}\n'
    )
    assert main(["report", str(logs), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["breakdown"]["steps"] == [3] and report["breakdown"]["phases"][0]["median_s"] == 0.5
    assert any("2 steps hold NaN or infinite timings; those values are left out" in n for n in report["notes"])


def test_a_link_to_the_filesystem_root_is_refused_in_one_line_not_walked(tmp_path, capsys):
    (tmp_path / "root").symlink_to("/")
    assert main(["report", str(tmp_path / "root")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(a link to /) is the filesystem's root, not a run's folder" in err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile").symlink_to("/")  # inside a run folder: named and not followed
    assert main(["report", str(tmp_path / "run")]) == 2
    assert "profile links out of" in capsys.readouterr().err
