"""``python -m rlprof_train.one_step_off_policy key=value ...``: verl's one-step-off trainer
(``verl.experimental.one_step_off_policy.main_ppo``), on DeepSpeed, every phase profiled by rlprof.

The launch's last ``rollout.nnodes * rollout.n_gpus_per_node`` processes are the rollout pool, the others train
(``torchrun --nproc_per_node 3 -m rlprof_train.one_step_off_policy rollout.n_gpus_per_node=1 ...``: two train, one
generates; :mod:`rlprof_train.pools`). Step ``k`` waits for its batch (``timing_s/gen``), sends the weights of the
``k - 1`` updates so far to the rollout pool (``timing_s/sync_rollout_weights``), has it start on batch ``k + 1`` and
trains on batch ``k`` meanwhile: each batch is sampled by the weights one update older than those it trains (the
first two, by the initial ones). As verl's one-step-off config: the rollout's log-probs are the old ones
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
    return main_ppo([*ONE_STEP_OFF_DEFAULTS, *argv], mode="one_step_off")


if __name__ == "__main__":
    sys.exit(main())
