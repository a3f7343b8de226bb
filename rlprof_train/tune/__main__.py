"""``python -m rlprof_train.tune``: see :mod:`rlprof_train.tune.cli`."""

import sys

from rlprof_train.tune.cli import main

sys.exit(main())
