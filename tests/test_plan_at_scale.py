"""The planner at scale, checked against the real sharding code without a cluster: rank 0 of
Llama 3 405B on 8,192 GPUs (TP 8 x PP 16 x DP 64), built on the meta device."""

import subprocess
import sys
from pathlib import Path

from fivefold.configure import load_config
from fivefold.plan.layout import Layout
from fivefold.plan.memory.peak import rank_param_counts
from fivefold.plan.model_stats import model_stats
from fivefold.plan.pipeline.schedule import pipeline_ranks

SCRIPT = Path(__file__).parent / "scripts" / "rank_shard_on_meta.py"


def test_rank0_of_the_8192_gpu_layout_holds_what_the_planner_predicts():
    stats = model_stats(load_config(None, {"model": {"preset": "llama3-405b"}}).model)
    layout = Layout(dp=64, tp=8, pp=16, zero=1, mbs=1, pp_schedule="1f1b")
    ranks = pipeline_ranks(stats, layout, 8192)
    predicted = sum(rank_param_counts(stats, layout, ranks[0]))
    # The script lets the trainer's pipeline code split the model itself (same costs, same rule).
    done = subprocess.run([sys.executable, str(SCRIPT), "llama3-405b", "64", "8", "16", ""],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    built = int(done.stdout.split()[-1])
    assert built == predicted  # every parameter accounted for, to the element
