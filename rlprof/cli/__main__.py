import sys

from rlprof.cli import main

sys.exit(main())
