"""The layout bounds hold on another kernel path than this CPU's best (issue 56): the two-matrix
MLP's layout file (one 2-rank spawn of 14 layouts, every dimension) runs again under torch's
portable kernels (ATEN_CPU_CAPABILITY=default), and every comparison stays under half its bound.
tests/scripts/isa_margins.py runs every layout file under every path (docs/testing.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "isa_margins.py"


@pytest.mark.slow
def test_layout_bounds_hold_under_the_portable_kernels():
    done = subprocess.run([sys.executable, str(SCRIPT), "tests/test_mlp_activation.py", "--paths", "default"],
                          capture_output=True, text=True, timeout=1200, cwd=SCRIPT.parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "ok: every test passed under default; largest ratio" in done.stdout
