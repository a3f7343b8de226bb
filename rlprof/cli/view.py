"""``rlprof view RUN [RUN ...]``: TensorBoard over runs' scalars and torch traces, from one generated log folder of
symbolic links (never copies: traces can be gigabytes), served on the loopback unless a host is asked for
explicitly. TensorBoard stops with ``rlprof view`` however that ends: Ctrl-C, SIGTERM and SIGHUP (a closed SSH
session) stop it cleanly; on Linux it also gets SIGTERM when ``rlprof view`` is killed outright, and the next
``rlprof view`` removes the log folder such a view left."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from rlprof.analysis.run import Run
from rlprof.cli.common import UsageError, find_run, say

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PREFIX = "rlprof-view-"
OWNER = "owner.json"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HELP = "TensorBoard over the runs' scalars and torch traces"
EXAMPLE = "rlprof view outputs/run_a outputs/run_b          # prints the URL; Ctrl-C stops it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN")
    parser.add_argument("--port", type=int, help="default: a free port")
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1; another host exposes the runs")


def command(args: argparse.Namespace, console: Console) -> int:
    remove_abandoned_folders()
    try:
        tensorboard_binary()
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if args.host not in LOOPBACK:
        say(console, f"serving on {args.host}: anyone who can reach this host can read these runs")
    runs = [find_run([path], None) for path in args.runs]
    return serve(runs, args.host, args.port, lambda line: say(console, line))


def link_logdir(runs: list[Run], root: Path) -> dict[str, int]:
    """Fill ``root`` with one folder per run: ``{run}/scalars`` (its TensorBoard event files) and
    ``{run}/torch/{window}`` (its traces, for the PyTorch Profiler tab), all as symlinks. Returns counts."""
    counts = {"event_files": 0, "traces": 0}
    used: set[str] = set()
    for run in runs:
        name = _unique(_run_name(run), used)
        for events in _event_files(run):
            folder = root / name / "scalars"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / events.name).symlink_to(events.resolve())
            counts["event_files"] += 1
        for trace in run.traces:
            folder = root / name / "torch" / (trace.window_name if trace.steps else "trace")
            folder.mkdir(parents=True, exist_ok=True)
            link = folder / _plugin_name(trace.path.name)
            if link.exists():
                link = folder / _plugin_name(f"{trace.path.name.split('.')[0]}-{trace.host or 'h'}.json.gz")
            link.symlink_to(trace.path.resolve())
            counts["traces"] += 1
    return counts


def _plugin_name(name: str) -> str:
    """The name the PyTorch Profiler plugin looks for (``*.pt.trace.json[.gz]``): HTA's ``rank-0.json.gz`` and
    verl's ``prof_rank-0.json.gz`` are linked as ``rank-0.pt.trace.json.gz``."""
    if name.endswith((".pt.trace.json", ".pt.trace.json.gz")):
        return name
    gz = name.endswith(".gz")
    stem = name.removesuffix(".gz").removesuffix(".json")
    return f"{stem}.pt.trace.json" + (".gz" if gz else "")


def _run_name(run: Run) -> str:
    record = run.record or {}
    return str(record.get("experiment") or Path(run.name.split(",")[0]).name or "run")


def _unique(name: str, used: set[str]) -> str:
    candidate, n = name, 1
    while candidate in used:
        n += 1
        candidate = f"{name}-{n}"
    used.add(candidate)
    return candidate


def _event_files(run: Run) -> list[Path]:
    """TensorBoard event files of the run: where its record says, else the TensorBoard folder of its experiment."""
    record = run.record or {}
    folders = [Path(record["tensorboard_dir"])] if record.get("tensorboard_dir") else []
    if run.metrics_path is not None:
        folders.append(run.metrics_path.parent)
    files: list[Path] = []
    for folder in folders:
        if folder.is_dir():
            files += sorted(folder.glob("events.out.tfevents.*"))
    return files


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tensorboard_binary() -> str:
    found = shutil.which("tensorboard", path=os.path.dirname(sys.executable)) or shutil.which("tensorboard")
    if found is None:
        raise FileNotFoundError("tensorboard is not installed (pip install 'rlprof[viewer]')")
    return found


def wait_until_serving(url: str, process: subprocess.Popen[Any], timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/data/runs", timeout=5):
                return True
        except OSError:
            time.sleep(0.5)
    return False


def remove_abandoned_folders() -> None:
    """Delete the log folders of views that were killed (their owner process is gone)."""
    import psutil

    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            owner = json.loads((folder / OWNER).read_text(encoding="utf-8"))
            alive = psutil.pid_exists(owner["pid"]) and psutil.Process(owner["pid"]).create_time() == owner["created"]
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            continue  # not ours to judge (no readable owner record), or it ended between the two looks
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent() -> None:
    """In TensorBoard's process before it starts: SIGTERM when ``rlprof view`` dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: Ctrl-C, SIGTERM and SIGHUP still stop it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve(runs: list[Run], host: str, port: Optional[int], announce: Any) -> int:
    """Run TensorBoard until Ctrl-C, SIGTERM or SIGHUP; returns its exit status. ``announce(line)`` prints
    progress."""
    import psutil

    root = Path(tempfile.mkdtemp(prefix=PREFIX))
    me = psutil.Process()
    (root / OWNER).write_text(json.dumps({"pid": me.pid, "created": me.create_time()}), encoding="utf-8")
    logdir, log = root / "logdir", root / "tensorboard.log"
    process: Optional[subprocess.Popen[Any]] = None
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        counts = link_logdir(runs, logdir)
        port = port or free_port(host)
        with log.open("w") as output:  # a file, not a pipe: TensorBoard must never block on a full pipe
            process = subprocess.Popen(
                [tensorboard_binary(), "--logdir", str(logdir), "--host", host, "--port", str(port)],
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509  (one libc call before exec, no Python threads in use)
            )
        for sig in previous:
            signal.signal(sig, stop)
        url = f"http://{host}:{port}"
        if not wait_until_serving(url, process):
            lines = log.read_text(errors="replace").strip().splitlines()
            announce(f"TensorBoard did not start on {url}: {lines[-1] if lines else 'no answer'}")
            return 1
        announce(
            f"TensorBoard at {url}  ({counts['event_files']} event files, {counts['traces']} traces; "
            "PyTorch Profiler tab for the traces; Ctrl-C to stop)"
        )
        return process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        shutil.rmtree(root, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
