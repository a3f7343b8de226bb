"""``rlprof_train.tune``: data-driven tuning of the trainer's performance knobs, measured with rlprof, math unchanged.

See :mod:`rlprof_train.tune.cli` for the command, :mod:`~rlprof_train.tune.space` for the knobs,
:mod:`~rlprof_train.tune.search` for the strategy and :mod:`~rlprof_train.tune.verify` for the final check.
"""
