"""verl's own launch scripts of the seed's era (tests/data/verl_scripts/) and of today's
(tests/data/verl_scripts_1dda039b/; both Apache-2.0, unchanged) run on rlprof_train.

Each script is run by bash as published; ``python3 -m verl.trainer.main_ppo`` reaches ``python -m
rlprof_train.main_ppo`` through a ``python3`` first on PATH, and the script's ``$@`` takes the substitutions a user
makes to move it: model and data paths, GPU counts, sizes. The gsm8k parquet files are written in the schema of
verl's ``examples/data_preprocess/gsm8k.py``. Each runs 2 steps, or stops at once with one config error that lists
every key it cannot honour (SGLang rollouts, rollout correction, per-role torch profiler settings). Today's scripts
are run as their users run them: ``VERL_USE_UV=0`` (plain ``python3``, their Ray launch block then passes
``ray_kwargs.ray_init.runtime_env.py_executable=null``), their environment knobs set for this machine, the data files
(GSM8K and MATH, in the schema of verl's ``gsm8k.py`` and ``math_dataset.py``) and 2 steps given as ``$@``. The
seed's multi-turn tool-calling script runs with
``actor_rollout_ref.rollout.name=hf`` or ``vllm`` on data in the schema of verl's
``examples/data_preprocess/gsm8k_multiturn_w_tool.py``, and is refused naming both as published (SGLang)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest
import yaml

from rlprof.manifest import read_manifest

from conftest import ROOT, build_reward_model, free_port, subprocess_env
from wandb_offline import read_run_history

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "data" / "verl_scripts"
RUNS = {  # the seed era's script that trains here: what no script of today's does (nsys with a reward model)
    "examples/ppo_trainer/run_qwen2-7b_rm_seq_balance_nsys.sh": "gae",
}
CHECKED = {  # the seed era's scripts whose estimator today's scripts train: their config, with Hydra's --cfg job
    "examples/ppo_trainer/run_deepseek7b_llm.sh": "gae",
    "examples/ppo_trainer/run_qwen2-7b_seq_balance.sh": "gae",
    "examples/grpo_trainer/run_qwen2-7b_math.sh": "grpo",
    "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh": "grpo",
    "examples/grpo_trainer/run_deepseek7b_llm_seq_balance.sh": "grpo",
    "examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh": "reinforce_plus_plus",
    "examples/rloo_trainer/run_qwen2-7b.sh": "rloo",
    "examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh": "remax",
    "examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh": "grpo",
}
MULTI_TURN = "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh"
REFUSED = {  # script -> the keys its one error must name
    "examples/grpo_trainer/run_qwen2-7b_seq_balance.sh": ("actor_rollout_ref.rollout.name='sglang'",),
    MULTI_TURN: ("actor_rollout_ref.rollout.name='sglang'", "use vllm", "or hf"),
}
TODAY = ROOT / "tests" / "data" / "verl_scripts_1dda039b"
TODAY_RUNS = {  # today's scripts that train, with what they select
    "examples/ppo_trainer/run_qwen3_8b_fsdp.sh": "gae",
    "examples/grpo_trainer/run_qwen3_8b_fsdp.sh": "grpo",
    "examples/tuning/lora/run_qwen3_8b_from_adapter_fsdp.sh": "grpo, LoRA from a saved adapter",
    "examples/grpo_trainer/run_mistral_nemo_12b_skyworkrm_fsdp.sh": "grpo, reward.reward_model",
    "examples/profile/run_qwen2_5_7b_torch_profile.sh": "grpo, the torch tool on steps 1-2, the vLLM engine's too",
    "examples/rollout_correction/run_qwen2_5_7b_fsdp.sh": "rloo, rollout correction: sequence weights normalised, "
    "bypass mode, reinforce loss",
}
TODAY_CHECKED = {  # today's scripts that differ from a trained one in what is compared with verl's functions (the
    # estimators in test_verl_estimators.py): their config with --cfg job here, two steps with -m long
    "examples/reinforce_plus_plus_trainer/run_qwen3_8b_fsdp.sh": "reinforce_plus_plus",
    "examples/rloo_trainer/run_qwen3_8b_fsdp.sh": "rloo",
    "examples/remax_trainer/run_qwen3_8b_fsdp.sh": "remax",
    "examples/rollout_correction/run_qwen2_5_7b_fsdp_multi_rs.sh": "grpo",  # beside the one above: token weights,
    # token_k1 and seq_max_k2 rejection, bypass mode with PPO's clip (each compared with verl's functions)
    "examples/gspo_trainer/run_qwen3_8b_fsdp.sh": "grpo, loss_mode=gspo",  # the grpo script's with another policy
    "examples/cispo_trainer/run_qwen3_8b_fsdp.sh": "grpo, loss_mode=cispo",  # loss (test_verl_policy_losses.py)
}
PROFILE = "examples/profile/run_qwen2_5_7b_torch_profile.sh"
FINISH_HOOK = TODAY / "tests" / "special_e2e" / "profiler_finish_hook_marker.sh"
"""verl's own finish-hook command for its profiler tests: a marker per role and rank under save_path."""
PROFILE_KNOBS = {  # the profiling script as the pool runs it: verl's finish hook, a schedule and a token window
    "PROFILE_FINISH_HOOK_CMD": str(FINISH_HOOK),
    "PPO_MINI_BATCH_SIZE": "2",  # two update mini-batches a step ...
    "PROFILE_SCHED_SKIP_FIRST": "1",  # ... of which the trace keeps the second alone
    "PROFILE_SCHED_ACTIVE": "1",
    "PROFILE_ROLLOUT_TOKEN_START": "2",  # the engine's trace: three of its eight iterations
    "PROFILE_ROLLOUT_TOKEN_END": "5",
}
PROFILE_DISCRETE = {"PROFILE_DISCRETE": "True", "PROFILE_ROLLOUT": "False"}
"""The profiling script with discrete training traces (the pool's second run of it)."""
PROFILE_REFUSED = {  # the profiling script's knobs set to what is not here -> what its one error names
    "PROFILE_CONTENTS=['cpu','stack']": [
        "actor_rollout_ref.actor.profiler.tool_config.torch.contents=['cpu', 'stack']",
        "actor_rollout_ref.rollout.profiler.tool_config.torch.contents=['cpu', 'stack']",
    ],
    "PROFILE_DISCRETE=True PROFILE_SCHED_ACTIVE=2": [
        "the actor role's profiler.tool_config.torch.schedule: a schedule over mini-batches with discrete torch "
        "traces is not implemented here",
    ],
}
QUESTIONS = [(f"What is {a} plus {b}?", a + b) for a in range(4) for b in range(4)]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

PYTHON3_SHIM = """#!/bin/sh
# verl's entry points, moved: python3 -m verl.trainer.main_ppo ARGS -> python -m rlprof_train.main_ppo ARGS; its
# one-step-off trainer's (docs/trainer.md's rule) -> python -m rlprof_train.one_step_off_policy ARGS under torchrun
if [ "$1" = "-m" ] && [ "$2" = "verl.trainer.main_ppo" ]; then
    shift 2
    printf '%s\\0' "$@" > .verl_arguments  # what the script passed, for the tally of its keys
    exec "$RLPROF_PYTHON" -m rlprof_train.main_ppo "$@"
fi
if [ "$1" = "-m" ] && [ "$2" = "verl.experimental.one_step_off_policy.main_ppo" ]; then
    shift 2
    printf '%s\\0' "$@" > .verl_arguments
    exec "$RLPROF_PYTHON" -m torch.distributed.run --nproc_per_node "$RLPROF_PROCESSES" \\
        --master_port "$RLPROF_PORT" -m rlprof_train.one_step_off_policy "$@"
fi
exec "$RLPROF_PYTHON" "$@"
"""


SYSTEM = "Use the `calc_gsm8k_reward` tool, then put your final answer as `#### <answer>`."
"""verl's gsm8k_multiturn_w_tool.py system prompt, shortened to fit the tiny model's 256 positions."""


def write_gsm8k(folder: Path, with_tools: bool = False) -> None:
    """train/test parquet with the columns verl's gsm8k preprocessing writes (``with_tools``: those of its
    ``gsm8k_multiturn_w_tool.py``, a system prompt and each row's ``tools_kwargs``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for split, rows in (("train", QUESTIONS), ("test", QUESTIONS[:8])):
        records = []
        for i, (question, answer) in enumerate(rows):
            extra = {"split": split, "index": i, "answer": f"#### {answer}", "question": question}
            prompt = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
            if with_tools:
                prompt.insert(0, {"role": "system", "content": SYSTEM})
                extra |= {
                    "need_tools_kwargs": True,
                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": str(answer)}}},
                }
            records.append(
                {
                    "data_source": "openai/gsm8k",
                    "prompt": prompt,
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(answer)},
                    "extra_info": extra,
                }
            )
        pq.write_table(pa.Table.from_pylist(records), folder / f"{split}.parquet")


def write_math(folder: Path) -> None:
    """train/test parquet with the columns verl's ``examples/data_preprocess/math_dataset.py`` writes (its data
    source, its instruction, the answer as the ground truth)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    instruction = "Let's think step by step and output the final answer within \\boxed{}."
    for split, rows in (("train", QUESTIONS), ("test", QUESTIONS[:8])):
        records = [
            {
                "data_source": "DigitalLearningGmbH/MATH-lighteval",
                "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i},
            }
            for i, (question, answer) in enumerate(rows)
        ]
        pq.write_table(pa.Table.from_pylist(records), folder / f"{split}.parquet")


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """gsm8k and MATH data, the embedded tiny model, a LoRA adapter of it, a reward model, and the python3 shim."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlprof_train.tiny_model import create_tiny_model

    root = tmp_path_factory.mktemp("verl")
    write_gsm8k(root / "data" / "gsm8k")
    write_gsm8k(root / "data" / "gsm8k_multiturn", with_tools=True)
    write_math(root / "data" / "math")
    model = create_tiny_model(root / "model", sft_steps=0)
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=4, target_modules="all-linear"))
    adapter.save_pretrained(root / "adapter")
    texts = [f"{q} {INSTRUCTION}" for q, _ in QUESTIONS]
    reward_model = build_reward_model(root / "reward_model", texts)
    shim = root / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(PYTHON3_SHIM)
    shim.chmod(0o755)
    return root, model, reward_model


def substitutions(root: Path, model: Path, reward_model: Path) -> list[str]:
    """What a user moving a script changes: paths, GPU counts, sizes (appended: the script's ``$@``)."""
    data = root / "data" / "gsm8k"
    return [
        f"actor_rollout_ref.model.path={model}",
        f"critic.model.path={model}",
        f"reward_model.model.path={reward_model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_prompt_length=192",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.max_model_len=null",
        "trainer.total_training_steps=2",
    ]


def todays_knobs(root: Path, model: Path, reward_model: Path) -> dict[str, str]:
    """What a user of today's scripts sets: no uv, the environment knobs the scripts read, sized for this machine."""
    data = root / "data"
    return {
        "VERL_USE_UV": "0",
        "MODEL_PATH": str(model),
        "REWARD_MODEL_PATH": str(reward_model),
        "LORA_ADAPTER_PATH": str(root / "adapter"),
        "NNODES": "1",
        "NDEVICES_PER_NODE": "1",
        "NGPUS_PER_NODE": "1",
        "TRAIN_BATCH_SIZE": "4",
        "PPO_MINI_BATCH_SIZE": "4",
        "PPO_MICRO_BATCH_SIZE_PER_GPU": "2",
        "LOG_PROB_MICRO_BATCH_SIZE_PER_GPU": "2",
        "MAX_PROMPT_LENGTH": "192",
        "MAX_RESPONSE_LENGTH": "8",
        "ROLLOUT_TP": "1",
        "ROLLOUT_N": "2",
        "REWARD_PROMPT_LENGTH": "256",
        "REWARD_RESPONSE_LENGTH": "64",
        "GSM8K_TRAIN_FILE": str(data / "gsm8k" / "train.parquet"),
        "GSM8K_TEST_FILE": str(data / "gsm8k" / "test.parquet"),
        "MATH_TRAIN_FILE": str(data / "math" / "train.parquet"),
        "MATH_TEST_FILE": str(data / "math" / "test.parquet"),
        "TRAIN_FILE": str(data / "gsm8k" / "train.parquet"),
        "TEST_FILE": str(data / "gsm8k" / "test.parquet"),
        "PROFILE_SAVE_PATH": "profile",  # in the script's working folder
    }


SIZED_BY_ARGUMENTS = (  # the rollout-correction scripts read no knobs: their sizes are set as their users would
    "data.max_prompt_length=192",
    "data.max_response_length=8",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # two updates a step: the second off-policy, as verl's 128 / 32
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
)


ONE_STEP_OFF = "verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh"
"""verl's one-step-off GRPO script: run in its one-step-off form (the shim's second rule)."""
ONE_STEP_OFF_SIZES = (  # a user's $@ moving it to 2 CPU processes: one trains, one generates (verl's 6 + 2 GPUs)
    "trainer.n_gpus_per_node=1",
    "rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "data.max_prompt_length=192",
    "data.max_response_length=8",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2",
)


def todays_arguments(root: Path, name: str) -> list[str]:
    """Today's script ``name``'s ``$@``: the data (one script reads it from ``$HOME/data``), 2 steps, vLLM's length
    from the model, and the sizes of a script with no knobs for them."""
    if name == ONE_STEP_OFF:  # its $@ unquoted, split at spaces: its data from TRAIN_FILE/TEST_FILE, no lists
        return ["actor_rollout_ref.rollout.max_model_len=null", "trainer.total_training_steps=2", *ONE_STEP_OFF_SIZES]
    files = {
        split: [str(root / "data" / d / f"{split}.parquet") for d in ("gsm8k", "math")] for split in ("train", "test")
    }
    return [
        f"data.train_files={files['train']}",
        f"data.val_files={files['test']}",
        "actor_rollout_ref.rollout.max_model_len=null",
        "trainer.total_training_steps=2",
        *(SIZED_BY_ARGUMENTS if name.startswith("examples/rollout_correction/") else ()),
    ]


SEED_APPENDED = len(substitutions(Path(), Path(), Path()))
"""How many arguments the seed era's scripts are given as ``$@``."""


def tally(work: Path, output: str, appended: int = SEED_APPENDED) -> str:
    """What became of the script's own keys (the arguments it passed, less the ``appended`` ones of ``$@``): the
    closing table's row."""
    arguments = (work / ".verl_arguments").read_text().split("\0")[:-1]
    own = arguments[: len(arguments) - appended]
    keys = {a.split("=", 1)[0].lstrip("+") for a in own if "=" in a and not a.startswith("-")}
    aliased = {k for k in keys if re.search(rf"\[INFO\] config: {re.escape(k)}=.* is \S+=", output)}
    no_effect = re.search(r"verl settings with no effect here: (.*)", output)
    ignored = {k for k in keys if no_effect and re.search(rf"(^|; ){re.escape(k)} \(", no_effect.group(1))}
    error = next((line for line in output.splitlines() if line.startswith("config error:")), "")
    refused = {k for k in keys if re.search(rf"(^config error: |\) ){re.escape(k)}=", error)}
    accepted = len(keys) - len(aliased) - len(ignored) - len(refused)
    return (
        f"{len(keys)} keys: {accepted} accepted, {len(aliased)} aliased, {len(ignored)} no-op, {len(refused)} refused"
    )


def run_script(
    name: str, place, work: Path, *more: str, today: bool = False, knobs: Optional[dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """Run the seed era's script ``name`` with :func:`substitutions` and ``more`` as its ``$@``, or (``today``)
    today's with :func:`todays_knobs` and ``knobs`` in its environment and :func:`todays_arguments`."""
    root, model, reward_model = place
    script = (TODAY if today else SCRIPTS) / name
    work.mkdir()
    if "sglang_multiturn" in name:  # the script reads its config from $PWD/examples/sglang_multiturn/config
        shutil.copytree(SCRIPTS / "examples", work / "examples")
    env = subprocess_env(  # HOME stays: DeepSpeed's and vLLM's build caches live there (the data paths are given)
        PATH=f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}",
        RLPROF_PYTHON=sys.executable,
        WANDB_MODE="offline",
        WANDB_DIR=str(work),
        OMP_NUM_THREADS="1",
        **((todays_knobs(root, model, reward_model) if today else {}) | (knobs or {})),  # a script's own knobs win
    )
    appended = todays_arguments(root, name) if today else substitutions(root, model, reward_model)
    command = ["bash", str(script), *appended, *more]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=work, env=env)


CONCURRENT = 2
"""Scripts run at once: each spends most of its time starting vLLM (imports in two spawned processes, one core
each), so two side by side on two cores take about half the time of one after the other."""


MULTI_TURN_ROLLOUTS = ("hf", "vllm") if importlib.util.find_spec("vllm") else ("hf",)


@pytest.fixture(scope="module")
def script_runs(place, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every script of RUNS, and the multi-turn script with each rollout of MULTI_TURN_ROLLOUTS (keys ``hf``,
    ``vllm``), each in a work folder of its own, CONCURRENT at a time: key -> (result, work)."""
    root = tmp_path_factory.mktemp("scripts")
    data = place[0] / "data" / "gsm8k_multiturn"
    jobs: dict[str, tuple[str, tuple[str, ...], bool]] = {name: (name, (), False) for name in sorted(RUNS)}
    jobs |= {f"today:{name}": (name, (), True) for name in sorted(TODAY_RUNS)}
    jobs["today-discrete:" + PROFILE] = (PROFILE, (), True)
    jobs |= {
        rollout: (
            MULTI_TURN,
            (
                f"actor_rollout_ref.rollout.name={rollout}",
                f"data.train_files={data / 'train.parquet'}",
                f"data.val_files={data / 'test.parquet'}",
            ),
            False,
        )
        for rollout in MULTI_TURN_ROLLOUTS
    }

    def one(
        index: int, key: str, name: str, more: tuple[str, ...], today: bool
    ) -> tuple[subprocess.CompletedProcess, Path]:
        work = root / f"{index}" / "work"
        work.parent.mkdir()
        knobs = (PROFILE_DISCRETE if key.startswith("today-discrete:") else PROFILE_KNOBS) if name == PROFILE else None
        return run_script(name, place, work, *more, today=today, knobs=knobs), work

    with ThreadPoolExecutor(CONCURRENT) as pool:
        futures = {key: pool.submit(one, i, key, *job) for i, (key, job) in enumerate(jobs.items())}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_verl_script_runs_two_steps(name, script_runs):
    result, work = script_runs[name]
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    history = wandb_history(work)
    steps = [row["_step"] for row in history if "critic/score/mean" in row]
    assert steps == [1, 2], steps
    print(f"\n{name} ({RUNS[name]}): {tally(work, output)}, ran 2 steps")


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_verl_scripts_config_is_read_as_verl_means_it(name, place, tmp_path):
    """The script as a user moves it, with Hydra's ``--cfg job``: its config translated and checked, printed, nothing
    trained (its estimator trains in today's script of the same kind)."""
    result = run_script(name, place, tmp_path / "work", "--cfg", "job")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    printed = printed_config(result.stdout)
    assert printed["algorithm"]["adv_estimator"] == CHECKED[name]
    assert printed["trainer"]["total_training_steps"] == 2 and printed["data"]["train_batch_size"] == 4
    assert not (tmp_path / "work" / "outputs").exists()  # nothing written
    keys = tally(tmp_path / "work", result.stdout + result.stderr, SEED_APPENDED + 2)  # one script tees stderr
    print(f"\n{name} ({CHECKED[name]}): {keys}, checked")


@pytest.mark.parametrize("name", sorted(TODAY_RUNS))
def test_todays_verl_script_runs_two_steps_as_its_users_run_it(name, script_runs):
    check_todays_run(name, *script_runs[f"today:{name}"], TODAY_RUNS[name])


@pytest.mark.parametrize("name", sorted(TODAY_CHECKED))
def test_todays_verl_scripts_config_is_read_as_verl_means_it(name, place, tmp_path):
    result = run_script(name, place, tmp_path / "work", "--cfg", "job", today=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    printed = printed_config(result.stdout)
    estimator, _, loss = TODAY_CHECKED[name].partition(", loss_mode=")
    assert printed["algorithm"]["adv_estimator"] == estimator
    assert printed["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == (loss or "vanilla")
    assert printed["trainer"]["total_training_steps"] == 2
    assert not (tmp_path / "work" / "outputs").exists()  # nothing written
    keys = tally(tmp_path / "work", result.stdout + result.stderr, len(todays_arguments(Path(), name)) + 2)
    print(f"\n{name} ({TODAY_CHECKED[name]}): {keys}, checked")


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(TODAY_CHECKED))
def test_todays_verl_script_checked_above_also_runs_two_steps(name, place, tmp_path):
    work = tmp_path / "work"
    check_todays_run(name, run_script(name, place, work, today=True), work, TODAY_CHECKED[name])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the script's rollout is vLLM")
def test_verls_one_step_off_grpo_script_trains_two_steps_with_a_trainer_and_a_vllm_rollout_process(place, tmp_path):
    """verl's one-step-off GRPO script (grpo_0.6b_gsm8k_fsdp2_2_6.sh) as a verl user runs it here: its entry module
    replaced by docs/trainer.md's rule (under torchrun), the embedded model and GSM8K data, sizes for 2 processes as
    its ``$@``: every key of it applied, aliased or named as a no-op (none refused), 2 steps with a vLLM engine in the
    rollout process, each next batch sampled while the trainer trains (staleness 0, then 1), validation before and
    after, sampled by the rollout pool."""
    work = tmp_path / "work"
    knobs = {"NGPUS_PER_NODE": "2", "RLPROF_PROCESSES": "2", "RLPROF_PORT": str(free_port())}
    result = run_script(ONE_STEP_OFF, place, work, today=True, knobs=knobs)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    keys = tally(work, output, len(todays_arguments(Path(), ONE_STEP_OFF)))
    assert keys.endswith(", 0 refused"), keys
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in work.rglob("events.out.tfevents.*")}  # the script's ['console','tensorboard']
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    staleness = [(e.step, e.value) for e in accumulator.Scalars("training/off_policy/trajectory_staleness/max")]
    assert staleness == [(1, 0.0), (2, 1.0)]
    assert [e.step for e in accumulator.Scalars("val-core/openai/gsm8k/reward/mean@1")] == [0, 2]
    record = json.loads(next(work.rglob("run.json")).read_text())
    assert record["processes"] == {"trainer": 1, "rollout": 1, "per_node": 2} and record["rollout"]["name"] == "vllm"
    print(f"\n{ONE_STEP_OFF}: {keys}, ran 2 steps one-step-off")


def check_todays_run(name: str, result: subprocess.CompletedProcess, work: Path, selects: str) -> None:
    """Today's script ``name`` trained two steps (and named its Ray launch block as not applying)."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    if any(a.startswith("ray_kwargs.") for a in (work / ".verl_arguments").read_text().split("\0")):
        assert "ray_kwargs.ray_init.runtime_env.py_executable (a Ray placement detail" in output  # the launch block
    history = wandb_history(work)
    steps = [row["_step"] for row in history if "critic/score/mean" in row]
    assert steps == [1, 2], steps
    print(f"\n{name} ({selects}): {tally(work, output, len(todays_arguments(Path(), name)))}, ran 2 steps")
    if name == PROFILE:  # its traces: the trainer's per profiled step, the vLLM engine's beside them
        written = read_manifest(work / "profile")
        trainer = sorted((tuple(r["steps"]), r["path"]) for r in written if r["tool"] == "torch")
        engine = sorted(
            (tuple(r["steps"]), r["path"])
            for r in written
            if r["tool"] == "vllm_torch" and r["format"] == "chrome_trace"
        )
        # the schedule: the trainer's trace of each step holds the second update mini-batch alone (skip_first=1,
        # active=1; what ran before it, the rollout included, is not kept, as in verl)
        assert [(steps, Path(path).name) for steps, path in trainer] == [
            ((1,), "rank0.mb1.pt.trace.json.gz"),
            ((2,), "rank0.mb1.pt.trace.json.gz"),
        ], written
        for _, path in trainer:
            held = set(annotation_names(work / "profile" / path))
            assert "actor/mini_batch1" in held and not {"actor/mini_batch0", "rollout/generate_sequences"} & held
        # the token window [2, 5): three engine iterations (of the eight of 8-token responses), all decoding
        assert [steps for steps, _ in engine] == [(1,), (2,)], written
        for _, path in engine:
            iterations = [n for n in annotation_names(work / "profile" / path) if n.startswith("execute_")]
            assert len(iterations) == 3 and all(n.startswith("execute_context_0(0)") for n in iterations), iterations
        # its finish hook (verl's marker script) ran once, after step 2, on the profiled rank, its roles named
        (hook,) = read_manifest(work / "profile", kind="finish_hook")
        assert hook["returncode"] == 0 and hook["command"] == str(FINISH_HOOK), hook
        (marker,) = [p.name for p in (work / "profile" / "finish_hook_markers").iterdir()]
        assert marker.startswith("finish_hook_ran_actor") and marker.endswith("_rank0"), marker
        assert "[rlprof][finish_hook] rank 0: exited with 0" in output


def test_the_profiling_scripts_discrete_mode_gives_each_stage_its_own_trace(script_runs):
    """PROFILE_DISCRETE=True: each phase of a profiled step (verl's stages) is a trace of its own."""
    result, work = script_runs["today-discrete:" + PROFILE]
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    written = [r for r in read_manifest(work / "profile") if r["tool"] == "torch"]
    stages = {(tuple(r["steps"]), r["role"], Path(r["path"]).name.split(".")[2]) for r in written}
    # the actor's block is discrete (the reference's and the trainer's own blocks are not); the rollout is not
    # profiled (PROFILE_ROLLOUT=False)
    assert stages == {((step,), "actor", phase) for step in (1, 2) for phase in ("old_log_prob", "update_actor")}
    for record in written:
        held = set(annotation_names(work / "profile" / record["path"]))
        assert not any(n.startswith("ProfilerStep#") for n in held)
        if record["path"].endswith(".actor.update_actor.pt.trace.json.gz"):
            assert {"actor/update_actor", "actor/mini_batch0"} <= held, held
    assert not [r for r in read_manifest(work / "profile") if r["tool"] == "vllm_torch"]  # PROFILE_ROLLOUT=False


@pytest.mark.parametrize("knobs", sorted(PROFILE_REFUSED))
def test_the_profiling_scripts_settings_that_are_not_here_are_named(place, tmp_path, knobs):
    """The profiling script with knobs that ask for what this trainer does not do: one error naming every key
    (and nothing else), at once."""
    given = dict(knob.split("=", 1) for knob in knobs.split())
    result = run_script(PROFILE, place, tmp_path / "work", today=True, knobs=given)
    assert result.returncode == 2, (result.stdout + result.stderr)[-4000:]
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert [named for named in PROFILE_REFUSED[knobs] if named not in error] == [], error
    count = len(PROFILE_REFUSED[knobs])
    assert error.startswith(f"config error: {count} problems: " if count > 1 else "config error: "), error


def annotation_names(trace: Path) -> list[str]:
    """The names of a Chrome trace's annotations (rlprof's ranges, vLLM's iterations), one per occurrence."""
    raw = trace.read_bytes()
    events = json.loads(gzip.decompress(raw) if trace.suffix == ".gz" else raw)["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "user_annotation"]


def printed_config(stdout: str) -> dict:
    """The config ``--cfg job`` printed (YAML from its ``data:`` section on), without what the script echoes after
    the trainer returns (a line that is neither indented nor a top-level key)."""
    lines = stdout[stdout.index("data:\n") :].splitlines()
    end = next((i for i, line in enumerate(lines) if line and not re.match(r"( |[a-z_]+:( |$))", line)), len(lines))
    return yaml.safe_load("\n".join(lines[:end]))


def wandb_history(work: Path) -> list[dict]:
    (record,) = (work / "outputs" / "logs").rglob("wandb_run.json")  # the scripts log to wandb
    run_id = json.loads(record.read_text())["run_id"]
    (files,) = {p.parent for p in work.rglob(f"*-{run_id}") if p.is_dir()}  # under $WANDB_DIR
    return read_run_history(files, run_id)


@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_the_seeds_multi_turn_script_runs_with_the_hf_and_vllm_rollouts(rollout, script_runs):
    """The seed's worked example, verl's script as published (its YAML config, verl's GSM8K tool config, the
    torch_memory tool and wandb), with only the rollout's name and the moves of a user substituted."""
    if rollout not in MULTI_TURN_ROLLOUTS:
        pytest.skip("vLLM is not installed")
    result, work = script_runs[rollout]
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "rollout: multi-turn (hermes tool calls) with calc_gsm8k_reward" in output
    history = [row for row in wandb_history(work) if "critic/score/mean" in row]
    assert [row["_step"] for row in history] == [1, 2]
    assert all(row["num_turns/min"] >= 2 and "tool_call_counts/mean" in row for row in history), history
    snapshots = list((work / "mem_snapshots").rglob("*"))
    assert any(p.is_file() for p in snapshots), "the seed's torch_memory tool recorded nothing"
    print(f"\n{MULTI_TURN} (rollout.name={rollout}): {tally(work, output, SEED_APPENDED + 3)}, ran 2 steps")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_verl_script_it_cannot_run_stops_with_one_error_naming_every_key(name, place, tmp_path):
    result = run_script(name, place, tmp_path / "work")
    assert result.returncode == 2, (result.stdout + result.stderr)[-6000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1, result.stderr[-4000:]
    print(f"\n{name}: {tally(tmp_path / 'work', result.stderr)}; {errors[0]}")
    assert [key for key in REFUSED[name] if key not in errors[0]] == []
