"""LoRA (models/lora/adapters.py) with the dimensions composed: one 4-rank spawn trains dp2·tp2 (zero 1),
tp2·pp2 (1f1b), dp2·pp2 at zero 3 (FSDP2 shards the frozen base beside the adapters), cp2·tp2, an
MoE with adapters on its experts at dp2·ep2·tp2 and HSDP (dp4, shards of 2), each equal to the
single-process LoRA run under the harness rule (tests/layouts.py), the base bit for bit as it
started. The 16-rank 5D layout is in tests/test_composition.py (test_lora_5d)."""

import pytest
import torch

from layouts import TP_WEIGHT_ATOL, assert_same_run, reference, run_layout
from ranks import run_on_ranks
from test_lora import LORA, TRAIN, _initial

MOE = {"n_layers": 4, "moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64, "balance": "bias"}}


def _lora(model=None, targets="attention|mlp", **parallel) -> dict:
    return {"model": model or {"n_layers": 4}, "parallel": parallel, "train": {**TRAIN, "micro_batch": 1},
            "lora": {**LORA, "targets": targets}}


LAYOUTS = {"dp2 tp2 zero1": _lora(dp=2, tp=2, zero=1), "tp2 pp2": _lora(tp=2, pp=2),
           "dp2 pp2 zero3": _lora(dp=2, pp=2, zero=3), "cp2 tp2": _lora(cp=2, tp=2),
           "moe dp2 ep2 tp2": _lora(MOE, "attention|mlp|experts", dp=2, ep=2, tp=2, zero=1),
           # HSDP: the frozen base sharded in pairs, the pairs replicated; adapters' gradients reduced.
           "hsdp dp4 shard2": _lora(dp=4, dp_shard=2, zero=3)}


def four_ranks() -> dict:
    return {label: run_layout(layout) for label, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(4, four_ranks)


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_composed_layout_matches_the_single_process_lora_run(runs, label):
    want = reference(LAYOUTS[label])
    initial = _initial(LAYOUTS[label])
    atol = TP_WEIGHT_ATOL if "tp" in label else 1e-5
    for rank, results in enumerate(runs):
        assert_same_run(results[label], want, weight_atol=atol, label=f"lora {label} rank {rank}")
        for name, value in initial.items():
            assert torch.equal(results[label].weights[name], value), f"{label} rank {rank}: {name} moved"
