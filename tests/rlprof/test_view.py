"""``rlprof view`` live: TensorBoard started over a trainer run's scalars and torch trace (symbolic links, never
copies), queried over HTTP (scalars plugin and PyTorch Profiler plugin), stopped by Ctrl-C or SIGTERM with nothing
left behind."""

from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from rlprof.analysis.run import find_run
from rlprof.cli import main
from rlprof.cli.view import link_logdir

from conftest import ROOT, free_port, subprocess_env, trainer_command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A 3-step trainer run logging to TensorBoard, with a torch trace of step 2."""
    root = tmp_path_factory.mktemp("view")
    command = trainer_command(
        root,
        'trainer.logger=["file","tensorboard"]',
        "trainer.experiment_name=viewed",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        f"global_profiler.save_path={root / 'profile'}",
    )
    env = subprocess_env(OMP_NUM_THREADS="1", TENSORBOARD_DIR=str(root / "tensorboard"))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def view_processes() -> list[psutil.Process]:
    """TensorBoard processes serving an ``rlprof view`` log folder."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any("rlprof-view-" in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


def test_the_log_folder_is_links_to_the_runs_files(trainer_run, tmp_path):
    counts = link_logdir([find_run([trainer_run / "logs"])], tmp_path / "logdir")
    assert counts == {"event_files": 1, "traces": 1}
    links = [p for p in (tmp_path / "logdir").rglob("*") if p.is_file()]
    assert len(links) == 2 and all(p.is_symlink() for p in links)
    assert {p.relative_to(tmp_path / "logdir").parts[:2] for p in links} == {("viewed", "scalars"), ("viewed", "torch")}


def test_traces_named_otherwise_are_linked_under_the_names_the_plugin_reads(tmp_path):
    """HTA's rank files (``sampled_rank-0.json.gz``) and verl's ``prof_rank-0.json.gz``: the PyTorch Profiler plugin
    lists only ``*.pt.trace.json[.gz]``."""
    folder = tmp_path / "traces"
    folder.mkdir()
    sampled = ROOT / "tests" / "data" / "traces" / "hta_sampled_ranks" / "sampled_rank-0.json.gz"
    for name in ("prof_rank-0.json.gz", "rank-1.json", "rank2.pt.trace.json.gz"):
        data = sampled.read_bytes()
        (folder / name).write_bytes(gzip.decompress(data) if not name.endswith(".gz") else data)
    link_logdir([find_run([folder])], tmp_path / "logdir")
    names = sorted(p.name for p in (tmp_path / "logdir").rglob("*") if p.is_symlink())
    assert names == ["prof_rank-0.pt.trace.json.gz", "rank-1.pt.trace.json", "rank2.pt.trace.json.gz"]


@pytest.mark.parametrize(
    ("stop", "options", "host"),
    [
        (signal.SIGINT, [], "127.0.0.1"),  # the default: loopback, a free port
        (signal.SIGTERM, ["--port", "{port}"], "127.0.0.1"),
        (signal.SIGINT, ["--host", "0.0.0.0"], "0.0.0.0"),  # only when asked for, with a warning
        (signal.SIGHUP, [], "127.0.0.1"),  # a closed SSH session
    ],
    ids=["ctrl-c", "sigterm-port", "explicit-host", "hangup"],
)
def test_view_serves_scalars_and_traces_and_stops_cleanly(trainer_run, stop, options, host):
    port = str(free_port())
    command = [sys.executable, "-m", "rlprof.cli", "view", str(trainer_run / "logs")]
    command += [option.format(port=port) for option in options]
    view = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    try:
        announced = ""
        deadline = time.monotonic() + 120
        while "TensorBoard at" not in announced and time.monotonic() < deadline and view.poll() is None:
            announced += view.stdout.readline()
        url = re.search(rf"http://{re.escape(host)}:(\d+)", announced)
        assert url is not None, announced
        assert (url.group(1) == port) == ("--port" in options)
        exposed = "serving on 0.0.0.0: anyone who can reach this host can read these runs" in announced
        assert exposed == (host != "127.0.0.1"), announced
        base = f"http://127.0.0.1:{url.group(1)}"
        tags = get_json(f"{base}/data/plugin/scalars/tags")
        assert "critic/score/mean" in tags["viewed/scalars"] and "timing_s/step" in tags["viewed/scalars"]
        runs: dict = {"runs": []}
        while not runs["runs"] and time.monotonic() < deadline:  # the profiler plugin loads traces in the background
            runs = get_json(f"{base}/data/plugin/pytorch_profiler/runs")
            time.sleep(0.5)
        assert runs["runs"] == ["viewed/torch/step2"]
        served = [p for p in view_processes() if psutil.Process(view.pid) in p.parents()]  # TensorBoard, its server
        command = next(p.cmdline() for p in served if "--logdir" in p.cmdline())
        logdir = Path(command[command.index("--logdir") + 1])
        assert logdir.is_dir()
        view.send_signal(stop)
        assert view.wait(timeout=60) == 0
    finally:
        if view.poll() is None:
            view.kill()
    assert [p.cmdline() for p in served if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert not logdir.parent.exists(), "the generated log folder was left behind"


def test_a_killed_view_takes_tensorboard_with_it_and_the_next_view_removes_its_folder(trainer_run, capsys):
    command = [sys.executable, "-m", "rlprof.cli", "view", str(trainer_run / "logs")]
    view = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    try:
        announced, deadline = "", time.monotonic() + 120
        while "TensorBoard at" not in announced and time.monotonic() < deadline and view.poll() is None:
            announced += view.stdout.readline()
        assert "TensorBoard at" in announced, announced
        served = [p for p in view_processes() if psutil.Process(view.pid) in p.parents()]
        cmdline = next(p.cmdline() for p in served if "--logdir" in p.cmdline())
        folder = Path(cmdline[cmdline.index("--logdir") + 1]).parent
        view.kill()  # SIGKILL: no handler runs
        view.wait()
        _, alive = psutil.wait_procs(served, timeout=30)
        assert alive == [], [p.cmdline() for p in alive]  # the parent-death signal stopped TensorBoard
        assert folder.exists()  # nobody could clean up ...
        assert main(["view", str(trainer_run / "missing")]) == 2
        assert not folder.exists()  # ... until the next view
    finally:
        if view.poll() is None:
            view.kill()
    capsys.readouterr()


def test_bad_paths_and_empty_runs_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for path, message in ((tmp_path / "missing", "missing"), (tmp_path / "empty", "nothing to read in")):
        assert main(["view", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rlprof view: ") and message in err and err.count("\n") == 1
