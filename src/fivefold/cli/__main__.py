"""`python -m fivefold.cli ...`, the same as `fivefold ...` and `python -m fivefold ...`."""

import sys

from fivefold.cli import main

sys.exit(main())
