"""Hugging Face interop: transformers' own LlamaForCausalLM is the reference for our model and loader."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import fivefold  # noqa: E402
from fivefold.config import ConfigError, ModelConfig, MoEConfig  # noqa: E402
from fivefold.models import build_model  # noqa: E402
from fivefold.models.hf.interop import config_from_hf, hf_config_from, save_hf  # noqa: E402

# head_dim 16 with theta 1e4 and original context 64 puts RoPE frequencies in all three llama3
# regimes (kept, interpolated, slowed), and SEQ > 64 reaches positions past the original context.
CASES = {
    "llama3-untied": dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=64),
                          tie_word_embeddings=False, rms_norm_eps=1e-5),
    "tied-theta5e5": dict(tie_word_embeddings=True, rope_theta=500000.0),
}
SEQ = 80


def hf_config(**overrides) -> LlamaConfig:
    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=128, max_position_embeddings=256)
    return LlamaConfig(**{**kwargs, **overrides})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order 0.1 (and norms away from 1), so that logits are O(1) and any swapped or
    mis-mapped tensor moves them far beyond the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))


def hf_model(folder, case: str, **save_kwargs) -> LlamaForCausalLM:
    model = LlamaForCausalLM(hf_config(**CASES[case])).eval()
    randomize(model, seed=1)
    model.save_pretrained(folder, **save_kwargs)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(2))


def assert_same_logits(hf: LlamaForCausalLM, ours: torch.nn.Module) -> None:
    x = tokens()
    with torch.no_grad():
        expected, got = hf(x).logits, ours(x)
    assert expected.abs().max() > 0.5  # the comparison below is not between near-zero numbers
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_load_matches_transformers(tmp_path, case):
    hf = hf_model(tmp_path, case)
    ours = fivefold.load_pretrained(tmp_path)
    assert_same_logits(hf, ours)
    assert (ours.output.weight is ours.tok_embeddings.weight) == CASES[case]["tie_word_embeddings"]
    assert all(p.dtype == torch.float32 for p in ours.parameters())


def test_load_sharded(tmp_path):
    hf = hf_model(tmp_path, "llama3-untied", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    # Some repositories also ship Meta's original weights beside the shards; the index decides.
    save_file({"tok_embeddings.weight": torch.zeros(128, 64)}, tmp_path / "consolidated.safetensors")
    assert_same_logits(hf, fivefold.load_pretrained(tmp_path))


@pytest.mark.parametrize("case", CASES)
def test_round_trip_through_transformers(tmp_path, case):
    cfg = config_from_hf(hf_config(**CASES[case]).to_dict())
    ours = build_model(cfg, seed=3).eval()
    randomize(ours, seed=4)
    save_hf(ours, tmp_path)
    hf, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.dtype == torch.float32
    assert_same_logits(hf.eval(), ours)
    back = fivefold.load_pretrained(tmp_path)
    assert back.cfg == cfg
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_config_round_trip():
    cfg = ModelConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                      tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=4096,
                      rope_scaling=32.0, rope_low_freq_factor=2.0, rope_high_freq_factor=8.0,
                      rope_original_max_seq_len=1024)
    written = hf_config_from(cfg)
    assert config_from_hf(written) == cfg
    # transformers 5 rewrites RoPE as `rope_parameters`; that form must read the same.
    rewritten = LlamaConfig(**written).to_dict()
    assert "rope_parameters" in rewritten
    assert config_from_hf(rewritten) == cfg


def test_export_refuses_moe_that_is_not_mixtral():
    with pytest.raises(ConfigError, match="model.moe .n_experts=4. is not Mixtral-shaped"):
        hf_config_from(ModelConfig(moe=MoEConfig(n_experts=4, balance="bias")))


@pytest.mark.parametrize("change, message", [
    (dict(attention_bias=True), "sets attention_bias=true; fivefold's projections have no biases"),
    (dict(mlp_bias=True), "sets mlp_bias=true"),
    (dict(head_dim=None, hidden_size=66), "has hidden_size=66 not divisible by num_attention_heads=4 and no head_dim"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "uses rope_type 'yarn'"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)), "uses rope_type 'linear'"),
    (dict(model_type="mistral"), "has model_type 'mistral'; fivefold reads model_type 'llama', 'mixtral', 'qwen3', 'qwen3_moe'"),
    (dict(hidden_act="gelu"), "has hidden_act 'gelu'"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "uses rope_type 'llama3' but lacks some of"),
    (dict(num_key_value_heads=3), "has num_attention_heads=4 and num_key_value_heads=3; the kv heads "
                                  "must divide the heads"),
])
def test_config_rejects_what_the_model_cannot_express(change, message):
    raw = {**hf_config().to_dict(), **change}
    with pytest.raises(ConfigError, match=f"^config.json {re.escape(message)}"):
        config_from_hf(raw)


def _edit_weights(folder, edit) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("edit, parts", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     ["is missing tensor model.layers.1.mlp.up_proj.weight (shape [96, 64]) that config.json implies"]),
    (lambda t: t.update({"model.norm.weight": torch.ones(65)}),
     ["tensor model.norm.weight in ", "has shape [65], but config.json implies [64]"]),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}),
     ["holds tensor model.layers.0.self_attn.q_proj.bias, which fivefold's llama has no place for"]),
])
def test_bad_weights_get_one_sentence(tmp_path, edit, parts):
    hf_model(tmp_path, "llama3-untied")
    _edit_weights(tmp_path, edit)
    with pytest.raises(ConfigError) as err:
        fivefold.load_pretrained(tmp_path)
    message = str(err.value)
    assert all(part in message for part in parts) and str(tmp_path) in message, message


def test_folder_problems(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json; .*fivefold checkpoints cannot be loaded"):
        fivefold.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config().to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="has no \\*.safetensors weight files; it has pytorch_model.bin"):
        fivefold.load_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="is not a folder"):
        fivefold.load_pretrained(tmp_path / "nowhere")
