"""Pieces of the trainer checked without training: the reward-function contract, data files, checkpoints on disk,
the run lock, the process group's store and the non-finite guard."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from rlprof.typed_config import ConfigError
from rlprof_train import checkpoint
from rlprof_train.guards import NonFiniteGuard, TrainingDiverged
from rlprof_train.reward_functions import RewardFunction, load_custom_reward
from rlprof_train.run_dir import RunInUse, RunLock

from conftest import ROOT, SMALL_RUN, free_port, subprocess_env, trainer_command


def reward_file(tmp_path, body: str):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize(
    "returns, fragments",
    [
        ("None", ["returned None", "must return a number"]),
        ("'high'", ["returned 'high'", "must return a number"]),
        ("float('nan')", ["returned nan", "not finite", "skip every update"]),
        ("{'acc': 1.0}", ["dict without 'score'"]),
    ],
)
def test_a_bad_reward_value_is_named_with_the_function_the_file_and_the_sample(tmp_path, returns, fragments):
    path = reward_file(
        tmp_path,
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {returns}\n",
    )
    reward = RewardFunction(str(path), "compute_score")
    with pytest.raises(RuntimeError) as info:
        reward("gsm8k", "#### 42", "42")
    message = str(info.value)
    for fragment in [*fragments, "compute_score", str(path), "data_source='gsm8k'", "'#### 42'", "ground_truth='42'"]:
        assert fragment in message, (fragment, message)


def test_a_raising_reward_keeps_its_cause_and_names_the_sample(tmp_path):
    path = reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return int(solution_str)
    """,
    )
    with pytest.raises(RuntimeError, match="raised ValueError: invalid literal.*response='seven'") as info:
        RewardFunction(str(path))("x", "seven", "7")
    assert isinstance(info.value.__cause__, ValueError)


def test_verl_dict_returns_give_the_score_and_extra_metrics(tmp_path):
    path = reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 0.5, "acc": True, "pred": "42"}
    """,
    )
    assert RewardFunction(str(path))("x", "42", "42") == (0.5, {"score": 0.5, "acc": 1.0})  # verl's extra info


def test_a_hanging_reward_stops_at_the_timeout(tmp_path):
    path = reward_file(
        tmp_path,
        """
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            time.sleep(30)
    """,
    )
    with pytest.raises(RuntimeError, match="took longer than custom_reward_function.timeout_s=0.5"):
        RewardFunction(str(path), timeout_s=0.5)("x", "1", "1")


def test_the_reward_file_is_executed_once(tmp_path):
    counter = tmp_path / "imports.txt"
    path = reward_file(
        tmp_path,
        f"""
        with open({str(counter)!r}, "a") as handle:
            handle.write("imported\\n")
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """,
    )
    load_custom_reward(str(path), "compute_score")  # as the config check does
    RewardFunction(str(path), "compute_score")  # as the trainer does
    assert counter.read_text().count("imported") == 1


def test_malformed_jsonl_data_names_the_file_and_the_line(tmp_path):
    from rlprof_train.data import read_rows

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1="}\n\n{"prompt": "2+2=", \n')
    with pytest.raises(ValueError, match=f"data file {data}, line 3: not valid JSON"):
        read_rows(data)


def test_a_data_source_no_built_in_reward_scores_is_refused_before_any_work(tmp_path, capsys):
    from rlprof_train.main_ppo import main

    data = tmp_path / "train.jsonl"
    rows = [("lighteval/MATH", "\\frac12"), ("aime2024", "9"), ("codecontests", "7"), ("hiyouga/geometry3k", "9")]
    data.write_text(
        "\n".join(json.dumps({"prompt": "q", "data_source": s, "reward_model": {"ground_truth": t}}) for s, t in rows)
    )
    assert (
        main(["--config-name=demo", f"data.train_files={data}", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]) == 2
    )
    (line,) = capsys.readouterr().err.splitlines()
    unrewarded = "has rows of data_source 'codecontests', 'hiyouga/geometry3k', "
    assert line.startswith(f"config error: data.train_files: {data} {unrewarded}")
    assert "(those that exist: rlprof/arithmetic, " in line and "lighteval/MATH" in line
    assert not (tmp_path / "ckpt").exists()  # before any folder is made


def test_hydras_cfg_job_prints_the_translated_config_and_trains_nothing(tmp_path, capsys):
    import yaml

    from rlprof_train.main_ppo import main

    folder = tmp_path / "ckpt"
    argv = [
        "--config-name=demo",
        "actor_rollout_ref.actor.ppo_micro_batch_size=4",
        f"trainer.default_local_dir={folder}",
    ]
    assert main([*argv, "--cfg", "job"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == 4
    assert (
        "actor_rollout_ref.actor.ppo_micro_batch_size=4 is actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"
        in err
    )
    assert not folder.exists()
    assert main([*argv, "--cfg=hydra"]) == 2
    assert (
        capsys.readouterr().err
        == "config error: --cfg 'hydra': only 'job' is printed here (the trainer's config; no Hydra config)\n"
    )


def test_data_without_ground_truth_is_refused_for_the_built_in_rewards(tmp_path, capsys):
    from rlprof_train.main_ppo import main

    data = tmp_path / "train.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": f"{i}+1=", "data_source": "rlprof/arithmetic"}) for i in range(8)) + "\n"
    )
    assert main([f"data.train_files={data}"]) == 2
    assert "no reward_model.ground_truth in any row" in capsys.readouterr().err
    custom = reward_file(tmp_path, "def compute_score(*args, **kwargs):\n    return 1.0\n")
    from rlprof_train.config.load import load_trainer_config
    from rlprof_train.preflight import validate

    validate(
        load_trainer_config(["--config-name=demo", f"data.train_files={data}", f"custom_reward_function.path={custom}"])
    )


# ----------------------------------------------------------------------------------------------- checkpoints on disk


def fake_checkpoint(root, step, files=None):
    """A checkpoint folder as checkpoint.save leaves it, written without engines."""
    target = checkpoint.step_dir(root, step)
    (target / "actor").mkdir(parents=True)
    for name, data in (files or {"actor/model_states.pt": struct.pack("<25f", *[0.5] * 25)}).items():
        (target / name).write_bytes(data)
    (target / checkpoint.STATE).write_text(json.dumps({"global_step": step, "kl_coef": 0.1}))
    checkpoint.mark_complete(target, step)
    (root / checkpoint.LATEST).write_text(str(step))
    return target


def flip_exponent_bits(target) -> None:
    """One bit of the exponent of 16 float32 values flipped in place: the same size, NaN-prone weights."""
    weights = target / "actor/model_states.pt"
    data = bytearray(weights.read_bytes())
    for i in range(3, 64, 4):  # the high byte of each little-endian float32
        data[i] ^= 0x40
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda t: (t / "actor/model_states.pt").write_bytes(b"x" * 10), "has 10 bytes, 100 were written"),
        (flip_exponent_bits, "actor/model_states.pt does not hold what was written"),
        (lambda t: (t / checkpoint.STATE).write_text(""), "trainer_state.json"),
        (lambda t: (t / checkpoint.COMPLETE).unlink(), "never completed"),
        (lambda t: (t / checkpoint.COMPLETE).write_text("{"), "COMPLETE manifest is damaged"),
    ],
)
def test_resume_falls_back_to_the_newest_intact_checkpoint_naming_the_skipped_one(tmp_path, damage, reason):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 3)
    damage(newest)
    (tmp_path / checkpoint.LATEST).write_text("")  # an empty pointer does not matter either
    with pytest.warns(RuntimeWarning, match=f"checkpoint {newest} is skipped: .*{reason}"):
        assert checkpoint.find_resume_dir(tmp_path, "auto") == checkpoint.step_dir(tmp_path, 2)


def test_a_deleted_newest_checkpoint_and_an_explicit_damaged_one(tmp_path):
    import shutil

    fake_checkpoint(tmp_path, 2)
    shutil.rmtree(fake_checkpoint(tmp_path, 3))
    assert checkpoint.find_resume_dir(tmp_path, "auto") == checkpoint.step_dir(tmp_path, 2)
    broken = fake_checkpoint(tmp_path, 4)
    (broken / checkpoint.STATE).write_text("")
    with pytest.raises(checkpoint.CheckpointError, match="global_step_4: cannot resume from it"):
        checkpoint.find_resume_dir(tmp_path, str(broken))


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    (checkpoint.step_dir(tmp_path, 4) / checkpoint.COMPLETE).unlink()  # an unfinished save does not count
    checkpoint.prune(tmp_path, 2)
    assert checkpoint.saved_steps(tmp_path) == [2, 3, 4]


# ----------------------------------------------------------------------------------------------- run lock, store, guard


def test_a_second_holder_is_refused_naming_the_first_and_a_dead_holder_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from rlprof_train.run_dir import RunLock
        RunLock({str(tmp_path)!r}, "trainer.log_dir")
        print("locked", flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            RunInUse,
            match=f"trainer.log_dir={tmp_path} is in use by another run .pid {holder.pid} on host .*, started ",
        ):
            RunLock(tmp_path, "trainer.log_dir")
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path, "trainer.log_dir")  # the kernel released the dead holder's lock
    assert lock.previous["pid"] == holder.pid
    lock.release()
    assert issubclass(RunInUse, ConfigError)


def test_a_helper_process_forked_during_the_run_does_not_keep_the_folder_locked(tmp_path):
    """A reward function that forks a helper (a sandbox server, a pool) used to pass the lock on: the next run on the
    folder was refused ("in use by another run") after the first ended cleanly."""
    import multiprocessing
    import time

    context = multiprocessing.get_context("fork")
    started = context.Event()

    def serve() -> None:
        started.set()
        time.sleep(60)

    lock = RunLock(tmp_path, "trainer.log_dir")
    helper = context.Process(target=serve, daemon=True)
    helper.start()
    try:
        assert started.wait(30)
        lock.release()  # the run ends; its helper lives on
        RunLock(tmp_path, "trainer.log_dir").release()  # the next run takes the folder
    finally:
        helper.kill()
        helper.join()


@pytest.mark.parametrize(
    "flags", [["--master_addr", "127.0.0.1"], ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}"]]
)
def test_torchruns_own_store_listens_on_every_interface_as_the_docs_warn(flags, tmp_path):
    """docs/reliability.md's warning, checked: the launcher's store is not limited to the loopback by its flags."""
    import psutil

    port = free_port()
    flags = [f.format(port=port) for f in flags] + ([] if "--rdzv-endpoint" in flags else ["--master_port", str(port)])
    script = tmp_path / "wait.py"
    script.write_text("import time; time.sleep(30)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", *flags, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(),
    )
    try:
        listening: set[str] = set()
        deadline = time.monotonic() + 60
        while not listening and time.monotonic() < deadline:
            time.sleep(0.5)
            listening = {
                c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
            }
        assert listening and listening - {"127.0.0.1", "::1"}, listening  # "::" or "0.0.0.0": every interface
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.slow  # over 7 s: kept out of the quick loop
def test_a_single_process_run_listens_on_the_loopback_only_and_leaves_no_gloo_thread_at_exit():
    """DeepSpeed's accelerator is the device asked for (``DS_ACCELERATOR``). The store of a run by hand binds
    127.0.0.1 only. And the trainer's exit (barrier, destroy_process_group) leaves no gloo worker thread: one still
    alive while the interpreter finalizes can abort the exit ("terminate called without an active exception"). An
    optimizer's first use imports torch._dynamo, which, imported after the group was made, kept it alive."""
    code = textwrap.dedent("""
        import os, psutil, torch
        from rlprof_train.workers.engine import init_distributed
        env = init_distributed("cpu")
        from deepspeed.accelerator import get_accelerator
        print(os.environ["DS_ACCELERATOR"], get_accelerator().device_name(), env.device)
        print(sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}))
        torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    accelerator, listening, threads = result.stdout.strip().splitlines()[-3:]
    assert accelerator == "cpu cpu cpu"  # DeepSpeed's accelerator follows the trainer's device
    assert listening == "['127.0.0.1']"
    assert "gloo" not in threads, threads


@pytest.mark.slow  # a trainer start: about 15 s
def test_a_launch_without_local_rank_trains_as_rank_0_of_a_world_of_one(tmp_path):
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT without LOCAL_RANK (hand-written launchers, some Slurm scripts):
    DeepSpeed died looking for MPI (``No module named 'mpi4py'``); now LOCAL_RANK is taken as 0 in a world of one."""
    env = subprocess_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = trainer_command(tmp_path, *SMALL_RUN, "trainer.total_training_steps=1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mpi4py" not in result.stderr
    assert len((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()) == 1


def test_the_guard_stops_after_patience_non_finite_steps_and_resets_on_a_finite_one():
    guard = NonFiniteGuard(patience=3)
    guard.check({"actor/pg_loss": float("nan")}, 1)
    guard.check({"actor/pg_loss": 0.5}, 2)
    assert guard.healthy
    guard.check({"actor/grad_norm": float("inf")}, 3)
    guard.check({"actor/pg_loss": float("nan")}, 4)
    assert not guard.healthy
    with pytest.raises(TrainingDiverged, match="3 consecutive steps .3-5.*critic/vf_loss=nan"):
        guard.check({"critic/vf_loss": float("nan")}, 5)
    with pytest.raises(
        TrainingDiverged, match=r"at step 7 \(trainer.nonfinite_patience=1\), last: actor/grad_norm=inf"
    ):
        NonFiniteGuard(patience=1).check({"actor/grad_norm": float("inf")}, 7)


def test_scoped_environment_is_restored(monkeypatch):
    from rlprof_train.workers.rollout.vllm import scoped_environ

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with scoped_environ(VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_KVCACHE_SPACE="1"):
        assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7"


def test_the_zero_gradient_bucket_is_sized_to_the_model_as_transformers_sizes_auto():
    from rlprof_train.workers.engine import deepspeed_config

    zero2 = deepspeed_config(2, True, False, 1.0, "float32", 1, hidden_size=64)["zero_optimization"]
    assert zero2 == {"stage": 2, "reduce_bucket_size": 4096, "offload_optimizer": {"device": "cpu"}}
    zero3 = deepspeed_config(3, False, False, 1.0, "float32", 1, hidden_size=64)["zero_optimization"]
    assert zero3 == {"stage": 3, "reduce_bucket_size": 4096}  # prefetch left to DeepSpeed (see the docstring)
    assert deepspeed_config(1, False, False, 1.0, "float32", 1)["zero_optimization"] == {"stage": 1}  # no model size


def test_overlap_comm_reaches_deepspeed_and_null_keeps_its_default():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from rlprof_train.config.load import load_trainer_config
    from rlprof_train.workers.engine import deepspeed_config

    def overlapped(stage: int, overlap: object) -> bool:
        zero = deepspeed_config(stage, False, False, 1.0, "float32", 2, overlap_comm=overlap)["zero_optimization"]
        return bool(DeepSpeedZeroConfig(**zero).overlap_comm)

    assert [overlapped(s, None) for s in (1, 2, 3)] == [False, False, True]  # DeepSpeed's own default
    assert [overlapped(s, True) for s in (1, 2, 3)] == [True, True, True]
    assert overlapped(3, False) is False
    assert (
        "overlap_comm"
        not in deepspeed_config(0, False, False, 1.0, "float32", 1, overlap_comm=True)["zero_optimization"]
    )
    cfg = load_trainer_config(["actor_rollout_ref.actor.overlap_comm=true"])
    assert cfg.actor_rollout_ref.actor.overlap_comm is True and cfg.critic.overlap_comm is True  # the critic follows


def test_only_zero_1_and_2_on_one_fp32_process_without_offload_run_as_stage_0_where_the_optimizer_clips():
    from rlprof_train.workers.engine import deepspeed_config, zero_stage_to_run

    assert [zero_stage_to_run(stage, 1, "float32", False) for stage in (0, 1, 2, 3)] == [0, 0, 0, 3]
    assert zero_stage_to_run(1, 2, "float32", False) == 1  # two ranks: ZeRO partitions
    assert zero_stage_to_run(1, 1, "bfloat16", False) == 1  # ZeRO keeps the fp32 master copy
    assert zero_stage_to_run(2, 1, "float32", True) == 2  # offload needs ZeRO
    assert deepspeed_config(0, False, False, 1.0, "float32", 1)["gradient_clipping"] == 0.0  # the optimizer clips
    assert deepspeed_config(0, False, False, 1.0, "bfloat16", 1)["gradient_clipping"] == 1.0
    assert deepspeed_config(1, False, False, 1.0, "float32", 2)["gradient_clipping"] == 1.0


def test_the_reverse_task_asks_for_the_digits_reversed_and_scores_each_position():
    from rlprof_train.data import REVERSE_SOURCE, reverse_rows
    from rlprof_train.reward_functions import default_compute_score

    rows = reverse_rows(200, 12, seed=5)
    lengths = set()
    for row in rows:
        digits = row["prompt"].removeprefix("Reverse the digits: ").removesuffix(" ->")
        assert digits.isdigit() and row["reward_model"]["ground_truth"] == digits[::-1]
        assert row["data_source"] == REVERSE_SOURCE
        lengths.add(len(digits))
    assert lengths == set(range(1, 13))  # 1..N digits
    assert rows == reverse_rows(200, 12, seed=5)

    def score(response: str, truth: str = "51413") -> float:
        return default_compute_score(REVERSE_SOURCE, response, truth)

    assert score(" 51413 ") == 1.0
    assert score("51403") == 0.8  # one position wrong
    assert score("5141") == 0.8  # one short: 4 of the 5 positions
    assert score("5141399999") == 0.5  # too long: 5 of 10
    assert score("") == 0.0 and score("x", truth="") == 0.0


@pytest.mark.slow  # over 10 s: kept out of the quick loop
def test_the_reverse_tasks_embedded_model_has_four_layers_and_one_token_per_digit(tmp_path):
    from rlprof_train.models import load_causal_lm, load_tokenizer
    from rlprof_train.tiny_model import create_tiny_model

    out = create_tiny_model(tmp_path / "reverse", task="reverse", max_operand=6, sft_steps=2)
    assert load_causal_lm(out).config.num_hidden_layers == 4
    tokenizer = load_tokenizer(out)
    ids = tokenizer("Reverse the digits: 31415 ->", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).isdigit()] == list("31415")
    with pytest.raises(ValueError, match="built for the tasks arithmetic, reverse"):
        create_tiny_model(tmp_path / "other", task="gsm8k")


@pytest.mark.long  # CI time: in the test command's long runs
def test_the_embedded_model_is_the_same_bytes_whatever_kernels_the_parent_process_chose(tmp_path, monkeypatch):
    """A build with the parent's ATen kernels set to AVX2 and one set to AVX-512 write the same weights (without
    :data:`REPRODUCIBLE_MATH` they differ on a CPU with AVX-512: float sums are ordered by the kernels)."""
    import hashlib

    from rlprof_train.tiny_model import create_tiny_model

    digests = set()
    for capability in ("avx2", "avx512"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        out = create_tiny_model(tmp_path / capability, sft_steps=20)
        digests.add(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1, digests


def test_engine_metrics_are_the_percentiles_sums_and_shares_of_the_requests():
    import numpy as np

    from rlprof_train.workers.rollout.engine_stats import RequestTimes, engine_metrics

    requests = [
        RequestTimes(
            queue_s=0.0, ttft_s=0.02, itl_s=0.004, total_s=0.1, preemptions=0, prompt_tokens=32, cached_tokens=16
        ),
        RequestTimes(
            queue_s=0.05, ttft_s=0.07, itl_s=None, total_s=0.07, preemptions=2, prompt_tokens=16, cached_tokens=0
        ),
        RequestTimes(
            queue_s=0.1, ttft_s=0.12, itl_s=0.006, total_s=0.3, preemptions=1, prompt_tokens=16, cached_tokens=16
        ),
    ]
    metrics = engine_metrics(requests)
    assert metrics["rollout/engine/queue_time_ms_p50"] == pytest.approx(50.0)
    assert metrics["rollout/engine/ttft_ms_p99"] == pytest.approx(np.percentile([20, 70, 120], 99))
    assert metrics["rollout/engine/itl_ms_p50"] == pytest.approx(5.0)  # the one-token request has no gap
    assert metrics["rollout/engine/num_preemptions"] == 3.0
    assert metrics["rollout/engine/prefix_cache_hit_rate"] == pytest.approx(32 / 64)
    assert metrics["rollout/slowest_response_s"] == 0.3
    assert engine_metrics([]) == {}
    assert not any("kv_cache" in key for key in metrics)  # not with the requests: per engine iteration
    with_usage = engine_metrics(requests, kv_cache_usage=[0.0, 0.25, 0.5, 0.25])  # every rank's iterations
    assert with_usage["rollout/engine/kv_cache_usage"] == 0.5  # the peak
    assert with_usage["rollout/engine/kv_cache_usage_mean"] == pytest.approx(0.25)
    assert engine_metrics([], kv_cache_usage=[0.1]) == {
        "rollout/engine/kv_cache_usage": 0.1,
        "rollout/engine/kv_cache_usage_mean": 0.1,
    }


def test_an_error_raised_while_ctrl_c_unwinds_still_exits_as_an_interrupt(capsys):
    """A library's cleanup that fails while a KeyboardInterrupt unwinds (vLLM's tokenizer pool, hit between its
    ``get`` and its ``finally``, raised UnboundLocalError in a CI run) is still Ctrl-C: 130, the traceback kept."""
    from rlprof_train.main_ppo import train
    from rlprof_train.progress import Progress

    def pool_hit_by_ctrl_c() -> None:
        try:
            raise KeyboardInterrupt
        finally:
            raise UnboundLocalError("cannot access local variable 'tok' where it is not associated with a value")

    def plain_error() -> None:
        raise UnboundLocalError("a bug")

    progress = Progress(0, 1, timeout_s=60.0)
    try:
        assert train(pool_hit_by_ctrl_c, 0, progress) == 130
        assert train(plain_error, 0, progress) == 1
    finally:
        progress.close()
    assert "KeyboardInterrupt" in capsys.readouterr().err
