"""``python -m rlprof_train.main_ppo key=value ...``: PPO training on DeepSpeed, every phase profiled by rlprof.

Runs as one process, or data-parallel under ``torchrun --nproc_per_node N -m rlprof_train.main_ppo ...`` or the
``deepspeed`` launcher. Overrides use verl's keys (see rlprof_train/config/ppo_trainer.yaml; types, ranges and a
docstring per key in rlprof_train/config/schema.py). The config is checked completely before anything is loaded.

``--cfg job`` (Hydra's flag, as verl users check a script with it): load, translate and check the config, print it
as YAML with what became of verl's keys, and exit without training (nothing is written).

Exit codes: 0 done; 2 a configuration problem (one line, before any work, or a folder another run holds);
3 the device ran out of memory (a last line naming the step, role, phase, bytes, the OOM snapshot and an override to
try); 1 any other error during training (with its traceback; the other ranks stop too, none is left waiting).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import rlprof
from rlprof.session import new_run_id
from rlprof.typed_config import ConfigError
from rlprof_train.config import TrainerConfig, as_dict
from rlprof_train.config.load import load, training_device
from rlprof_train.config.schema import TrainerMode
from rlprof_train.launch import LaunchWorld, launch_world, settle_local_rank
from rlprof_train.preflight import validate

if TYPE_CHECKING:
    from rlprof_train.pools import Link, Pool
    from rlprof_train.progress import Progress
    from rlprof_train.workers.engine import DistEnv


def main(argv: Optional[list[str]] = None, mode: TrainerMode = "sync") -> int:
    """The trainer's command line; ``mode``: which trainer (the one-step-off one's: :mod:`.one_step_off_policy`; the
    fully-async one's: :mod:`.fully_async_main`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:  # rlprof-train tune ...
        from rlprof_train.tune.cli import main as tune

        return tune(argv[1:])
    for arg in [a for a in argv if a.startswith("--local_rank")]:  # added by the deepspeed launcher
        argv.remove(arg)
        os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    try:
        print_only = printed_config(argv)
        launched = launch_world()
        world_size = launched.world_size
        loaded = load(argv, world_size, mode=mode)
        cfg = loaded.cfg
        validate(cfg, world_size, mode)
        pool = launch_pool(cfg, world_size) if mode != "sync" else None
    except (ConfigError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if print_only:
        import yaml

        for note in loaded.notes:
            print(f"[INFO] config: {note}", file=sys.stderr)
        print(yaml.safe_dump(as_dict(cfg), sort_keys=False), end="")
        return 0

    settle_local_rank(launched)
    from rlprof_train.fully_async_trainer import FullyAsyncTrainer
    from rlprof_train.pools import join_pool
    from rlprof_train.progress import Progress
    from rlprof_train.trainer import PPOTrainer
    from rlprof_train.workers.engine import init_distributed

    device = training_device(cfg)
    cuda_index, weights_device = gpu_placement(pool, device, launched)
    links: list[Link] = []
    join = (lambda backend, timeout: links.append(join_pool(pool, backend, timeout, weights_device))) if pool else None
    env = init_distributed(device, cfg.trainer.collective_timeout_s, join, cuda_index)
    link = links[0] if links else None
    progress = Progress(env.rank, env.world_size, cfg.trainer.collective_timeout_s)
    if pool is not None and link is not None and pool.name == "rollout":
        return finish(train(lambda: serve_rollout(cfg, pool, link, env, mode), pool.global_rank, progress), progress)
    run_id = env.gather(new_run_id())[0]
    rlprof.init(  # the ranks rlprof records are the launch's (a pool's group numbers its own)
        as_dict(cfg),
        run_id=run_id,
        rank=pool.global_rank if pool else None,
        world_size=pool.world_size if pool else None,
        pool=pool.name if pool else None,
    )
    log: Callable[[str], None] = (
        (lambda line: print(f"[INFO] {line}", file=sys.stderr, flush=True)) if env.is_main else (lambda line: None)
    )
    for note in loaded.notes:  # what became of verl's spellings
        log(f"config: {note}")
    if link is not None:
        how = "GPU to GPU over NCCL" if link.weights is not None else "as host copies over gloo"
        log(f"rollout pool: the weights cross {how} (rlprof_train.pools.weights_on_gpus)")
    held = env.memory_at_start[1] - env.memory_at_start[0] if env.memory_at_start else None
    trainer = FullyAsyncTrainer if mode == "fully_async" else PPOTrainer
    fit = lambda: trainer(cfg, env, run_id, log, progress, link, launched.per_node).fit()  # noqa: E731
    return finish(train(fit, env.rank, progress, as_dict(cfg), held), progress)


def gpu_placement(pool: Optional[Pool], device: str, launched: LaunchWorld) -> tuple[Optional[int], Any]:
    """An asynchronous trainer's process on CUDA: (its GPU, that GPU where the weights cross GPU to GPU, else None);
    (None, None) otherwise. The pools share a node's GPUs where it has fewer than processes
    (:func:`~rlprof_train.pools.device_index`, :func:`~rlprof_train.pools.weights_on_gpus`)."""
    if pool is None or device != "cuda":
        return None, None
    import torch

    from rlprof_train.pools import device_index, weights_on_gpus

    visible = torch.cuda.device_count()
    index = device_index(pool, launched.per_node, launched.local_rank, visible)
    return index, torch.device("cuda", index) if weights_on_gpus(device, launched.per_node, visible) else None


def serve_rollout(cfg: TrainerConfig, pool: Pool, link: Link, env: DistEnv, mode: TrainerMode) -> None:
    """A rollout process of the pool: the one-step-off loop or the fully-async one; rollout rank 0 logs."""
    from rlprof_train.rollout_pool import serve
    from rlprof_train.rollout_stream import serve_stream

    def say(line: str) -> None:
        if pool.rank == 0:
            print(f"[INFO] {_rollout_line(line)}", file=sys.stderr, flush=True)

    (serve_stream if mode == "fully_async" else serve)(cfg, pool, link, env, say)


def _rollout_line(line: str) -> str:
    """A rollout process's log line, said to come from the rollout (once: a backend's own lines already say it)."""
    return line if line.startswith("rollout") else f"rollout: {line}"


def launch_pool(cfg: TrainerConfig, world_size: int) -> Pool:
    """This process's pool in an asynchronous trainer's launch (``RANK``: its rank in the launch)."""
    from rlprof_train.pools import pool_of, rollout_pool_size

    size = rollout_pool_size(cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node, world_size)
    return pool_of(int(os.environ.get("RANK", "0")), world_size, size)


def finish(code: int, progress: Progress) -> int:
    """End the profiling session and the process group after training or serving the rollout: ``code``."""
    import torch

    progress.close()
    rlprof.shutdown()
    if torch.distributed.is_initialized():
        if code == 0:
            torch.distributed.barrier()  # gloo can abort at teardown while a peer still sends; settle first
            torch.distributed.destroy_process_group()
        else:  # a peer may be waiting in a collective for this rank: leave now so its connection fails, not hangs
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def printed_config(argv: list[str]) -> bool:
    """Take Hydra's ``--cfg job`` (``--cfg=job``, ``-c job``) out of ``argv``: whether it was there. Hydra's other
    parts (``hydra``, ``all``) are not this trainer's: refused."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag not in ("--cfg", "-c"):
            continue
        if not value:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            del argv[i : i + 2]
        else:
            del argv[i]
        if value != "job":
            raise ConfigError(f"{flag} {value!r}: only 'job' is printed here (the trainer's config; no Hydra config)")
        return True
    return False


def train(
    fit: Callable[[], None],
    rank: int,
    progress: Progress,
    config: Optional[dict[str, Any]] = None,
    held_at_start: Optional[int] = None,
) -> int:
    """Build the trainer and train (``fit``); the exit code. Errors found while preparing are config errors (one
    line, 2); a full disk and DAPO's generation limit are one line (1); the device out of memory keeps its
    traceback, then one line saying where, what was asked, what the device held before the run (``held_at_start``),
    the OOM snapshot and an override from the run's ``config`` (3, :mod:`rlprof_train.out_of_memory`); any other
    error keeps its traceback, then one line naming the rank (and, for a collective that timed out, who stopped
    answering and where)."""
    import torch

    from rlprof_train.checkpoint import DiskFull
    from rlprof_train.dynamic_sampling import GenerationLimit
    from rlprof_train.out_of_memory import EXIT_CODE, out_of_memory_line

    try:
        fit()
    except ConfigError as exc:  # found while preparing (a folder in use, nodes without a shared folder)
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (DiskFull, GenerationLimit) as exc:  # the cause and what to change (not torch's "unexpected pos")
        print(f"error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    except torch.OutOfMemoryError as exc:
        traceback.print_exc()
        where = progress.here
        line = out_of_memory_line(exc, config or {}, rank, where.step, progress.role, where.phase, held_at_start)
        print(f"error on rank {rank}: {line}", file=sys.stderr, flush=True)
        return EXIT_CODE
    except BaseException as exc:  # noqa: BLE001  (training errors keep their traceback; Ctrl-C too)
        traceback.print_exc()
        stall = progress.stall_report(exc)
        print(f"error on rank {rank}: {stall or f'{type(exc).__name__}: {exc}'}", file=sys.stderr, flush=True)
        return 130 if interrupted(exc) else 1
    return 0


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C, or an error raised while a Ctrl-C unwound (a library's cleanup that failed on the
    way: vLLM's tokenizer pool turns one landing in its ``get`` into an ``UnboundLocalError``)."""
    seen: set[int] = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
