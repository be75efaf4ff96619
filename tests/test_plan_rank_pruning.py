"""worst_rank_memory evaluates only the pipeline ranks that can hold the most (plan/memory/peak.py
candidate_ranks, issue 53's search speed): the answer must be the one every rank gives, under each
schedule, with micro-batch counts that clip the in-flight counts and with MoE and dense stages."""

from __future__ import annotations

import pytest

from fivefold.configure import load_config
from fivefold.plan.memory import peak as memory
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import runtime_for
from fivefold.plan.layout import Layout
from fivefold.plan.pipeline.schedule import pipeline_ranks
from fivefold.plan.workload import workload_from_config


def _all_ranks(workload, layout, hw, runtime):
    ranks = pipeline_ranks(workload.stats, layout, workload.seq_len)
    return max((memory.rank_memory(workload, layout, hw, runtime, p, r) for r, p in enumerate(ranks)),
               key=lambda mb: mb.total)


CASES = [  # (preset, global batch, layouts): m = global batch / (dp x mbs) from 2 to 64
    ("llama3-70b", 64, [Layout(dp=2, tp=8, pp=8, mbs=1, pp_schedule=s, pp_virtual=v, zero=1)
                        for s, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb", 2),
                                     ("zbv", 2))]),
    ("llama3-70b", 16, [Layout(dp=2, tp=8, pp=16, mbs=1, pp_schedule="zbv", pp_virtual=2, zero=1),
                        Layout(dp=2, tp=8, pp=16, mbs=4, pp_schedule="zbv", pp_virtual=2, zero=1),
                        Layout(dp=1, tp=8, pp=10, mbs=1, pp_schedule="1f1b", zero=0)]),
    # ZB-V with p < m < 2p: the first chunk's count is clipped at m for the low ranks, and stages
    # of 4 and 3 layers (126 over 32 chunks) weigh the two chunks differently: the worst rank of a
    # shape is the last of a linear piece, not its first
    ("llama3-405b", 20, [Layout(dp=1, tp=8, pp=16, mbs=1, pp_schedule="zbv", pp_virtual=2, zero=0),
                         Layout(dp=1, tp=8, pp=16, mbs=1, pp_schedule="dualpipev", pp_virtual=2, zero=0)]),
    # ... and with ranks 1-6 holding 7-layer first chunks and 4-layer second ones (pp_layers) at
    # m = 10: rising while the first chunk's count is clipped, then falling: the worst is the last
    # rank of the first piece (rank 5), the first of no piece
    ("llama3-70b", 10, [Layout(dp=1, tp=8, pp=8, mbs=1, pp_schedule="zbv", pp_virtual=2, zero=0,
                               pp_layers="1,7,7,7,7,7,7,7,4,4,4,4,4,4,4,2")]),
    ("deepseek-v3", 256, [Layout(dp=8, ep=8, pp=16, mbs=1, pp_schedule="dualpipev", pp_virtual=2, zero=1),
                          Layout(dp=8, ep=8, pp=16, mbs=8, pp_schedule="dualpipev", pp_virtual=2, zero=1),
                          Layout(dp=8, ep=8, pp=12, mbs=2, pp_schedule="zbv", pp_virtual=2, zero=1),
                          Layout(dp=8, ep=8, pp=16, mbs=1, pp_schedule="interleaved_1f1b", pp_virtual=2,
                                 zero=1)]),
]


@pytest.mark.parametrize("preset,batch,layouts", CASES, ids=[c[0] + "-" + str(c[1]) for c in CASES])
def test_the_pruned_ranks_give_every_rank_s_worst(preset, batch, layouts):
    cfg = load_config(None, ["--model.preset", preset, "--train.seq_len", "4096", "--train.global_batch",
                             str(batch), "--train.dtype", "bf16"])
    workload, hw, runtime = workload_from_config(cfg), hardware_for("h100"), runtime_for(False)
    for layout in layouts:
        fast = memory.worst_rank_memory(workload, layout, hw, runtime)
        assert fast.total == pytest.approx(_all_ranks(workload, layout, hw, runtime).total, rel=1e-12), layout
        assert len(memory.candidate_ranks(workload, layout)) < layout.pp  # something was pruned
