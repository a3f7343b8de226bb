"""``python -m rlprof_train.main_ppo key=value ...``: PPO training on DeepSpeed, every phase profiled by rlprof.

Runs as one process, or data-parallel under ``torchrun --nproc_per_node N -m rlprof_train.main_ppo ...`` or the
``deepspeed`` launcher. Overrides use verl's keys (see rlprof_train/config/ppo_trainer.yaml); ``+key=value`` adds a
key. The config is checked completely before anything is loaded.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

import rlprof
from rlprof.config import ConfigError
from rlprof_train.config import load_trainer_config, validate


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for arg in [a for a in argv if a.startswith("--local_rank")]:  # added by the deepspeed launcher
        argv.remove(arg)
        os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg = load_trainer_config(argv)
        validate(cfg, world_size)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    from rlprof_train.trainer import PPOTrainer
    from rlprof_train.workers.engine import init_distributed

    device = cfg.trainer.device if cfg.trainer.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    env = init_distributed(device)
    rlprof.init(cfg)
    log = (lambda line: print(f"[INFO] {line}", file=sys.stderr, flush=True)) if env.is_main else (lambda line: None)
    try:
        trainer = PPOTrainer(cfg, env, log)
        trainer.fit()
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        rlprof.shutdown()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
