"""Everything checked before any work starts that a key's type and range cannot say: what spans several keys (batch
arithmetic, the estimator and the critic), needs the file system (the model, data and reward files, the checkpoint
to resume) or a registry (the rollout backend's own preflight, next to its registration; the tracking backends; the
profiler's config). :func:`validate` runs every check and names each problem found in one
:class:`~rlprof.typed_config.ConfigError` line, before any model is loaded or process group used.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from rlprof.config import load_config as load_profiler_config
from rlprof.tools import tool_spec
from rlprof.tools.torch_profiler import token_window
from rlprof.tracking import parse_backends
from rlprof.typed_config import ConfigError, one_message
from rlprof_train import algos, rollout_correction
from rlprof_train.config.load import training_device
from rlprof_train.config.schema import TrainerConfig, TrainerMode, as_dict
from rlprof_train.launch import launch_world
from rlprof_train.workers.rollout.registry import check_rollout, rollout_names, rollout_spec

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=@-]*$")


class _Problems(ValueError):
    """Every problem of one group of settings (each its own numbered item of the one error)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {allowed}")


def validate(cfg: TrainerConfig, world_size: int = 1, mode: TrainerMode = "sync") -> None:
    """Reject a config that cannot run, before any model is loaded or process group used; ``mode``: the trainer
    (an asynchronous one's trainer pool is the launch's ``world_size`` less its rollout pool)."""
    problems = []
    launched, pool = world_size, cfg.rollout
    rollout_processes = pool.nnodes * pool.n_gpus_per_node
    if not (mode != "sync" and 1 <= rollout_processes < world_size):
        rollout_processes = 0  # no rollout pool (or one the pool check refuses)
    world_size -= rollout_processes  # the batch arithmetic is the trainer pool's
    checks = (
        lambda: _check_pools(cfg, launched, mode),
        lambda: _import_user_code(cfg),
        lambda: _check_strategy(cfg),
        lambda: _check_device(cfg, launched, rollout_processes),
        lambda: check_rollout(cfg),
        lambda: _check_batches(cfg, world_size),
        lambda: _check_algorithm(cfg),
        lambda: _check_rollout_correction(cfg, world_size),
        lambda: _check_dapo(cfg, world_size),
        lambda: _check_names_and_paths(cfg),
        lambda: _check_inputs(cfg),
        lambda: _check_reward_model(cfg),
        lambda: _check_multi_turn(cfg),
        lambda: parse_backends(cfg.trainer.logger),
        lambda: _check_rollout_prometheus(cfg),
        lambda: _check_profiler(cfg, launched),  # rlprof's ranks are the launch's
    )
    for check in checks:  # each group stops at its first problem (or names all of its own); they are independent
        try:
            check()
        except _Problems as exc:
            problems += exc.problems
        except ValueError as exc:  # ConfigError, and the data and reward loaders' ValueErrors
            problems.append(str(exc))
    if problems:
        raise ConfigError(one_message(problems))


def _check_pools(cfg: TrainerConfig, world_size: int, mode: TrainerMode) -> None:
    """The asynchronous trainers: a rollout pool of 1 to ``world_size - 1`` of the launch's processes
    (:mod:`rlprof_train.pools`), and only what its rollout pool runs (the backends registered ``pooled``, one
    generation round a step, the whole policy); the fully-async one's pipeline (:func:`_check_pipeline`). (``main_ppo``
    refuses the pool's keys as it loads them.)"""
    if mode == "sync":
        return
    from rlprof_train.pools import rollout_pool_size

    pool, arr = cfg.rollout, cfg.actor_rollout_ref
    problems = []
    try:
        rollout_pool_size(pool.nnodes, pool.n_gpus_per_node, world_size)
    except ConfigError as exc:
        problems.append(str(exc))
    not_built = "is not built for the one-step-off trainer's rollout pool yet"
    if arr.rollout.name in rollout_names() and not rollout_spec(arr.rollout.name).pooled:
        pooled = ", ".join(name for name in rollout_names() if rollout_spec(name).pooled)
        problems.append(f"actor_rollout_ref.rollout.name={arr.rollout.name!r}: {not_built} ({pooled} is)")
    if cfg.algorithm.filter_groups.enable:
        problems.append(f"algorithm.filter_groups.enable=True: {not_built} (one generation round a step)")
    if mode == "fully_async":
        problems += _pipeline_problems(cfg)
    elif cfg.data.gen_batch_size not in (None, cfg.data.train_batch_size):
        problems.append(
            f"data.gen_batch_size={cfg.data.gen_batch_size}: {not_built} (one generation round of "
            f"data.train_batch_size={cfg.data.train_batch_size} prompts a step)"
        )
    if arr.model.lora_rank > 0:
        problems.append(f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank}: LoRA {not_built}")
    if problems:
        raise _Problems(problems)


def _pipeline_problems(cfg: TrainerConfig) -> list[str]:
    """The fully-async trainer's pipeline: partial rollouts where a group can be continued (a backend that
    continues token sequences), and its prompts one group at a time (verl's ``data.gen_batch_size=1``)."""
    problems = []
    rollout = cfg.actor_rollout_ref.rollout
    if cfg.async_training.partial_rollout:
        continuing = [name for name in rollout_names() if rollout_spec(name).continues and rollout_spec(name).pooled]
        if rollout.name in rollout_names() and rollout.name not in continuing:
            problems.append(
                f"async_training.partial_rollout=True: actor_rollout_ref.rollout.name={rollout.name!r} cannot continue "
                f"a trajectory on new weights ({', '.join(continuing)} can); set partial_rollout=false"
            )
    if cfg.data.gen_batch_size not in (None, 1):
        problems.append(
            f"data.gen_batch_size={cfg.data.gen_batch_size}: the fully-async trainer's rollout pool samples one prompt "
            "group at a time (verl's only value, 1); set it to 1 or leave it out"
        )
    return problems


def strategy_conflicts(cfg: TrainerConfig) -> list[str]:
    """What the DeepSpeed strategy and the rollout backend's preflight refuse in ``cfg``: checks of the config alone
    (no files, no devices), which ``tune`` runs on a candidate before trying it."""
    problems = []
    for check in (_check_strategy, check_rollout):
        try:
            check(cfg)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def _import_user_code(cfg: TrainerConfig) -> None:
    """The custom reward file first: besides its reward function it may register what the other checks look up
    (an advantage estimator, a rollout backend, a tracking backend, a profiler tool)."""
    custom = cfg.custom_reward_function
    if custom.path is not None:
        from rlprof_train.reward_functions import load_custom_reward

        load_custom_reward(custom.path, custom.name)


def _check_device(cfg: TrainerConfig, world_size: int, rollout_processes: int) -> None:
    """``trainer.device=cuda`` needs a CUDA build of torch that sees a GPU for each process of the node; the
    one-step-off trainer's two pools (``rollout_processes`` of the launch's ``world_size`` generate) may share them
    (:func:`rlprof_train.pools.device_index`), a GPU for each process of a pool on the node."""
    if training_device(cfg) != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise _fail("trainer.device", "cuda", f"no CUDA device is visible here ({build}); use auto or cpu")
    per_node, visible = launch_world().per_node, torch.cuda.device_count()
    if rollout_processes:
        from rlprof_train.pools import sharing_problem

        problem = sharing_problem(world_size, per_node, rollout_processes, visible)
        if problem:
            raise _fail("trainer.device", "cuda", problem)
    elif per_node > visible:
        raise _fail(
            "trainer.device",
            "cuda",
            f"{per_node} processes on this node and {visible} GPU{'s' if visible != 1 else ''} visible: one GPU per "
            f"process; launch at most {visible} (torchrun --nproc_per_node {visible})",
        )


def _check_strategy(cfg: TrainerConfig) -> None:
    actor = cfg.actor_rollout_ref.actor
    if actor.strategy != "deepspeed":
        raise _fail(
            "actor_rollout_ref.actor.strategy",
            actor.strategy,
            "this trainer runs the actor and critic on DeepSpeed; use strategy=deepspeed and choose the "
            "sharding with actor_rollout_ref.actor.zero_stage=0|1|2|3 (FSDP's full sharding = ZeRO 3), "
            "offload with actor.offload_param / actor.offload_optimizer",
        )
    if actor.fsdp_config.forward_prefetch:
        raise _fail(
            "actor_rollout_ref.actor.fsdp_config.forward_prefetch",
            True,
            "an FSDP setting; DeepSpeed ZeRO 3 prefetches parameters by itself, so leave it false",
        )
    if actor.fsdp_config.offload_policy and actor.zero_stage != 3:
        raise _fail(
            "actor_rollout_ref.actor.fsdp_config.offload_policy",
            True,
            "maps to DeepSpeed parameter + optimizer offload to the host, which needs "
            "actor_rollout_ref.actor.zero_stage=3 (DeepSpeedCPUAdam is built on first use)",
        )
    if actor.offload_param and actor.zero_stage != 3:
        raise _fail("actor_rollout_ref.actor.offload_param", True, "parameter offload needs zero_stage=3")
    if cfg.actor_rollout_ref.model.torch_compile and actor.zero_stage == 3:
        raise _fail(
            "actor_rollout_ref.model.torch_compile",
            True,
            "a compiled forward needs the weights in place, and actor_rollout_ref.actor.zero_stage=3 gathers them "
            "layer by layer in hooks; use zero_stage 0, 1 or 2, or torch_compile=false",
        )
    if actor.offload_optimizer and actor.zero_stage == 0:
        raise _fail("actor_rollout_ref.actor.offload_optimizer", True, "optimizer offload needs zero_stage >= 1")
    critic = cfg.critic
    if critic.offload_param and critic.zero_stage != 3:
        raise _fail("critic.offload_param", True, "parameter offload needs critic.zero_stage=3")
    if critic.offload_optimizer and critic.zero_stage == 0:
        raise _fail("critic.offload_optimizer", True, "optimizer offload needs critic.zero_stage >= 1")


def _check_batches(cfg: TrainerConfig, world_size: int) -> None:
    data, actor, critic = cfg.data, cfg.actor_rollout_ref.actor, cfg.critic
    for key, mini in (
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size),
    ):
        if data.train_batch_size % mini:
            raise _fail(key, mini, f"must divide data.train_batch_size={data.train_batch_size}")
        if mini % world_size:
            raise _fail(key, mini, f"must be a multiple of the number of ranks ({world_size})")
    if data.train_batch_size % world_size:
        raise _fail(
            "data.train_batch_size", data.train_batch_size, f"must be a multiple of the number of ranks ({world_size})"
        )
    missing = [f"{key}=null" for key in _unsized_passes(cfg)]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: set each pass's micro-batch size (responses per forward on one rank) or its "
            "token budget (use_dynamic_bsz / log_prob_use_dynamic_bsz), as verl requires"
        )


def _unsized_passes(cfg: TrainerConfig) -> list[str]:
    """The micro-batch keys of the passes this run makes that have neither a size nor a token budget."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    passes = [
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            arr.actor.ppo_micro_batch_size_per_gpu,
            arr.actor.use_dynamic_bsz,
        ),
    ]
    if not arr.actor.reuse_on_policy_log_probs:
        passes.append(
            (
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                arr.rollout.log_prob_micro_batch_size_per_gpu,
                arr.rollout.log_prob_use_dynamic_bsz,
            )
        )
    if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        passes.append(
            (
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                arr.ref.log_prob_micro_batch_size_per_gpu,
                arr.ref.log_prob_use_dynamic_bsz,
            )
        )
    estimator = algos.ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if critic.enable or (critic.enable is None and estimator is not None and estimator.needs_critic):
        passes += [
            ("critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz),
            (
                "critic.forward_micro_batch_size_per_gpu",
                critic.forward_micro_batch_size_per_gpu,
                critic.use_dynamic_bsz,
            ),
        ]
    return [key for key, size, dynamic in passes if size is None and not dynamic]


def _check_algorithm(cfg: TrainerConfig) -> None:
    algorithm, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    estimator = algos.ADV_ESTIMATORS.get(algorithm.adv_estimator)
    if estimator is None:
        raise _fail(
            "algorithm.adv_estimator", algorithm.adv_estimator, f"choose one of: {', '.join(algos.ADV_ESTIMATORS)}"
        )
    if estimator.needs_groups and not estimator.groups_of_one and rollout.n < 2:
        raise _fail(
            "actor_rollout_ref.rollout.n",
            rollout.n,
            f"{algorithm.adv_estimator} compares the n responses of a prompt; use n >= 2",
        )
    if estimator.needs_critic and cfg.critic.enable is False:
        raise _fail("critic.enable", False, f"{algorithm.adv_estimator} needs the critic's values; leave it null")


def _check_rollout_correction(cfg: TrainerConfig, world_size: int) -> None:
    """Its settings (all problems at once), the rollout's log-probs it needs, and no collective that ranks could
    call a different number of times."""
    correction, problems = rollout_correction.parse(cfg.algorithm.rollout_correction)
    name = cfg.actor_rollout_ref.rollout.name
    if correction.active and not rollout_spec(name).can_return_log_probs:
        able = ", ".join(n for n in rollout_names() if rollout_spec(n).can_return_log_probs)
        problems.append(
            f"actor_rollout_ref.rollout.name={name!r}: algorithm.rollout_correction needs the rollout's log-probs, "
            f"which this backend does not return (these do: {able})"
        )
    actor = cfg.actor_rollout_ref.actor
    if correction.bypass and correction.batch_normalize and world_size > 1 and actor.use_dynamic_bsz:
        problems.append(
            "algorithm.rollout_correction.rollout_is_batch_normalize=True: in bypass mode each micro-batch "
            "normalises over all ranks, and with actor_rollout_ref.actor.use_dynamic_bsz=True ranks may cut "
            "different numbers of micro-batches; turn one of them off"
        )
    if problems:
        raise _Problems(problems)


def _check_dapo(cfg: TrainerConfig, world_size: int) -> None:
    """DAPO's overlong buffer and dynamic sampling, and the generation rounds (all problems at once)."""
    problems = []
    buffer, manager = cfg.reward_model.overlong_buffer, cfg.reward_model.reward_manager
    if buffer.enable:
        if manager != "dapo":
            problems.append(
                f"reward_model.overlong_buffer.enable=True: the overlong penalty is the DAPO reward manager's; set "
                f"reward_model.reward_manager=dapo (it is {manager!r})"
            )
        end = buffer.max_resp_len or cfg.data.max_response_length
        if buffer.len <= 0:
            problems.append(f"reward_model.overlong_buffer.len={buffer.len}: must be > 0 when the buffer is enabled")
        elif end < buffer.len:
            problems.append(
                f"reward_model.overlong_buffer.len={buffer.len}: must not exceed max_resp_len={end} (the buffer ends "
                "there)"
            )
    filtering, algorithm = cfg.algorithm.filter_groups, cfg.algorithm
    if filtering.enable and not filtering.metric:
        problems.append(
            "algorithm.filter_groups.metric=None: dynamic sampling needs the per-response number whose variance "
            "decides (acc, score, seq_reward, seq_final_reward)"
        )
    if filtering.enable and filtering.metric == "seq_final_reward" and algorithm.use_kl_in_reward:
        problems.append(
            "algorithm.filter_groups.metric='seq_final_reward' with algorithm.use_kl_in_reward=True: the KL-shaped "
            "reward is computed after the groups are chosen here; use seq_reward, or the KL as a loss "
            "(actor_rollout_ref.actor.use_kl_loss)"
        )
    gen_batch_size = cfg.data.gen_batch_size
    if gen_batch_size is not None and gen_batch_size % world_size:
        problems.append(
            f"data.gen_batch_size={gen_batch_size}: must be a multiple of the number of ranks ({world_size}); each "
            "takes its share of every generation round"
        )
    if problems:
        raise _Problems(problems)


def _check_rollout_prometheus(cfg: TrainerConfig) -> None:
    """verl's ``rollout.prometheus``: the series are an engine's that keeps statistics (a backend that reads
    ``disable_log_stats``: vLLM), kept only with them on."""
    rollout = cfg.actor_rollout_ref.rollout
    if not rollout.prometheus.enable:
        return
    problems = []
    if "disable_log_stats" not in rollout_spec(rollout.name).reads:
        engines = ", ".join(n for n in rollout_names() if "disable_log_stats" in rollout_spec(n).reads)
        problems.append(
            "actor_rollout_ref.rollout.prometheus.enable=True: the series are an engine's that keeps statistics; set "
            f"actor_rollout_ref.rollout.name to one ({engines}; it is {rollout.name!r}), or leave it off"
        )
    if rollout.disable_log_stats:
        problems.append(
            "actor_rollout_ref.rollout.prometheus.enable=True: vLLM keeps its series only with statistics on; set "
            "actor_rollout_ref.rollout.disable_log_stats=false (as verl asks)"
        )
    if problems:
        raise _Problems(problems)


def _check_profiler(cfg: TrainerConfig, world_size: int) -> None:
    """rlprof's own checks of the profiler blocks, then the rollout's token window: recorded by an engine's own
    profiler, so the backend must run one."""
    profiler = load_profiler_config(as_dict(cfg), world_size=world_size)
    tool = profiler.global_profiler.tool
    if tool is None or tool_spec(tool).engine_profiler is None:
        return
    name = cfg.actor_rollout_ref.rollout.name
    start, end = token_window(profiler.tool_settings(), profiler.roles, "rollout")
    if (start, end) != (0, None) and not rollout_spec(name).engine_profiler:
        able = ", ".join(n for n in rollout_names() if rollout_spec(n).engine_profiler)
        raise ConfigError(
            f"actor_rollout_ref.rollout.profiler.tool_config.{tool}.profile_token_start/_end={start}/{end}: the "
            f"rollout's token window is recorded by an engine's own profiler, which the {name!r} rollout does not "
            f"run (its sampling is in the trainer's own trace, whole); these do: {able}"
        )


def _check_names_and_paths(cfg: TrainerConfig) -> None:
    trainer = cfg.trainer
    profile_path = (cfg.global_profiler or {}).get("save_path")
    for key, folder in (
        ("trainer.log_dir", trainer.log_dir),
        ("trainer.default_local_dir", trainer.default_local_dir),
        ("global_profiler.save_path", profile_path),
    ):
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            raise _fail(key, folder, "a file is there; give a folder (it is created if missing)")
    for key, name in (
        ("trainer.project_name", trainer.project_name),
        ("trainer.experiment_name", trainer.experiment_name),
    ):
        if not _PLAIN_NAME.match(name) or ".." in name:
            raise _fail(
                key,
                name,
                "must be a plain name (ASCII letters and digits, then also . _ - + = @; no path separators, no "
                "'..'): it names folders and runs",
            )
    if trainer.resume_mode not in ("auto", "disable"):
        root = Path(trainer.default_local_dir).resolve()
        target = Path(trainer.resume_mode)
        target = (target if target.is_absolute() else Path.cwd() / target).resolve()
        if root not in target.parents or not re.match(r"^global_step_\d+$", target.name):
            raise _fail(
                "trainer.resume_mode",
                trainer.resume_mode,
                f"choose auto, disable, or a global_step_N directory inside trainer.default_local_dir ({root})",
            )
        if not target.is_dir():
            raise _fail("trainer.resume_mode", trainer.resume_mode, "no such checkpoint directory")


def _check_reward_model(cfg: TrainerConfig) -> None:
    reward_model = cfg.reward_model
    if not reward_model.enable:
        return
    if reward_model.model.path is None:
        raise _fail("reward_model.model.path", None, "reward_model.enable=true needs a sequence-classification model")
    folder = Path(reward_model.model.path)
    if not (folder / "config.json").is_file():
        raise _fail("reward_model.model.path", reward_model.model.path, "no model directory (config.json) there")
    if reward_model.model.use_remove_padding:
        raise _fail("reward_model.model.use_remove_padding", True, "only false: responses are scored padded here")


def _check_multi_turn(cfg: TrainerConfig) -> None:
    """The tool config loads (every problem of it in one message); the backend can continue sequences."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return
    if multi_turn.tool_config_path is not None:
        from rlprof_train.agent.tool_config import load_tools

        load_tools(multi_turn.tool_config_path)


def _check_inputs(cfg: TrainerConfig) -> None:
    data, model, custom = cfg.data, cfg.actor_rollout_ref.model, cfg.custom_reward_function
    if model.path is not None:
        path = Path(model.path)
        if not path.is_dir():
            raise _fail("actor_rollout_ref.model.path", model.path, "no such directory (a local Hugging Face model)")
        if not (path / "config.json").exists():
            raise _fail(
                "actor_rollout_ref.model.path", model.path, "has no config.json: not a Hugging Face model directory"
            )
    from rlprof_train.data import BUILTIN_TASKS, RuleRewards, check_data_files
    from rlprof_train.reward_functions import BUILTIN_SOURCES, builtin_reward

    scored_by_rules = custom.path is None and not cfg.reward_model.enable  # else the user's function or a model
    rule_rewards = RuleRewards(builtin_reward, BUILTIN_SOURCES) if scored_by_rules else None

    if data.train_files is None and data.task not in BUILTIN_TASKS:
        raise _fail("data.task", data.task, f"choose one of: {', '.join(BUILTIN_TASKS)} (or give data.train_files)")

    for setting, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        if files is not None:
            check_data_files(files, data.prompt_key, setting, rule_rewards)
