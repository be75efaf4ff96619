"""benchmarks/gpu.sh --dry-run runs the GPU benchmark's code path end to end on CPU with a tiny shape
and writes its table. No timings are asserted (docs/design.md: speed lives in benchmarks/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_script_dry_run_writes_a_table(tmp_path):
    out = tmp_path / "gpu.md"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    # Compiled variants need a C++ toolchain and minutes on CPU; two variants cover the rest of the
    # path (a subprocess per variant, the fivefold trainer with recomputation, the transformers
    # loop, the table, the JSON).
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run",
                           "--variants", "eager+recompute,transformers,activations,fp8", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert "| eager+recompute |" in text and "| transformers |" in text
    assert "/ transformers tokens/s" in text
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["eager+recompute", "transformers", "activations", "fp8"]
    for row in data["rows"]:
        assert "error" not in row, row
    for row in data["rows"][:2] + data["rows"][3:]:
        assert row["tokens_per_sec"] > 0 and row["n_params"] > 0
    assert "| fp8 |" in text
    kept = {a["recompute"]: a["measured_bytes"] for a in data["rows"][2]["activations"]}
    assert kept["none"] > kept["selective"] > kept["full"] > 0
    assert "| selective |" in text


def test_gpu_bench_rejects_unknown_variant(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--dry-run",
                           "--variants", "nope", "--out", str(tmp_path / "x.md")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown variant 'nope'" in proc.stderr
