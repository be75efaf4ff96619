"""Mixtral interop: a random tiny MixtralForCausalLM made here, loaded into our model (logits equal
within 1e-5, fp32), and our MoE model exported into a folder transformers loads."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fivefold.config import ModelConfig, MoEConfig  # noqa: E402
from fivefold.models import build_model  # noqa: E402
from fivefold.models.hf.interop import load_pretrained, save_hf  # noqa: E402
from fivefold.models.moe.layer import MoE  # noqa: E402


def tiny_mixtral(seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # the default init leaves the router near zero; make routing decisive
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.1)
    return model


def tokens(vocab=96):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def test_load_mixtral_logits_match_transformers(tmp_path):
    hf_model = tiny_mixtral()
    hf_model.save_pretrained(tmp_path)  # per-expert tensors: block_sparse_moe.experts.{e}.w1.weight
    ours = load_pretrained(tmp_path).eval()
    assert isinstance(ours.layers["0"].feed_forward, MoE)
    assert ours.cfg.moe.n_experts == 4 and ours.cfg.moe.top_k == 2
    x = tokens()
    with torch.no_grad():
        want = hf_model(x).logits
        got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_export_mixtral_loads_in_transformers(tmp_path):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=96,
                      tie_embeddings=False, max_seq_len=64, rope_theta=1e6,
                      moe=MoEConfig(n_experts=4, top_k=2))
    ours = build_model(cfg, seed=2).eval()
    save_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["num_local_experts"] == 4
    hf_model = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, ours(x), atol=1e-5, rtol=0)
    again = load_pretrained(tmp_path)  # and back: the same weights
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
