import sys

from fivefold.cli import main

sys.exit(main())
