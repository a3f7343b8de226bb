"""What each of verl's trainer keys means here: one table, read by the loader before anything else.

A verl launch script or config sets keys of verl's trainer, of the seed's era or of today's (``verl/ppo_trainer_<commit>
.yaml``: verl's own flattened config at each commit, every key with its default; verl moved the critic's FSDP block to
``critic.fsdp`` and the reward settings under ``reward``, and both layouts are read). Each key it sets is one of:

- a key of this trainer: used as it is;
- an **alias**: the same setting under this trainer's name, the value converted where verl's unit differs (verl's
  global micro-batch sizes are divided by the number of ranks, as verl divides them);
- a **mirror**: a verl key that repeats another setting (``critic.model.use_remove_padding``, which here is the
  policy's): accepted when it agrees, refused naming the key to set when it does not;
- a **no-op**: an engine, placement or I/O detail with no effect on the experiment here (FSDP wrapping, Ray pools,
  torch.compile): accepted and named once in the log;
- **refused**, with the equivalent to use (another launcher flag, another key);
- anything else of verl's is **not supported**: accepted at verl's default of either era (the experiment is then the
  same as verl's), refused at any other value, since dropping it would silently run another experiment.

Every problem of a command line and config file is collected and reported at once (:func:`translate`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from rlprof.tools.torch_profiler import effective_contents
from rlprof_train.launch import launch_world

VERL_CONFIGS = {
    commit: Path(__file__).parent / "verl" / f"ppo_trainer_{commit}.yaml" for commit in ("b178a3cd", "1dda039b")
}
"""verl's flattened trainer config of the seed's era, then of today's (verl/README.md)."""
SEED_ERA = "b178a3cd"
ARR = "actor_rollout_ref"


@dataclass(frozen=True)
class Alias:
    target: str
    convert: Optional[Callable[[Any, int], Any]] = None
    """``(value, world_size) -> value here``; raises ValueError with the reason."""
    implies: tuple[tuple[str, Any], ...] = ()
    """Settings here that verl's meaning of a true value carries, applied unless the user set them."""
    null_is_unset: bool = False
    """verl reads null as "not set" (a deprecated spelling): nothing to apply."""


@dataclass(frozen=True)
class Mirror:
    of: str
    """The key here that holds the setting."""
    same: Optional[Callable[[Any, Any], bool]] = None
    """``(verl's value, the value here) -> agree``; plain equality when None."""


@dataclass(frozen=True)
class Kept:
    """A key of a role's profiler block that rlprof honours as verl does: applied as it is (rlprof checks it)."""


@dataclass(frozen=True)
class NoOp:
    reason: str


@dataclass(frozen=True)
class Refused:
    equivalent: str
    accepted: tuple[Any, ...] = ()
    """Values that ask for nothing refused (what ``equivalent`` says to leave), besides verl's defaults."""


@dataclass(frozen=True)
class Launcher:
    """``trainer.nnodes`` / ``trainer.n_gpus_per_node``: checked against the processes the launcher started."""

    what: str


Rule = Union[Alias, Kept, Mirror, NoOp, Refused, Launcher]

FSDP = "an FSDP engine detail; the actor and critic run on DeepSpeed here"
ENTROPY_COMPILE = (
    "verl compiles its entropy function with it; the entropy is computed eagerly here (compiling the policy's "
    "whole forward for the training passes is actor_rollout_ref.model.torch_compile)"
)
RAY = "a Ray placement detail; processes are started by torchrun or the deepspeed launcher here"
IO = "verl's own I/O; nothing to do here"
ASYNC_TRAINING = (
    "a rollout pool apart from the trainer's is verl's one-step-off and fully-async trainers': python -m "
    "rlprof_train.one_step_off_policy (with rollout.nnodes, rollout.n_gpus_per_node and "
    f"{ARR}.hybrid_engine) and python -m rlprof_train.fully_async_main (those, rollout.total_rollout_steps and "
    "async_training.*); leave them out for the synchronous form"
)
ONE_STEP_OFF_DEFAULTS = ("algorithm.rollout_correction.bypass_mode=true",)
"""verl's one-step-off config over its trainer's defaults, that apply to both asynchronous trainers here (before the
command line's overrides)."""
POOL_KEYS = frozenset({"rollout.nnodes", "rollout.n_gpus_per_node", f"{ARR}.hybrid_engine"})
"""The asynchronous trainers' keys (their rollout pool): refused by ``main_ppo`` as verl's asynchronous keys."""
FULLY_ASYNC_KEYS = frozenset(
    {
        "rollout.total_rollout_steps",
        "async_training.staleness_threshold",
        "async_training.trigger_parameter_sync_step",
        "async_training.require_batches",
        "async_training.partial_rollout",
        "async_training.partial_rollout_segment",
        "async_training.concurrent_samples_per_replica",
    }
)
"""The fully-async trainer's own keys: refused by the others."""
RELOCATED = (
    "the rollout engine's traces are written under global_profiler.save_path already (vllm_torch/rank{R}/) and listed "
    "in its manifest"
)


def _per_gpu(value: Any, world_size: int) -> Any:
    """verl's global micro-batch size -> per rank (verl: ``size // world_size``)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"must be a positive integer, not {value!r}")
    if value % world_size:
        raise ValueError(f"must be a multiple of the number of ranks ({world_size}); verl divides it among them")
    return value // world_size


def _offload(target: str) -> Alias:
    """FSDP's parameter offload is of fully sharded parameters: ZeRO stage 3 with parameter offload here."""
    if not target.endswith("offload_param"):
        return Alias(target)
    return Alias(target, implies=((target.rsplit(".", 1)[0] + ".zero_stage", 3),))


OTHER_ENGINES = {
    f"{ARR}.rollout.name": {
        engine: f"verl's {title} engine is not available here; use vllm (it serves the same models and reads the "
        "engine settings verl scripts pass) or hf"
        for engine, title in (("sglang", "SGLang"), ("trtllm", "TensorRT-LLM"))
    },
}
"""Values of keys both configs have that name one of verl's engines rlprof_train does not have."""

RULES: list[tuple[str, Rule]] = [
    # aliases: the same setting, verl's name
    (f"{ARR}.rollout.tensor_model_parallel_size", Alias(f"{ARR}.rollout.tensor_parallel_size")),
    (f"{ARR}.actor.fsdp_config.param_offload", _offload(f"{ARR}.actor.offload_param")),
    (f"{ARR}.actor.fsdp_config.optimizer_offload", _offload(f"{ARR}.actor.offload_optimizer")),
    ("critic.model.fsdp_config.param_offload", _offload("critic.offload_param")),
    ("critic.model.fsdp_config.optimizer_offload", _offload("critic.offload_optimizer")),
    (f"{ARR}.actor.ppo_micro_batch_size", Alias(f"{ARR}.actor.ppo_micro_batch_size_per_gpu", _per_gpu)),
    (f"{ARR}.rollout.log_prob_micro_batch_size", Alias(f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu", _per_gpu)),
    (f"{ARR}.ref.log_prob_micro_batch_size", Alias(f"{ARR}.ref.log_prob_micro_batch_size_per_gpu", _per_gpu)),
    ("critic.ppo_micro_batch_size", Alias("critic.ppo_micro_batch_size_per_gpu", _per_gpu)),
    ("critic.forward_micro_batch_size", Alias("critic.forward_micro_batch_size_per_gpu", _per_gpu)),
    ("reward_model.micro_batch_size", Alias("reward_model.micro_batch_size_per_gpu", _per_gpu)),
    # verl's layout of today (1dda039b): the critic's FSDP block and the reward settings moved
    ("critic.fsdp.param_offload", _offload("critic.offload_param")),
    ("critic.fsdp.optimizer_offload", _offload("critic.offload_optimizer")),
    ("reward.custom_reward_function.path", Alias("custom_reward_function.path")),
    ("reward.custom_reward_function.name", Alias("custom_reward_function.name")),
    ("reward.reward_manager.name", Alias("reward_model.reward_manager")),
    *(
        (f"reward.reward_kwargs.overlong_buffer_cfg.{key}", Alias(f"reward_model.overlong_buffer.{key}"))
        for key in ("enable", "len", "penalty_factor", "log")
    ),
    ("reward.reward_kwargs.max_resp_len", Alias("reward_model.overlong_buffer.max_resp_len")),
    (f"{ARR}.actor.optim.warmup_style", Alias(f"{ARR}.actor.optim.lr_scheduler_type", null_is_unset=True)),
    ("critic.optim.warmup_style", Alias("critic.optim.lr_scheduler_type", null_is_unset=True)),
    ("reward.reward_model.enable", Alias("reward_model.enable")),
    ("reward.reward_model.model_path", Alias("reward_model.model.path")),
    # mirrors: verl repeats these per worker; here they are one setting
    (f"{ARR}.actor.use_remove_padding", Mirror(f"{ARR}.model.use_remove_padding")),
    (f"{ARR}.actor.rollout_n", Mirror(f"{ARR}.rollout.n")),
    (f"{ARR}.ref.rollout_n", Mirror(f"{ARR}.rollout.n")),
    ("critic.rollout_n", Mirror(f"{ARR}.rollout.n")),
    (f"{ARR}.rollout.prompt_length", Mirror("data.max_prompt_length")),
    (f"{ARR}.ref.strategy", Mirror(f"{ARR}.actor.strategy")),
    ("critic.model.tokenizer_path", Mirror("critic.model.path")),
    # the launcher's world
    ("trainer.nnodes", Launcher("nodes")),
    ("trainer.n_gpus_per_node", Launcher("processes per node")),
    # refused, with what to use
    ("*.megatron.*", Refused("Megatron is not an engine here; use actor_rollout_ref.actor.zero_stage=0|1|2|3")),
    *(
        (key, Refused("sequence parallelism is not implemented; leave it 1", accepted=(1,)))
        for key in (
            f"{ARR}.actor.ulysses_sequence_parallel_size",
            f"{ARR}.ref.ulysses_sequence_parallel_size",
            "critic.ulysses_sequence_parallel_size",
        )
    ),
    # no-ops: engine, placement and I/O details
    ("*._target_", NoOp("verl's dataclass path")),
    (
        "critic.strategy",
        NoOp("verl's engine for the critic (as the actor's fsdp_config.strategy); the critic runs on DeepSpeed here"),
    ),
    ("*.optim.total_training_steps", NoOp("verl fills it in with the run's steps; the schedule here counts them too")),
    (f"{ARR}.ref.fsdp_config.param_offload", NoOp("the reference policy is frozen here, with no optimizer state")),
    ("*.fsdp_config.*", NoOp(FSDP)),
    (f"{ARR}.actor.fsdp_config", NoOp(FSDP)),
    (f"{ARR}.actor.use_torch_compile", NoOp(ENTROPY_COMPILE)),
    (f"{ARR}.ref.use_torch_compile", NoOp(ENTROPY_COMPILE)),
    (f"{ARR}.actor.checkpoint.*", NoOp("checkpoints always hold the model, optimizer and trainer state here")),
    ("critic.checkpoint.*", NoOp("checkpoints always hold the model, optimizer and trainer state here")),
    (f"{ARR}.hybrid_engine", Refused(ASYNC_TRAINING, accepted=(True,))),
    ("rollout.*", Refused(ASYNC_TRAINING)),
    (
        "async_training.use_trainer_do_validate",
        NoOp("validation goes through the rollout pool, called by the trainer pool, whichever is set"),
    ),
    ("async_training.*", Refused(ASYNC_TRAINING)),
    (f"{ARR}.nccl_timeout", NoOp("see trainer settings for timeouts")),
    (f"{ARR}.model.use_shm", NoOp("the model loads from its directory")),
    ("critic.model.use_shm", NoOp("the model loads from its directory")),
    (
        f"{ARR}.rollout.mode",
        NoOp("generation runs in the trainer's processes (verl's sync and async are the same math)"),
    ),
    (f"{ARR}.rollout.load_format", NoOp("the engine loads the model directory, then the actor's weights")),
    (f"{ARR}.rollout.layered_summon", NoOp("weights are synced in buckets here")),
    (f"{ARR}.rollout.free_cache_engine", NoOp("the engine's cache is kept between steps")),
    (f"{ARR}.rollout.enable_sleep_mode", NoOp("the engine's weights and cache stay where they are between steps")),
    (
        f"{ARR}.rollout.engine_kwargs.*",
        Refused("engine arguments are not passed on here; the vllm rollout takes the rollout keys it documents"),
    ),
    (f"{ARR}.rollout.multi_stage_wake_up", NoOp("an SGLang memory detail")),
    (f"{ARR}.rollout.over_sample_rate", NoOp("verl declares it but does not read it (verl/workers/config/rollout.py)")),
    (f"{ARR}.rollout.multi_turn.tokenization_sanity_check_mode", NoOp("replies are tokenised once, as appended")),
    (f"{ARR}.rollout.skip_tokenizer_init", NoOp("an engine start-up detail")),
    (f"{ARR}.rollout.trace.*", NoOp("rollout traces are recorded by rlprof's tools here")),
    ("*.profiler.tool_config.npu.*", NoOp("NPU profiling: not on these machines")),
    (
        "*.profiler.tool_config.torch.contents",
        Mirror(
            "global_profiler.global_tool_config.torch.contents",
            lambda role, here: effective_contents(role) == effective_contents(here),
        ),
    ),
    (
        f"{ARR}.rollout.profiler.tool_config.torch.discrete",
        NoOp(
            "the vllm rollout's engine writes its own torch trace for each profiled step (vllm_torch/rank{R}/, in the "
            "manifest), as verl's discrete rollout profiling; the hf rollout samples in the trainer's process, "
            "recorded with the other roles' ranges (global_profiler.global_tool_config.torch.discrete for one trace "
            "per range)"
        ),
    ),
    ("*.relocate_results", NoOp(RELOCATED)),
    (
        "*.profiler.tool_config.torch_memory.*",
        Refused(
            "per role, torch_memory settings are not applied here (one recording per process); set "
            "global_profiler.global_tool_config.torch_memory.* instead"
        ),
    ),
    (
        "*.profiler.tool_config.memray.*",
        Refused(
            "per role, memray settings are not applied here (one capture per process); set "
            "global_profiler.global_tool_config.memray.* instead"
        ),
    ),
    ("*.profiler.tool_config.torch.schedule.*", Kept()),
    ("*.profiler.tool_config.torch.discrete", Kept()),
    ("*.profiler.tool_config.torch.profile_token_start", Kept()),
    ("*.profiler.tool_config.torch.profile_token_end", Kept()),
    (
        "*.profiler.tool_config.torch.*",
        Refused(
            "not a torch setting here: per role, contents, discrete, schedule.* and profile_token_start/_end are "
            "(rlprof.tools.torch_profiler.TorchSettings)"
        ),
    ),
    ("*.profiler.tool", NoOp("the tool is global_profiler.tool here (one per process)")),
    ("*.profiler.save_path", NoOp("files go to global_profiler.save_path here")),
    ("*.profiler.global_tool_config", NoOp("see global_profiler.global_tool_config")),
    ("global_profiler.global_tool_config.npu.*", NoOp("NPU profiling: not on these machines")),
    ("global_profiler.global_tool_config.nsys.controller_nsight_options.*", NoOp(RAY)),
    ("global_profiler.global_tool_config.nsys.worker_nsight_options.*", NoOp(RAY)),
    ("trainer.use_legacy_worker_impl", NoOp("verl's worker implementation choice")),
    ("trainer.ray_wait_register_center_timeout", NoOp(RAY)),
    ("trainer.balance_batch", NoOp("each rank takes a contiguous share of the batch; the update is the same")),
    ("trainer.default_hdfs_dir", NoOp(IO)),
    ("trainer.del_local_ckpt_after_load", NoOp(IO)),
    ("trainer.esi_redundant_time", NoOp("a cloud-preemption detail")),
    ("reward_model.use_reward_loop", NoOp("the reward model runs in the trainer's processes")),
    ("reward_model.num_workers", NoOp("the reward model runs in the trainer's processes")),
    ("reward_model.enable_resource_pool", NoOp(RAY)),
    ("reward_model.n_gpus_per_node", NoOp(RAY)),
    ("reward_model.nnodes", NoOp(RAY)),
    ("reward_model.rollout.*", NoOp("the reward model is a sequence classifier run with transformers here")),
    ("reward_model.launch_reward_fn_async", NoOp("rewards are computed in the trainer's processes")),
    ("reward_model.model.input_tokenizer", NoOp("responses are decoded with the policy's tokenizer")),
    ("reward_model.model.use_shm", NoOp("the model loads from its directory")),
    ("reward_model.model.fsdp_config.*", NoOp(FSDP)),
    ("reward_model.strategy", NoOp("the reward model runs with transformers (no engine)")),
    ("data.dataloader_num_workers", NoOp("prompts are prepared once at start")),
    ("data.filter_overlong_prompts_workers", NoOp("prompts are prepared once at start")),
    ("data.use_shm", NoOp(IO)),
    ("data.return_raw_input_ids", NoOp("the trainer tokenizes prompts itself")),
    ("data.return_full_prompt", NoOp("the trainer tokenizes prompts itself")),
    ("data.return_raw_chat", NoOp("the trainer applies the chat template itself")),
    ("transfer_queue.*", NoOp(RAY)),
    ("ray_kwargs.*", NoOp(RAY)),
    ("critic.fsdp.*", NoOp(FSDP)),
    ("reward.num_workers", NoOp("rewards are computed in the trainer's processes")),
    ("reward.reward_model.rollout.*", NoOp("the reward model is a sequence classifier run with transformers here")),
    ("reward.reward_model.enable_resource_pool", NoOp(RAY)),
    ("reward.reward_model.n_gpus_per_node", NoOp(RAY)),
    ("reward.reward_model.nnodes", NoOp(RAY)),
    (
        f"{ARR}.rollout.calculate_log_probs",
        NoOp(
            "the vllm rollout always returns its log-probs (compared with the actor's: rollout/log_prob_abs_diff); "
            "the hf rollout samples with the actor itself and returns them when algorithm.rollout_correction needs them"
        ),
    ),
]
"""(pattern, rule) in order: the first whose ``fnmatch`` pattern matches a dotted key decides."""


@dataclass
class Translation:
    pairs: list[tuple[str, Any]] = field(default_factory=list)
    """(key here, value) to apply, in order."""
    mirrors: list[tuple[str, Any, Mirror]] = field(default_factory=list)
    """(verl key, value, its rule) to compare once the config is merged."""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted (key, value) leaves of a nested mapping (an empty mapping is a leaf)."""
    if not isinstance(node, dict) or not node:
        return [(prefix, node)]
    out = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out += flatten(value, path)
    return out


@cache
def verl_defaults() -> dict[str, tuple[Any, ...]]:
    """Every key of verl's trainer in either era (dotted) with its defaults: one for each era that has it, the seed's
    first, a default repeated once; every section of it maps to ``(None,)``."""
    defaults: dict[str, tuple[Any, ...]] = {}
    for commit in VERL_CONFIGS:
        leaves = era_defaults(commit)
        for key in leaves:
            for i in range(1, key.count(".") + 1):
                defaults.setdefault(".".join(key.split(".")[:i]), (None,))
        for key, value in leaves.items():
            known = defaults.get(key, ())
            if not any(type(d) is type(value) and d == value for d in known):
                defaults[key] = (*known, value)
    return defaults


@cache
def era_defaults(commit: str) -> dict[str, Any]:
    """Every key of verl's trainer at ``commit`` (a key of :data:`VERL_CONFIGS`) with its default, dotted."""
    return dict(flatten(yaml.safe_load(VERL_CONFIGS[commit].read_text())))


def _left_unset_today(key: str) -> bool:
    """A key of the seed's era that today's verl keeps only as ``null`` (its setting moved: ``reward_model.*`` to
    ``reward.*``)."""
    seed, today = era_defaults(SEED_ERA), era_defaults(list(VERL_CONFIGS)[-1])
    return today.get(key, 0) is None and seed.get(key) is not None


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    return any(_same(value, default) for default in defaults)


def _defaults_text(defaults: tuple[Any, ...]) -> str:
    return " or ".join(repr(d) for d in defaults)


_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([A-Za-z0-9_.]+)(?:,.*)?\}$")


def rule_for(key: str) -> Optional[Rule]:
    for pattern, rule in RULES:
        if fnmatch.fnmatchcase(key, pattern):
            return rule
    for default in verl_defaults().get(key, ()):
        found = _INTERPOLATION.match(default) if isinstance(default, str) else None
        if found and not found.group(1).startswith("."):
            return Mirror(found.group(1))
    return None


def translate(pairs: list[tuple[str, Any]], ours: set[str], world_size: int) -> Translation:
    """Sort each (dotted key, value) a user gave into what to apply, what to note and what is wrong."""
    out = Translation()
    verl = verl_defaults()
    ignored: list[str] = []
    last = dict(pairs)  # a key given twice (a script's value, then the user's "$@"): the later wins, as in Hydra
    for key, value in last.items():
        if value is None and _left_unset_today(key):
            ignored.append(f"{key} (null: today's verl leaves this key of its old layout unset)")
            continue
        if key in ours or isinstance(rule_for(key), Kept):
            if key in OTHER_ENGINES and value in OTHER_ENGINES[key]:
                out.problems.append(f"{key}={value!r}: {OTHER_ENGINES[key][value]}")
            out.pairs.append((key, value))
            continue
        if isinstance(value, str) and value.startswith("${"):  # verl's own interpolation: no value of the user's
            ignored.append(f"{key} (an interpolation)")
            continue
        rule = rule_for(key)
        if isinstance(rule, Alias) and rule.null_is_unset and value is None:
            ignored.append(f"{key} (null: verl reads it as not set)")
        elif isinstance(rule, Alias):
            _apply_alias(key, value, rule, set(last), world_size, out)
        elif isinstance(rule, Mirror):
            out.mirrors.append((key, value, rule))
        elif isinstance(rule, NoOp):
            ignored.append(f"{key} ({rule.reason})")
        elif isinstance(rule, Refused):
            if _is_default(value, (*verl.get(key, ()), *rule.accepted)):
                ignored.append(f"{key} (verl's default; nothing to change)")
            else:
                out.problems.append(f"{key}={value!r}: {rule.equivalent}")
        elif isinstance(rule, Launcher):
            rollout_pool = last.get("rollout.n_gpus_per_node", 0)
            problem = _launcher_problem(key, value, rule, rollout_pool if isinstance(rollout_pool, int) else 0)
            if problem:
                out.problems.append(problem)
        elif key in verl:
            if _is_default(value, verl[key]):
                ignored.append(f"{key} (verl's default; nothing to change)")
            else:
                out.problems.append(
                    f"{key}={value!r}: not supported here (verl's default {_defaults_text(verl[key])} is what runs); "
                    "remove it, or run it with verl"
                )
        else:
            out.problems.append(
                f"unknown config key {key!r}{_hint(key, ours)} (see rlprof_train/config/ppo_trainer.yaml)"
            )
    if ignored:
        out.notes.append("verl settings with no effect here: " + "; ".join(ignored))
    return out


def _apply_alias(key: str, value: Any, rule: Alias, given: set[str], world_size: int, out: Translation) -> None:
    """The alias's setting here (its value converted, what a true value implies unless ``given``), and its note."""
    try:
        converted = rule.convert(value, world_size) if rule.convert else value
    except ValueError as exc:
        out.problems.append(f"{key}={value!r} {exc}")
        return
    out.pairs.append((rule.target, converted))
    implied = [(k, v) for k, v in rule.implies if converted is True and k not in given]
    out.pairs += implied
    also = "".join(f" with {k}={v!r}" for k, v in implied)
    out.notes.append(f"{key}={value!r} is {rule.target}={converted!r}{also} here")


def mirror_problems(mirrors: list[tuple[str, Any, Mirror]], setting: Callable[[str], Any]) -> list[str]:
    """The mirrored keys that disagree with the key here that holds the setting (``None`` here: a verl key not set,
    at verl's default). A mirror set to ``None`` is verl's "follow the other key" (today's ``critic.model.*``)."""

    def holds(value: Any, rule: Mirror) -> bool:
        here = setting(rule.of)
        candidates = (here,) if here is not None else verl_defaults().get(rule.of, (None,))
        same = rule.same or _same
        return any(same(value, candidate) for candidate in candidates)

    return [
        f"{key}={value!r}: here that is {rule.of} (={setting(rule.of)!r}); set {rule.of} instead"
        for key, value, rule in mirrors
        if value is not None and not holds(value, rule)
    ]


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, str) and default.startswith("${"):
        return False
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default or (isinstance(value, bool) and isinstance(default, bool) and value == default)
    return bool(value == default)


def _launcher_problem(key: str, value: Any, rule: Launcher, rollout_per_node: int = 0) -> Optional[str]:
    """``trainer.nnodes`` against the launch's nodes; ``trainer.n_gpus_per_node`` against its processes per node,
    less the rollout pool's on each node (``rollout.n_gpus_per_node``) where the rollout has a pool of its own."""
    launched = launch_world()
    nodes = key.endswith("nnodes")
    actual = launched.nodes if nodes else launched.per_node - rollout_per_node
    if value == actual:
        return None
    if nodes or not rollout_per_node:
        return (
            f"{key}={value!r}: this launch has {actual} {rule.what} ({launched.world_size} processes in all); start "
            f"the trainer with torchrun --nnodes {value if nodes else launched.nodes} --nproc_per_node "
            f"{launched.per_node if nodes else value} -m rlprof_train.main_ppo ..., or set {key}={actual}"
        )
    return (
        f"{key}={value!r}: this launch has {launched.per_node} processes per node, {rollout_per_node} of them the "
        f"rollout pool's (rollout.n_gpus_per_node), so {actual} train; start it with torchrun --nproc_per_node "
        f"{value + rollout_per_node if isinstance(value, int) else '...'} or set {key}={actual}"
    )


def _hint(key: str, ours: set[str]) -> str:
    """A suggestion only for a misspelling of a key in the same section (not a different concept)."""
    import difflib

    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in ours | set(verl_defaults()) if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.8)
    return f"; did you mean {(parent + '.' if parent else '') + close[0]!r}?" if close else ""
