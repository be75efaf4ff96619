import os
import sys

# Let tests import the harness (tests/ranks.py) and helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
