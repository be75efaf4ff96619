"""Hugging Face parity for every family, against transformers' own classes: a random tiny model made
here and loaded by us gives transformers' logits (1e-5, fp32); our model exported loads in
transformers with the same logits; `fivefold convert` both ways keeps every tensor; and what a
family cannot express is refused in one sentence."""

import dataclasses
import json
import re

import pytest
import torch
from hf_parity import assert_same_logits, logits, our_moe_layers, random_weights, stored

transformers = pytest.importorskip("transformers")

import fivefold  # noqa: E402
from fivefold.cli import main as cli  # noqa: E402
from fivefold.config import ConfigError  # noqa: E402
from fivefold.configure import load_config  # noqa: E402
from fivefold.models import build_model  # noqa: E402
from fivefold.models.hf.interop import config_from_hf, hf_config_from, load_pretrained, save_hf  # noqa: E402
from fivefold.models.moe.layout import is_moe_layer  # noqa: E402

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)

# family -> transformers' (config class, model class).
CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
}
_QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=12)

# Models made by transformers: (family, config keys on top of SMALL). head_dim 24 and 12 differ from
# hidden/heads = 8; moe_intermediate_size 24 differs from intermediate_size 48.
HF_CASES = {
    "llama": ("llama", dict(rope_theta=5e5, tie_word_embeddings=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3-untied": ("qwen3", dict(head_dim=24, tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3-tied": ("qwen3", dict(head_dim=12, tie_word_embeddings=True)),
    # decoder_sparse_step 2 with layer 1 listed dense: MoE layers 3 and 5 only.
    "qwen3_moe-step2": ("qwen3_moe", dict(_QWEN3_MOE, num_hidden_layers=6, decoder_sparse_step=2,
                                          mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen3_moe-listed": ("qwen3_moe", dict(_QWEN3_MOE, num_hidden_layers=4, mlp_only_layers=[0, 2],
                                           norm_topk_prob=False, tie_word_embeddings=True)),
}

# Our models, from presets: (preset, [model] overrides). The Mixtral one has experts as wide as
# ffn_dim, as Mixtral's are. The last two are layer patterns and routing transformers spells
# differently: first_dense=1 with every=1 (written as mlp_only_layers [0]), and top-1 routing,
# whose probability weighting is norm_topk_prob=false there.
OUR_CASES = {
    "llama-tiny": ("tiny", {}),
    "mixtral-tiny-moe": ("tiny-moe", dict(moe=dict(expert_ffn_dim=0))),
    "qwen3-tiny": ("tiny-qwen3", {}),
    "qwen3-tiny-tied-llama3-rope": ("tiny-qwen3", dict(tie_embeddings=True, rope_scaling=8.0,
                                                       rope_original_max_seq_len=8)),
    "qwen3_moe-tiny": ("tiny-qwen3-moe", {}),
    "qwen3_moe-every2-llama3-rope": ("tiny-qwen3-moe", dict(rope_scaling=8.0, rope_original_max_seq_len=8, moe=dict(
        every=2, first_dense=1, dense_layers="", norm_topk_prob=False))),
    "qwen3_moe-first-dense-top1": ("tiny-qwen3-moe", dict(moe=dict(first_dense=1, dense_layers="", top_k=1))),
}


def hf_model(case: str) -> torch.nn.Module:
    family, keys = HF_CASES[case]
    config_class, model_class = CLASSES[family]
    return random_weights(model_class(config_class(**{**SMALL, **keys})), seed=1)


def our_config(case: str):
    preset, keys = OUR_CASES[case]
    return load_config(None, {"model": {"preset": preset, **keys}}).model


def hf_moe_layers(hf) -> list[bool]:
    return [any(name.endswith("experts") for name, _ in layer.mlp.named_modules()) for layer in hf.model.layers]


@pytest.mark.parametrize("case", HF_CASES)
def test_load_matches_transformers(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    ours = fivefold.load_pretrained(tmp_path)
    assert ours.cfg.family == HF_CASES[case][0]
    assert our_moe_layers(ours) == hf_moe_layers(hf)
    assert (ours.output.weight is ours.tok_embeddings.weight) == hf.config.tie_word_embeddings
    assert_same_logits(logits(ours, VOCAB), logits(hf, VOCAB))


@pytest.mark.parametrize("case", OUR_CASES)
def test_export_loads_in_transformers(tmp_path, case):
    cfg = our_config(case)
    ours = random_weights(build_model(cfg, seed=2), seed=4)
    save_hf(ours, tmp_path)
    hf, info = CLASSES[cfg.family][1].from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert hf_moe_layers(hf) == our_moe_layers(ours)
    assert_same_logits(logits(hf.eval(), cfg.vocab_size), logits(ours, cfg.vocab_size))
    # And back: the same tensors and layers, and the same model (norm_topk_prob, RoPE, ... included;
    # a layer pattern may come back spelled another way: dense_layers for first_dense).
    back = load_pretrained(tmp_path)
    assert back.state_dict().keys() == ours.state_dict().keys() and our_moe_layers(back) == our_moe_layers(ours)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert (back.output.weight is back.tok_embeddings.weight) == cfg.tie_embeddings
    assert torch.equal(logits(back, cfg.vocab_size), logits(ours, cfg.vocab_size))


@pytest.mark.parametrize("case", HF_CASES)
def test_convert_both_ways(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    want = logits(hf, VOCAB)
    assert_same_logits(logits(fivefold.load_pretrained(tmp_path / "ckpt"), VOCAB), want)
    assert cli(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    files, again = stored(tmp_path / "hf"), stored(tmp_path / "back")
    assert again.keys() == files.keys()
    for name, tensor in files.items():
        assert torch.equal(again[name], tensor), name
    back = CLASSES[HF_CASES[case][0]][1].from_pretrained(tmp_path / "back").eval()
    assert_same_logits(logits(back, VOCAB), want)


def test_qwen3_moe_layer_patterns_round_trip_through_config_json():
    """Every MoE layer pattern of ours becomes one transformers builds the same layers from."""
    base = our_config("qwen3_moe-tiny")
    for every, first_dense, dense in [(1, 0, ""), (2, 1, ""), (2, 1, "3"), (1, 2, ""), (3, 0, "1"), (2, 0, "")]:
        cfg = dataclasses.replace(base, n_layers=7, moe=dataclasses.replace(
            base.moe, every=every, first_dense=first_dense, dense_layers=dense))
        written = hf_config_from(cfg)
        theirs = transformers.Qwen3MoeConfig(**written)
        hf_layers = [i not in theirs.mlp_only_layers and (i + 1) % theirs.decoder_sparse_step == 0
                     for i in range(7)]  # Qwen3MoeDecoderLayer's rule
        ours = [is_moe_layer(cfg, i) for i in range(7)]
        assert hf_layers == ours and [is_moe_layer(config_from_hf(written), i) for i in range(7)] == ours


def raw(family: str, **change) -> dict:
    """A config.json of `family` as transformers writes it, with keys changed; null keys left out."""
    keys = {"qwen3": dict(head_dim=12), "qwen3_moe": _QWEN3_MOE,
            "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}.get(family, {})
    out = {**CLASSES[family][0](**{**SMALL, **keys}).to_dict(), **change}
    return {k: v for k, v in out.items() if v is not None}


@pytest.mark.parametrize("family", CLASSES)
def test_keys_left_out_mean_what_transformers_says(family):
    # Each class has its own defaults: Qwen3's head_dim is 128, Mixtral's RoPE theta 1e6.
    config = {k: v for k, v in raw(family).items() if k not in ("head_dim", "rope_parameters", "rope_theta")}
    with torch.device("meta"):
        model = CLASSES[family][1](CLASSES[family][0](**config))
    ours = config_from_hf(config)
    assert ours.head_dim == model.model.layers[0].self_attn.head_dim
    assert ours.rope_theta == model.config.rope_parameters["rope_theta"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen_sliding_window_switched_off_is_full_attention(family):
    # Qwen's own files carry a sliding_window that use_sliding_window=false (or leaving it out) switches off.
    want = config_from_hf(raw(family))
    assert config_from_hf(raw(family, sliding_window=4096, use_sliding_window=False)) == want
    no_flag = raw(family, sliding_window=4096)
    del no_flag["use_sliding_window"]
    assert config_from_hf(no_flag) == want


@pytest.mark.parametrize("config, message", [
    (raw("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=0),
     "sets use_sliding_window=true with sliding_window=16; fivefold's attention is full causal, set "
     "use_sliding_window to false"),
    (raw("qwen3_moe", use_sliding_window=True, sliding_window=16),
     "sets use_sliding_window=true with sliding_window=16"),
    (raw("mixtral", sliding_window=16), "sets sliding_window=16; fivefold's attention is full causal, set it to null"),
    ({k: v for k, v in raw("qwen3_moe").items() if k not in ("num_experts", "num_local_experts")},
     "needs a positive integer num_local_experts (or num_experts), got None"),
    (raw("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=True),
     "sets num_experts_per_tok=1 with norm_topk_prob=true, which weights the one expert by 1, while fivefold "
     "weights a single expert by its router probability"),
    (raw("mixtral", num_experts_per_tok=1), "sets num_experts_per_tok=1, which Mixtral weights by 1"),
    (raw("qwen3_moe", moe_intermediate_size=0), "needs a positive integer moe_intermediate_size, got 0"),
    (raw("qwen3_moe", decoder_sparse_step=0), "needs a positive integer decoder_sparse_step, got 0"),
    (raw("qwen3", rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6)), "uses rope_type 'yarn'"),
    (raw("qwen3", attention_bias=True), "sets attention_bias=true"),
])
def test_config_json_the_families_cannot_express(config, message):
    with pytest.raises(ConfigError, match=f"^config.json {re.escape(message)}"):
        config_from_hf(config)


def test_top1_qwen3_moe_with_probability_weights_is_read():
    assert config_from_hf(raw("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=False)).moe.top_k == 1


NOT_QWEN3_MOE = ("model.moe (n_experts=8) is not Qwen3-MoE-shaped: Hugging Face export needs a softmax router "
                 "without bias balancing, shared experts, group-limited routing or routed scaling, dropless")


@pytest.mark.parametrize("preset, change, message", [
    ("tiny-qwen3-moe", dict(moe=dict(balance="bias")), NOT_QWEN3_MOE),
    ("tiny-qwen3-moe", dict(moe=dict(score="sigmoid")), NOT_QWEN3_MOE),
    ("tiny-qwen3-moe", dict(moe=dict(n_shared_experts=1)), NOT_QWEN3_MOE),
    ("tiny-qwen3-moe", dict(moe=dict(capacity_factor=1.25)), NOT_QWEN3_MOE),
    ("tiny-qwen3-moe", dict(moe=dict(n_group=2, topk_group=1)), NOT_QWEN3_MOE),
    ("tiny-qwen3-moe", dict(moe=dict(routed_scaling_factor=2.5)), NOT_QWEN3_MOE),
    ("tiny-moe", dict(moe=dict(expert_ffn_dim=0, routed_scaling_factor=2.5)), "model.moe (n_experts=4) is not Mixtral-shaped"),
    ("tiny-moe", dict(moe=dict(expert_ffn_dim=0, top_k=1)), "model.moe (n_experts=4) is not Mixtral-shaped"),
    ("tiny-qwen3", dict(moe=dict(n_experts=4)), "model.moe.n_experts=4 but model.family=qwen3 is dense"),
])
def test_export_refuses_what_transformers_cannot_express(preset, change, message):
    cfg = load_config(None, {"model": {"preset": preset, **change}}).model
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        hf_config_from(cfg)


def test_written_config_json_is_what_transformers_reads(tmp_path):
    """Our config.json, read by transformers' class and written back by it, reads as the same model."""
    for case in OUR_CASES:
        cfg = our_config(case)
        written = hf_config_from(cfg)
        rewritten = CLASSES[cfg.family][0](**written).to_dict()  # transformers 5's spelling (rope_parameters, ...)
        assert config_from_hf(rewritten) == config_from_hf(written), case
        assert json.loads(json.dumps(written)) == written  # plain JSON
