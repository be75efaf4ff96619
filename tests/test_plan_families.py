"""The planner's statistics for every model family (issue 17): parameter counts equal the built
model's for every preset, the Qwen3 counts match their model cards, and MFU is one formula (active
parameters) with one peak-FLOPs table for the planner and the trainer; (issue 18) a tp rank of
latent attention holds its latent down-projections and norms whole, as the planner counts it."""

from __future__ import annotations

import pytest

from fivefold.configure import load_config
from fivefold.plan.hardware import PROFILES
from fivefold.plan.peak_flops import device_peak_flops
from fivefold.plan.model_stats import model_stats
from fivefold.config.presets import PRESETS


def _model(preset: str):
    return load_config(None, ["--model.preset", preset]).model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_planner_parameter_count_equals_the_built_model(preset):
    from fivefold.models import build_meta_model

    cfg = _model(preset)
    model = build_meta_model(cfg)  # meta device: shapes only, no memory
    built = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter, counted once
    assert model_stats(cfg).total_params == built, preset


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_rank_of_latent_attention_holds_what_the_planner_counts(tp):
    # Built for real (one rank under a fake process group, `fivefold layout --build`); a planner that
    # split the replicated latents over tp like the heads counts 37,376 bytes too few at tp2.
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fivefold.cli", "layout", "tiny", "--model.preset",
                           "tiny-deepseek-v3", "--parallel.tp", str(tp), "--build", "--rank", "0", "--json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["param_bytes"] == report["planned_param_bytes"], report


@pytest.mark.parametrize("preset, total, active, non_embedding", [
    # The Qwen3 model cards (Hugging Face Qwen/<name>): parameters, activated, non-embedding.
    ("qwen3-0.6b", 0.6e9, 0.6e9, 0.44e9),
    ("qwen3-8b", 8.2e9, 8.2e9, 6.95e9),
    ("qwen3-32b", 32.8e9, 32.8e9, 31.2e9),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 29.9e9),
    ("qwen3-235b-a22b", 235e9, 22e9, 234e9),
])
def test_qwen3_counts_match_the_model_cards(preset, total, active, non_embedding):
    s = model_stats(_model(preset))
    # The cards round to 2-3 digits: 0.6B is 0.596B, 3.3B is 3.35B.
    assert s.total_params == pytest.approx(total, rel=0.01)
    assert s.active_params == pytest.approx(active, rel=0.02)
    assert s.total_params - s.embedding_params == pytest.approx(non_embedding, rel=0.01)


def test_qwen3_queries_are_heads_times_head_dim():
    s = model_stats(_model("qwen3-32b"))  # 64 heads x 128 = 8192 wide queries over a 5120 stream
    assert (s.q_dim, s.dim, s.kv_dim) == (8192, 5120, 1024)
    per_layer = 2 * 5120 * 8192 + 2 * 5120 * 1024 + 2 * 128  # q, o; k, v; the q/k norms
    assert s.attention_params == per_layer
    assert s.attention_flops_per_token(4096) == 12 * 8192 * 4096


# ------------------------------------------------------------------------------------------ MFU

def test_one_peak_table_for_planner_and_trainer():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == PROFILES["h100"].peak_flops
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 156e12  # TF32
    assert device_peak_flops("Some Future GPU", "bf16") is None


def test_planner_mfu_counts_active_parameters():
    from fivefold.plan import plan_layout
    from fivefold.plan.layout import layout_from_config

    cfg = load_config(None, ["--model.preset", "mixtral-8x7b", "--train.seq_len", "4096",
                             "--parallel.dp", "8", "--parallel.ep", "8", "--parallel.pp", "4"])
    est = plan_layout(cfg, layout_from_config(cfg))
    s = model_stats(cfg.model)
    want = est.tokens_per_sec_per_gpu * (6 * s.active_params + 12 * 32 * 4096 * 4096) / 989e12
    assert est.mfu == pytest.approx(want, rel=1e-12)


def test_trainer_reports_mfu_from_active_parameters(tmp_path):
    """A tiny MoE run on CPU with a stated peak (cluster.peak_tflops; CPUs have no table entry):
    the MFU it reports is tokens/s x the planner's FLOPs per token (active parameters) / peak, not
    6 x every parameter it built."""
    from layouts import tiny_config

    from fivefold.train.trainer import train

    cfg = tiny_config({"model": {"preset": "tiny-qwen3-moe"},  # 8 experts, top 2, the shape of BASE
                       "train": {"steps": 2}, "cluster": {"peak_tflops": 1.0}})
    result = train(cfg)
    s = model_stats(cfg.model)
    assert s.active_params < 0.7 * result.parallel.n_params  # where the two differ
    for record in result.records:
        want = record["tokens_per_sec"] * s.flops_per_token(cfg.train.seq_len) / 1e12
        assert record["mfu"] == pytest.approx(want, rel=1e-9)
