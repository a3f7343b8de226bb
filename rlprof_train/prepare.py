"""Everything a run prepares before its first step, with what it says about it: the run directory (lock, record), the
model, the rollout's tools and backend, the workers (actor, reward, reference, critic), the resume point, the
non-finite guard and the tracker. The loop itself is in :mod:`rlprof_train.trainer`."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from rlprof.tracking import Tracker, parse_backends
from rlprof.tracking.base import backend_factory, event_dirs
from rlprof.typed_config import ConfigError
from rlprof_train import algos, checkpoint, rollout_correction
from rlprof_train.agent import Tool
from rlprof_train.agent.tool_config import load_tools, task_tools
from rlprof_train.config import TrainerConfig, as_dict
from rlprof_train.guards import NonFiniteGuard
from rlprof_train.models import overridden_config, trainable_parameters
from rlprof_train.reward_functions import RewardFunction
from rlprof_train.run_dir import RunLock, stale_note, write_run_record
from rlprof_train.tiny_model import embedded_model_name, ensure_tiny_model
from rlprof_train.workers.actor import ActorWorker
from rlprof_train.workers.critic import CriticWorker
from rlprof_train.workers.engine import DistEnv
from rlprof_train.workers.ref import RefWorker
from rlprof_train.workers.reward_model import reward_model
from rlprof_train.workers.reward_worker import RewardWorker
from rlprof_train.workers.rollout import Rollout, RolloutContext, create_rollout, rollout_spec
from rlprof_train.workers.rollout.base import ContinuingRollout
from rlprof_train.workers.rollout.multi_turn import MultiTurnRollout
from rlprof_train.workers.rollout.registry import Policy, backend_facts, ignored_settings

EMBEDDED_MODEL_DIR = Path("outputs/models")
Log = Callable[[str], None]


@dataclass
class RunDirectory:
    """The locks rank 0 holds on ``log_dir`` and ``default_local_dir`` for the run."""

    locks: list[RunLock]

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def open_run_directory(cfg: TrainerConfig, env: DistEnv, log: Log) -> RunDirectory:
    """Lock the run's folders (rank 0) and, with several ranks and checkpoints, check that the checkpoint folder
    is one folder for every rank. Errors stop every rank at once."""
    trainer = cfg.trainer
    locks: list[RunLock] = []
    problem = None
    if env.is_main:
        try:
            for folder, setting in (
                (trainer.log_dir, "trainer.log_dir"),
                (trainer.default_local_dir, "trainer.default_local_dir"),
            ):
                if not any(Path(folder).resolve() == lock.folder.resolve() for lock in locks):
                    locks.append(RunLock(Path(folder), setting))
        except ConfigError as exc:
            problem = str(exc)
            for lock in locks:
                lock.release()
            locks = []
    env.agree(problem, ConfigError)
    for lock in locks:
        note = stale_note(lock)
        if note:
            log(note)
    uses_checkpoints = trainer.save_freq > 0 or trainer.resume_mode != "disable"
    if env.world_size > 1 and uses_checkpoints:
        token = env.gather(f"{os.getpid()}-{time.time()}")[0]
        env.agree(  # a configuration problem: one line and exit code 2 on every rank
            checkpoint.shared_directory_problem(Path(trainer.default_local_dir), token, env.is_main, env.barrier),
            ConfigError,
        )
    return RunDirectory(locks)


def record_run(
    cfg: TrainerConfig,
    env: DistEnv,
    run_id: str,
    start_step: int,
    total_steps: int,
    resumed_from: Optional[Path],
    rollout_processes: int,
    per_node: int,
) -> None:
    """``run.json`` and ``config.yaml`` in ``trainer.log_dir``: what ``rlprof report`` and ``rlprof compare`` read
    (rank 0). ``rollout_processes``: the rollout pool's processes, beside the trainer's (0: none, the rollout runs in
    the trainer's processes); ``per_node``: the launch's processes on a node, both pools'."""
    if not env.is_main:
        return
    profiler = cfg.global_profiler or {}
    events = event_dirs(parse_backends(cfg.trainer.logger), cfg.trainer.project_name, cfg.trainer.experiment_name)
    write_run_record(
        Path(cfg.trainer.log_dir),
        as_dict(cfg),
        run_id=run_id,
        world_size=env.world_size,
        processes={"trainer": env.world_size, "rollout": rollout_processes, "per_node": per_node},
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
        profile_save_path=str(Path(profiler.get("save_path") or "outputs/profile").resolve()),
        profile_tool=profiler.get("tool"),
        checkpoint_dir=str(Path(cfg.trainer.default_local_dir).resolve()),
        tensorboard_dir=str(events[0].resolve()) if events else None,
        start_step=start_step,
        total_steps=total_steps,
        resumed_from=str(resumed_from) if resumed_from else None,
        rollout=backend_facts(rollout_spec(cfg.actor_rollout_ref.rollout.name)),
        device_memory_at_start=dict(zip(("free", "total"), env.memory_at_start, strict=True))
        if env.memory_at_start
        else None,
    )


def prepare_model(cfg: TrainerConfig, env: DistEnv, log: Log) -> str:
    """The policy's model directory: ``model.path``, or the embedded tiny model, built by local rank 0 of every
    node (nodes need no shared disk; the build is deterministic) and checked to be the same model on every rank."""
    path = cfg.actor_rollout_ref.model.path
    if path is None:
        folder = EMBEDDED_MODEL_DIR / embedded_model_name(cfg.data.task, cfg.data.task_max_operand)
        if env.local_rank == 0:
            ensure_tiny_model(EMBEDDED_MODEL_DIR, cfg.data.task_max_operand, cfg.data.task)
            if env.is_main:
                log(f"model: using the embedded tiny model at {folder} (actor_rollout_ref.model.path=null)")
        env.barrier()
        path = str(folder)
    if cfg.actor_rollout_ref.model.enable_activation_offload and not torch.cuda.is_available() and env.is_main:
        log(
            "model: enable_activation_offload keeps activations on the host, where they already are without CUDA: "
            "nothing to do"
        )
    overrides = cfg.actor_rollout_ref.model.override_config
    if overrides and env.is_main:
        config, unknown = overridden_config(path, overrides)
        log(
            f"model: {type(config).__name__} with {', '.join(f'{k}={v!r}' for k, v in overrides.items())} "
            "(actor_rollout_ref.model.override_config)"
        )
        if unknown:
            log(
                f"model: {type(config).__name__} has no setting {', '.join(unknown)}: set as verl sets it, read by no "
                "model code (check the spelling)"
            )
    digests = env.gather(model_digest(Path(path)))
    if len(set(digests)) > 1:
        raise ConfigError(
            f"actor_rollout_ref.model.path={path}: the ranks see different models (weights digests "
            f"{', '.join(sorted(set(digests)))}); give every node the same model directory"
        )
    return path


def model_digest(folder: Path) -> str:
    """A digest of a model directory's config and weight files (names and bytes)."""
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*")):
        if file.suffix in (".json", ".safetensors", ".bin") and file.is_file():
            digest.update(file.name.encode())
            with file.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def make_rollout(
    cfg: TrainerConfig,
    env: DistEnv,
    model_path: str,
    actor: Policy,
    tokenizer: Any,
    log: Log,
    tools: list[Tool],
    wants_log_probs: bool = False,
) -> Rollout:
    """The rollout backend registered as ``actor_rollout_ref.rollout.name`` (the engine settings it ignores that the
    config changed are named once), rolled out over several turns with ``tools`` when ``multi_turn.enable``;
    ``wants_log_probs``: the run's rollout correction needs the sampling distribution's log-probs."""
    rollout = cfg.actor_rollout_ref.rollout
    if env.is_main:
        for line in ignored_settings(rollout_spec(rollout.name), rollout):
            log(line)
    backend = create_rollout(RolloutContext(cfg, env, model_path, actor, tokenizer, log, wants_log_probs))
    multi_turn = rollout.multi_turn
    if not multi_turn.enable:
        return backend
    assert isinstance(backend, ContinuingRollout), "check_rollout refuses multi-turn on other backends"
    if env.is_main:
        names = ", ".join(tool.name for tool in tools) or "no tools"
        log(f"rollout: multi-turn ({multi_turn.format} tool calls) with {names}")
    return MultiTurnRollout(backend, tools, multi_turn, tokenizer)


def rollout_tools(cfg: TrainerConfig) -> list[Tool]:
    """The tools a multi-turn rollout may call: those of ``multi_turn.tool_config_path``, or a built-in task's own
    (the calculator's) when no data files are given; none for a single-turn rollout."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable and multi_turn.tool_config_path:
        return load_tools(multi_turn.tool_config_path)
    if multi_turn.enable and cfg.data.train_files is None:
        return task_tools(cfg.data.task)
    return []


def correction(cfg: TrainerConfig) -> rollout_correction.Correction:
    """The run's rollout correction (``algorithm.rollout_correction``, checked when the config was validated)."""
    return rollout_correction.parse(cfg.algorithm.rollout_correction)[0]


def make_actor(
    cfg: TrainerConfig,
    env: DistEnv,
    model_path: str,
    resumed_from: Optional[Path],
    log: Log,
    correction: Optional[rollout_correction.Correction] = None,
) -> ActorWorker:
    """The actor's engine (from its checkpoint's ZeRO layout when resuming), applying ``correction`` in bypass mode;
    with LoRA, how many parameters train."""
    arr = cfg.actor_rollout_ref
    zero_checkpoint = checkpoint.saved_by_zero(resumed_from, "actor")
    actor = ActorWorker(arr.actor, arr.model, model_path, env, zero_checkpoint, correction)
    if arr.model.lora_rank > 0:
        trained, total = trainable_parameters(actor.module)
        log(
            f"model: LoRA rank {arr.model.lora_rank} (alpha {arr.model.lora_alpha}) on {arr.model.target_modules}: "
            f"{trained:,} of {total:,} parameters train ({100 * trained / total:.2f}%)"
        )
    return actor


def make_reward(cfg: TrainerConfig, env: DistEnv, tokenizer: Any, log: Log) -> RewardWorker:
    """The reward: the custom function or the built-in rule, or the reward model (verl's precedence, said once);
    with ``reward_manager=dapo`` DAPO's overlong penalty on top (``overlong_buffer``)."""
    custom = cfg.custom_reward_function
    reward = RewardFunction(custom.path, custom.name, custom.timeout_s)
    if cfg.reward_model.enable:
        log(
            f"reward: custom_reward_function {custom.path} scores responses; reward_model.model is not used (verl's "
            "precedence)"
            if reward.is_custom
            else f"reward: the reward model at {cfg.reward_model.model.path} scores responses (the rule reward is not "
            "computed, as verl)"
        )
    dapo = None
    if cfg.reward_model.reward_manager == "dapo":
        buffer = cfg.reward_model.overlong_buffer
        dapo = (buffer, buffer.max_resp_len or cfg.data.max_response_length)
    return RewardWorker(reward, tokenizer, reward_model(cfg.reward_model, env.device), dapo)


def make_ref(cfg: TrainerConfig, env: DistEnv, model_path: str, actor: ActorWorker) -> Optional[RefWorker]:
    """The reference policy, where a KL term needs it (with LoRA: the actor's base model, adapters disabled)."""
    arr, algorithm = cfg.actor_rollout_ref, cfg.algorithm
    if not (arr.actor.use_kl_loss or algorithm.use_kl_in_reward):
        return None
    lora_policy = actor.engine if arr.model.lora_rank > 0 else None
    return RefWorker(arr.ref, arr.model, model_path, env.device, lora_policy)


def make_critic(
    cfg: TrainerConfig,
    env: DistEnv,
    model_path: str,
    resumed_from: Optional[Path],
    estimator: algos.AdvantageEstimator,
) -> Optional[CriticWorker]:
    """The critic, where ``critic.enable`` asks for it or (unset) the estimator needs one."""
    enabled = cfg.critic.enable if cfg.critic.enable is not None else estimator.needs_critic
    if not enabled:
        return None
    saved = checkpoint.saved_by_zero(resumed_from, "critic")
    return CriticWorker(cfg.critic, cfg.actor_rollout_ref.model, cfg.critic.model.path or model_path, env, saved)


def note_zero_stages(cfg: TrainerConfig, actor: ActorWorker, critic: Optional[CriticWorker], log: Log) -> None:
    """Say where a ZeRO stage asked for runs as stage 0 (one float32 process: nothing to partition)."""
    for key, requested, worker in (
        ("actor_rollout_ref.actor.zero_stage", cfg.actor_rollout_ref.actor.zero_stage, actor),
        ("critic.zero_stage", cfg.critic.zero_stage, critic),
    ):
        if worker is not None and worker.engine.zero_optimization_stage() != requested:
            log(
                f"{key}={requested} runs as stage 0: on one float32 process ZeRO has nothing to partition "
                "(the same updates, without its gradient buckets)"
            )


def nonfinite_guard(cfg: TrainerConfig, has_critic: bool) -> NonFiniteGuard:
    """The guard that stops training on a non-finite loss, its hint naming the learning rates in use."""
    rates = f"actor_rollout_ref.actor.optim.lr (now {cfg.actor_rollout_ref.actor.optim.lr:g})"
    if has_critic:
        rates += f" or critic.optim.lr (now {cfg.critic.optim.lr:g})"
    return NonFiniteGuard(cfg.trainer.nonfinite_patience, hint=f" Check the reward function and lower {rates}.")


def reuses_on_policy_log_probs(cfg: TrainerConfig, log: Log) -> bool:
    """Whether the actor takes the old log-probs from its update's forward (``actor.reuse_on_policy_log_probs``,
    applied only where that is the same math: one epoch over one mini-batch, nothing reading them before the
    update)."""
    actor, key = cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor.reuse_on_policy_log_probs"
    if not actor.reuse_on_policy_log_probs:
        return False
    reasons = []
    if actor.ppo_epochs != 1 or actor.ppo_mini_batch_size < cfg.data.train_batch_size:
        reasons.append(
            f"the update is off-policy after its first optimizer step (ppo_epochs={actor.ppo_epochs}, "
            f"ppo_mini_batch_size={actor.ppo_mini_batch_size} < data.train_batch_size={cfg.data.train_batch_size})"
            if actor.ppo_epochs == 1
            else f"the update is off-policy after its first optimizer step (ppo_epochs={actor.ppo_epochs})"
        )
    if cfg.algorithm.use_kl_in_reward:
        reasons.append("algorithm.use_kl_in_reward needs the old log-probs before the update")
    if correction(cfg).active:
        reasons.append("algorithm.rollout_correction compares the rollout's log-probs with the old ones")
    backend = cfg.actor_rollout_ref.rollout.name
    if rollout_spec(backend).returns_log_probs:
        reasons.append(f"the {backend} rollout's log-probs are compared with them (rollout/log_prob_abs_diff)")
    if reasons:
        log(f"{key}=true is not applied: " + "; ".join(reasons))
        return False
    return True


def resume_point(cfg: TrainerConfig, env: DistEnv, log: Log) -> Optional[Path]:
    """The checkpoint to resume from (the same on every rank), or None for a fresh start, in which case an earlier
    run's checkpoints are moved aside (kept, never mixed with this run's)."""
    root = Path(cfg.trainer.default_local_dir)
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always")
        path = checkpoint.find_resume_dir(root, cfg.trainer.resume_mode) if env.is_main else None
    for warning in skipped:
        log(str(warning.message))
    path = env.gather(str(path) if path else None)[0]
    if path is None and env.is_main and checkpoint.saved_steps(root):
        archive = root / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
        archive.mkdir(parents=True)
        for step in checkpoint.saved_steps(root):
            shutil.move(str(checkpoint.step_dir(root, step)), archive)
        log(
            f"checkpoint: a fresh start; the checkpoints found in {root} (another run's, or unusable) are moved to "
            f"{archive}"
        )
    env.barrier()
    if path is not None:
        env.agree(resume_changes_problem(Path(path), cfg, log if env.is_main else lambda _line: None), ConfigError)
    return Path(path) if path else None


def write_rollout_scrape_config(cfg: TrainerConfig, env: DistEnv, log: Log) -> None:
    """verl's ``rollout.prometheus``: rank 0 writes ``file``, a Prometheus configuration whose targets are this run's
    targets files, and asks the server on ``port`` of this node to reload it (as verl does for its rollout servers);
    a server that does not reload is one line."""
    settings = cfg.actor_rollout_ref.rollout.prometheus
    if not (settings.enable and env.is_main):
        return
    import json
    import urllib.request

    from rlprof.atomic_file import write_text_atomically
    from rlprof.tracking.prometheus import scrape_config

    path = Path(settings.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(scrape_config([Path(cfg.trainer.log_dir)], "10s"), indent=2) + "\n")
    url = f"http://127.0.0.1:{settings.port}/-/reload"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5):
            log(f"rollout.prometheus: wrote {path} and reloaded the Prometheus server at {url}")
    except OSError as exc:
        log(
            f"rollout.prometheus: wrote {path}; the Prometheus server at {url} did not reload ({exc}): start it with "
            "--web.enable-lifecycle and this file, or set actor_rollout_ref.rollout.prometheus.port"
        )


def resume_changes_problem(path: Path, cfg: TrainerConfig, log: Log) -> Optional[str]:
    """Why resuming from ``path`` with ``cfg`` would not continue the checkpoint's experiment (settings of
    :data:`checkpoint.EXPERIMENT_SETTINGS` changed and not in ``trainer.resume_allow_changes``), or None; the allowed
    changes are logged (they are applied: the run record holds them)."""
    changes = checkpoint.changed_settings(path, as_dict(cfg))
    allowed = set(cfg.trainer.resume_allow_changes)
    refused = {k: v for k, v in changes.items() if k not in allowed}
    for key, (saved, now) in changes.items():
        if key in allowed:
            log(f"checkpoint: resuming with {key}={now!r} (the checkpoint trained with {saved!r}; allowed)")
    if not refused:
        return None
    listed = "; ".join(f"{key}: {saved!r} there, {now!r} now" for key, (saved, now) in refused.items())
    return (
        f"resuming from {path} would change the experiment it trained: {listed}. Resume with the checkpoint's "
        f"settings, start afresh (trainer.resume_mode=disable, its checkpoints are kept aside), or allow the change: "
        f"trainer.resume_allow_changes=[{','.join(refused)}]"
    )


def make_tracker(cfg: TrainerConfig, env: DistEnv, total_steps: int, resume_step: Optional[int]) -> Optional[Tracker]:
    """Rank 0's tracker logs to every backend of ``trainer.logger``; another rank's to those every rank runs (its
    own endpoint: ``prometheus``), or None when there are none."""
    trainer = cfg.trainer
    names = parse_backends(trainer.logger)
    if cfg.actor_rollout_ref.rollout.prometheus.enable and not {"prometheus", "rl_insight"} & set(names):
        names.append("prometheus")  # verl's rollout.prometheus: the engine's series go out through it
    if not env.is_main:
        names = [name for name in names if getattr(backend_factory(name), "per_rank", False)]
        if not names:
            return None
    return Tracker(
        trainer.project_name,
        trainer.experiment_name,
        names,
        log_dir=trainer.log_dir,
        config=as_dict(cfg),
        total_steps=total_steps,
        total_epochs=trainer.total_epochs,
        resume_step=resume_step,
        table_every=trainer.table_every,
        start_timeout_s=trainer.tracker_start_timeout_s,
        rank=env.rank,
        local_rank=env.local_rank,
        options={"prometheus": dataclasses.asdict(trainer.prometheus)},
    )
