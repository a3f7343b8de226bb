"""Checkpoints: ``{default_local_dir}/global_step_{N}/`` with the actor's and critic's DeepSpeed states and the
trainer's own state.

A checkpoint is complete only when its ``COMPLETE`` manifest exists (written last, atomically, after every rank
saved), listing each file with its size and XXH3 digest. Resuming checks that manifest and falls back to the newest
complete checkpoint, naming each one it skipped, so a run killed while saving, a truncated or altered file or a deleted
folder never blocks a resume. ``latest_checkpointed_iteration.txt`` is kept for verl's tools; it is informational.

Resume loads pickled optimizer state (DeepSpeed's ``torch.load(weights_only=False)``): resume only from checkpoints
you wrote. Checkpoint folders are resolved strictly inside ``default_local_dir``.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import re
import shutil
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from rlprof.atomic_file import write_text_atomically
from rlprof_train.config.verl_compat import flatten

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
COMPLETE = "COMPLETE"
CONFIG = "config.json"
SHARED_MARKER = ".rlprof_shared_check"
EXPERIMENT_SETTINGS = (
    "data.train_files",
    "data.task",
    "data.task_max_operand",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.truncation",
    "data.filter_overlong_prompts",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.lora_*",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.model.exclude_modules",
    "actor_rollout_ref.actor.optim.*",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio*",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_*",
    "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.response_length",
    "critic.enable",
    "critic.model.path",
    "critic.optim.*",
    "critic.ppo_mini_batch_size",
    "critic.ppo_epochs",
    "critic.cliprange_value",
    "algorithm.*",
    "reward_model.enable",
    "reward_model.model.path",
    "custom_reward_function.path",
    "custom_reward_function.name",
    "trainer.seed",
    "trainer.critic_warmup",
)
"""The settings that make a run the experiment it is (dotted keys, ``*`` patterns): a resume that changes one from
the checkpoint's is refused unless ``trainer.resume_allow_changes`` names it. Speed and memory knobs, logging,
profiling, checkpointing and the run's length are free to change."""
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (or written); the message says which and what to do."""


class DiskFull(CheckpointError):
    """The checkpoint did not fit on its disk: the folder, the bytes it needs and the bytes free."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def save(
    root: Path,
    step: int,
    engines: dict[str, Any],
    state: dict[str, Any],
    is_main: bool,
    barrier: Callable[[], None],
    keep: Optional[int],
    config: dict[str, Any],
) -> Path:
    """Save every engine (a collective: all ranks call it), the trainer state and the resolved ``config`` the run
    trained with, then mark the step complete."""
    target = step_dir(root, step)
    if is_main and target.exists():  # an earlier attempt at this step that never completed
        shutil.rmtree(target)
    barrier()
    try:
        for tag, engine in engines.items():  # frozen base weights (LoRA) are in the model directory already
            engine.save_checkpoint(
                str(target), tag=tag, save_latest=False, exclude_frozen_parameters=_has_frozen(engine)
            )
        barrier()  # every rank's shards are on disk
        if is_main:
            write_text_atomically(target / STATE, json.dumps({**state, "global_step": step}))
            write_text_atomically(target / CONFIG, json.dumps(config, default=str))
            mark_complete(target, step)
            write_text_atomically(Path(root) / LATEST, str(step))
            if keep:
                prune(root, keep)
    except (OSError, RuntimeError) as exc:
        full = _disk_full(root, target, step, engines, exc)
        if full is None:
            raise
        if is_main:  # an incomplete checkpoint is never resumed from: give its space back to the run's other files
            shutil.rmtree(target, ignore_errors=True)
        raise full from exc
    barrier()
    return target


def _disk_full(root: Path, target: Path, step: int, engines: dict[str, Any], exc: BaseException) -> Optional[DiskFull]:
    """The save failed because the disk is full: ``ENOSPC``, or what torch's writer says instead ("unexpected
    pos", no errno) while what is left to write does not fit in what is free. None for any other failure."""
    written = sum(p.stat().st_size for p in target.rglob("*") if p.is_file()) if target.is_dir() else 0
    needed = max(_last_checkpoint_bytes(root), _estimated_bytes(engines), written)
    free = shutil.disk_usage(target if target.is_dir() else root).free
    causes = [exc, exc.__cause__, exc.__context__]
    if not any(getattr(cause, "errno", None) == errno.ENOSPC for cause in causes) and free + written >= needed:
        return None
    return DiskFull(
        f"No space left on device: the checkpoint of step {step} in {target} needs about {_size(needed)}, "
        f"{_size(free + written)} is free there; free space or set trainer.default_local_dir to a larger disk "
        "(trainer.max_actor_ckpt_to_keep keeps fewer)"
    )


def _last_checkpoint_bytes(root: Path) -> int:
    """The size of the newest complete checkpoint (what the next one will take), or 0."""
    for step in reversed(saved_steps(root)):
        try:
            files = json.loads((step_dir(root, step) / COMPLETE).read_text())["files"]
            return sum(int(entry["bytes"]) for entry in files.values())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return 0


def _estimated_bytes(engines: dict[str, Any]) -> int:
    """The weights plus Adam's two fp32 moments (and an fp32 master copy of weights kept in 16 bits) per trainable
    parameter, over every engine: roughly what one checkpoint writes."""
    total = 0
    for engine in engines.values():
        for parameter in engine.module.parameters():
            count = int(getattr(parameter, "ds_numel", parameter.numel()))  # ZeRO-3: the full size, not the shard
            total += count * parameter.element_size()
            if parameter.requires_grad:
                total += count * (8 + (4 if parameter.element_size() < 4 else 0))
    return total


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def file_digest(path: Path) -> str:
    """XXH3-128 of a file's bytes, read in 4 MiB blocks: a non-cryptographic hash that finds damage, not tampering
    (benchmarks/test_checkpoint_digest.py: its cost against writing the checkpoint)."""
    import xxhash

    digest = xxhash.xxh3_128()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(4 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def mark_complete(target: Path, step: int) -> None:
    """Write ``COMPLETE``: every file of the checkpoint with its size and digest (the last file written)."""
    files = {
        str(p.relative_to(target)): {"bytes": p.stat().st_size, "xxh3_128": file_digest(p)}
        for p in sorted(target.rglob("*"))
        if p.is_file() and p.name != COMPLETE
    }
    write_text_atomically(target / COMPLETE, json.dumps({"global_step": step, "files": files}))


def saved_steps(root: Path) -> list[int]:
    """Steps of the ``global_step_N`` folders under ``root``, ascending (complete or not)."""
    if not Path(root).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)))


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (and incomplete older ones); return what went."""
    steps = [s for s in saved_steps(root) if (step_dir(root, s) / COMPLETE).exists()]
    newest_kept = steps[-keep:] if steps else []
    doomed = [step_dir(root, s) for s in saved_steps(root) if newest_kept and s < newest_kept[0]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def problem(path: Path) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be resumed from, or None when it is complete and intact."""
    if not path.is_dir():
        return "the folder does not exist"
    marker = path / COMPLETE
    if not marker.exists():
        return "it was never completed (no COMPLETE manifest: the run stopped while saving)"
    try:
        files = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError):
        return "its COMPLETE manifest is damaged"
    for name, written in files.items():
        file = path / name
        if not file.exists():
            return f"{name} is missing"
        size = written["bytes"] if isinstance(written, dict) else written  # an older COMPLETE lists sizes only
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
        if isinstance(written, dict) and file_digest(file) != written.get("xxh3_128"):
            return f"{name} does not hold what was written (its XXH3 digest differs: changed on disk since the save)"
    try:
        json.loads((path / STATE).read_text(encoding="utf-8"))["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{STATE} is damaged"
    return None


def find_resume_dir(root: Path, resume_mode: str) -> Optional[Path]:
    """The checkpoint to resume from: ``disable`` -> None; ``auto`` -> the newest intact one (warning about each
    newer one skipped), or None; a ``global_step_N`` folder -> that one, which must be intact."""
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        path = Path(resume_mode)
        reason = problem(path)
        if reason is not None:
            raise CheckpointError(f"trainer.resume_mode={resume_mode}: cannot resume from it: {reason}")
        return path
    for step in reversed(saved_steps(root)):
        path = step_dir(root, step)
        reason = problem(path)
        if reason is None:
            return path
        warnings.warn(f"checkpoint {path} is skipped: {reason}; trying the previous one", RuntimeWarning, stacklevel=2)
    return None


def changed_settings(path: Path, config: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The :data:`EXPERIMENT_SETTINGS` whose value in ``config`` differs from the one checkpoint ``path`` was trained
    with: ``{key: (saved, now)}`` (empty for a checkpoint that predates the saved config)."""
    try:
        saved = dict(flatten(json.loads((Path(path) / CONFIG).read_text(encoding="utf-8"))))
    except (OSError, ValueError):
        return {}
    now = dict(flatten(json.loads(json.dumps(config, default=str))))
    keys = {k for k in set(saved) | set(now) if any(fnmatch.fnmatchcase(k, p) for p in EXPERIMENT_SETTINGS)}
    return {k: (saved.get(k), now.get(k)) for k in sorted(keys) if saved.get(k) != now.get(k)}


def _has_frozen(engine: Any) -> bool:
    return any(not p.requires_grad for p in engine.module.parameters())


def saved_by_zero(path: Optional[Path], tag: str) -> bool:
    """Whether the ``tag`` state of checkpoint ``path`` was saved by a ZeRO engine (its optimizer state in ZeRO's
    per-rank files), which only a ZeRO engine loads."""
    return path is not None and any((Path(path) / tag).glob("zero_pp_rank_*_optim_states.pt"))


def load(path: Path, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore every engine (optimizer included) from ``path`` and return the trainer state."""
    for tag, engine in engines.items():
        try:
            loaded, _ = engine.load_checkpoint(
                str(path),
                tag=tag,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
                load_module_strict=not _has_frozen(engine),  # LoRA: the saved state holds the adapters only
            )
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {path}: the {tag} state does not load ({type(exc).__name__}: {exc}); "
                "resume from an earlier one with trainer.resume_mode=<its global_step_N folder>"
            ) from exc
        if loaded is None:
            raise CheckpointError(f"checkpoint {path} has no {tag!r} state")
    state: dict[str, Any] = json.loads((Path(path) / STATE).read_text(encoding="utf-8"))
    return state


def shared_directory_problem(root: Path, token: str, is_main: bool, barrier: Callable[[], None]) -> Optional[str]:
    """Whether every rank sees ``root`` as one folder: rank 0 writes a marker holding ``token`` (same on all ranks),
    each rank looks for it. Returns what this rank found wrong, or None. All ranks must call it."""
    marker = Path(root) / SHARED_MARKER
    if is_main:
        Path(root).mkdir(parents=True, exist_ok=True)
        write_text_atomically(marker, token)
    barrier()
    try:
        seen = marker.read_text(encoding="utf-8")
    except OSError:
        seen = None
    barrier()
    if is_main:
        marker.unlink(missing_ok=True)
    if seen == token:
        return None
    return (
        f"trainer.default_local_dir={root} is not shared between the nodes: rank 0 wrote a marker there that "
        f"{socket.gethostname()} cannot see; checkpoints of a multi-node run need a directory every node mounts "
        "(or trainer.save_freq=-1 and trainer.resume_mode=disable for a run without checkpoints)"
    )
