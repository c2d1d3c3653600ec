"""``python -m qprobe.cli``: the ``qprobe`` command, as the tests and ``qprobe bench`` run it."""

import sys

from qprobe.cli import main

sys.exit(main())
