"""``python -m rlprof_train.fully_async_main key=value ...``: verl's fully-async trainer
(``verl.experimental.fully_async_policy.fully_async_main``), on DeepSpeed, every phase profiled by rlprof.

The launch's last ``rollout.nnodes * rollout.n_gpus_per_node`` processes are the rollout pool, the others train
(``torchrun --nproc_per_node 3 -m rlprof_train.fully_async_main rollout.n_gpus_per_node=1 ...``:
:mod:`rlprof_train.pools`). The rollout processes sample prompt groups one after another into their queues, ahead of
the trainer by at most ``int(required * (1 + async_training.staleness_threshold) * trigger_parameter_sync_step)``
groups not yet trained on (:mod:`rlprof_train.rollout_stream`); the trainer pulls ``required =
actor.ppo_mini_batch_size * async_training.require_batches`` groups for each local update and sends its weights
after every ``async_training.trigger_parameter_sync_step`` of them: a step is one parameter version
(:mod:`rlprof_train.fully_async_trainer`). ``data.train_batch_size`` is that ``required`` (verl's scripts give 0).
As verl's fully-async config: the rollout's log-probs are the old ones
(``algorithm.rollout_correction.bypass_mode=true``) unless the command line says otherwise. Everything else is
:mod:`rlprof_train.main_ppo`'s (its keys, its exit codes).
"""

from __future__ import annotations

import sys
from typing import Optional

from rlprof_train.config.verl_compat import ONE_STEP_OFF_DEFAULTS
from rlprof_train.main_ppo import main as main_ppo


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    return main_ppo([*ONE_STEP_OFF_DEFAULTS, *argv], mode="fully_async")


if __name__ == "__main__":
    sys.exit(main())
