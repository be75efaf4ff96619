"""The deepseek_v3 family against transformers' DeepseekV3ForCausalLM: a random tiny model made here
and loaded by us gives transformers' logits (1e-5, fp32), with and without the q latent, with and
without YaRN; our model exported loads in transformers with the same logits; `fivefold convert`
both ways keeps every tensor; what we cannot express is refused in one sentence. Also: the model
built on the meta device and materialised equals the one built directly, and the planner's
parameter count is the built model's, for the three presets.

Multi-token prediction (transformers has none: its class drops those layers): our export writes
its blocks in DeepSeek's layout (layers past the last, with copies of the embedding and output
matrices), transformers loads the main model from it with the same logits and reports exactly
those layers as unexpected, and we read them back bit for bit."""

import dataclasses
import json
import re

import pytest
import torch
from hf_parity import assert_same_logits, logits, our_moe_layers, random_weights, stored
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import fivefold  # noqa: E402
from fivefold.cli import main as cli  # noqa: E402
from fivefold.config import ConfigError  # noqa: E402
from fivefold.configure import load_config, validate  # noqa: E402
from fivefold.models import build_meta_model, build_model, initial_values  # noqa: E402
from fivefold.models.hf.interop import config_from_hf, hf_config_from, load_pretrained, save_hf  # noqa: E402
from fivefold.models.registry import family_stats  # noqa: E402

VOCAB = 96
# n_group 2 with topk_group 1: each token picks within one group of 4. rms_norm_eps 1e-5 differs
# from the latent norms' fixed 1e-6. v_head_dim 12 != q/k head dim 16.
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24,
             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-5)
# An original context of 1024 puts YaRN's ramp inside the 4 RoPE pairs (from pair 0.7, floored, to 2.2,
# ceiled): interpolated, ramped and kept frequencies all occur.
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024, beta_fast=32,
            beta_slow=1)

HF_CASES = {
    "q-latent": {},
    "direct-q": dict(q_lora_rank=None, routed_scaling_factor=1.0, norm_topk_prob=False),
    # mscale != mscale_all_dim: both the cos/sin factor and the softmax scale's mscale² differ from 1.
    "q-latent-yarn": dict(rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8), max_position_embeddings=4096),
    # DeepSeek-V2-Lite's YaRN (equal mscales: factor 1 on cos/sin, the softmax scale still changes).
    "direct-q-yarn-tied": dict(q_lora_rank=None, tie_word_embeddings=True,
                               rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707),
                               max_position_embeddings=4096),
}

OUR_CASES = {
    "tiny": ("tiny-deepseek-v3", {}),
    "tiny-direct-q-yarn": ("tiny-deepseek-v3", dict(q_lora_rank=0, rope_yarn_factor=4.0, rope_original_max_seq_len=256,
                                                    rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=0.8)),
    "tiny-top1-three-groups": ("tiny-deepseek-v3", dict(tie_embeddings=True, moe=dict(
        n_experts=6, n_group=3, topk_group=2, top_k=1, norm_topk_prob=False, routed_scaling_factor=1.0))),
}


def hf_model(case: str) -> torch.nn.Module:
    return random_weights(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SMALL, **HF_CASES[case]})),
                          seed=1, router_bias_std=0.3)


def our_config(case: str):
    preset, keys = OUR_CASES[case]
    return load_config(None, {"model": {"preset": preset, **keys}}).model


def same_model(read, cfg) -> bool:
    return dataclasses.replace(read, preset=cfg.preset) == cfg  # config.json names no preset


def hf_moe_layers(hf) -> list[bool]:
    return [hasattr(layer.mlp, "experts") for layer in hf.model.layers]


@pytest.mark.parametrize("case", HF_CASES)
def test_load_matches_transformers(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    ours = fivefold.load_pretrained(tmp_path)
    assert ours.cfg.family == "deepseek_v3" and our_moe_layers(ours) == hf_moe_layers(hf) == [False, True, True]
    assert (ours.output.weight is ours.tok_embeddings.weight) == hf.config.tie_word_embeddings
    bias = hf.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.layers["2"].feed_forward.router.expert_bias, bias)
    assert_same_logits(logits(ours, VOCAB), logits(hf, VOCAB))


@pytest.mark.parametrize("case", OUR_CASES)
def test_export_loads_in_transformers(tmp_path, case):
    cfg = our_config(case)
    ours = random_weights(build_model(cfg, seed=2), seed=4, router_bias_std=0.3)
    save_hf(ours, tmp_path)
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "mismatched_keys")), info
    # transformers has no multi-token prediction: those layers, and only they, are left over (its
    # names of the routed experts' tensors are its fused ones, so they are compared by layer)
    unexpected, written = set(info["unexpected_keys"]), mtp_names(tmp_path, cfg)
    assert {k for k in unexpected if ".experts." not in k} == {k for k in written if ".experts." not in k}, info
    assert {k.split(".experts.")[0] for k in unexpected} == {k.split(".experts.")[0] for k in written}, info
    assert hf_moe_layers(hf) == our_moe_layers(ours)[:cfg.n_layers]
    assert_same_logits(logits(hf.eval(), cfg.vocab_size), logits(ours, cfg.vocab_size))
    back = load_pretrained(tmp_path)  # and back: the same config, tensors (the bias included) and model
    assert same_model(back.cfg, cfg)
    assert back.state_dict().keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert torch.equal(logits(back, cfg.vocab_size), logits(ours, cfg.vocab_size))


@pytest.mark.parametrize("case", ["q-latent-yarn", "direct-q-yarn-tied"])
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
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert_same_logits(logits(back, VOCAB), want)


def mtp_names(folder, cfg) -> set[str]:
    """The tensors of a folder's multi-token-prediction layers (layers num_hidden_layers and up)."""
    layers = (re.match(r"model\.layers\.(\d+)\.", n) for n in stored(folder))
    return {m.string for m in layers if m and int(m.group(1)) >= cfg.n_layers}


def test_multi_token_prediction_in_deepseeks_layout(tmp_path):
    """Our MTP block written as DeepSeek's files hold it (layer num_hidden_layers, with copies of the
    embedding and head) is read back bit for bit, the copies not needed; a layer past
    num_nextn_predict_layers is dropped, as transformers drops it; a missing MTP tensor is named."""
    cfg = load_config(None, {"model": {"preset": "tiny-deepseek-v3", "n_layers": 2}}).model
    ours = random_weights(build_model(cfg, seed=2), seed=4, router_bias_std=0.3)
    save_hf(ours, tmp_path)
    files = stored(tmp_path)
    assert torch.equal(files["model.layers.2.embed_tokens.weight"], ours.tok_embeddings.weight)
    assert torch.equal(files["model.layers.2.shared_head.head.weight"], ours.output.weight)
    assert torch.equal(files["model.layers.2.eh_proj.weight"], ours.layers["2"].eh_proj.weight)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = load_pretrained(tmp_path)
    assert back.cfg.mtp_depth == 1 and back.state_dict().keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name

    extra = {**files, "model.layers.3.eh_proj.weight": torch.ones(64, 128)}  # a second depth: not ours
    save_file(extra, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert load_pretrained(tmp_path).cfg.mtp_depth == 1
    files.pop("model.layers.2.hnorm.weight")
    save_file(files, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="missing tensor model.layers.2.hnorm.weight"):
        load_pretrained(tmp_path)


def test_folder_without_multi_token_prediction_loads_without_it(tmp_path):
    """transformers' config says num_nextn_predict_layers=1 but its files hold no MTP layer: the
    main model loads, with a warning, as transformers loads it; a stray tensor is still refused."""
    hf = hf_model("q-latent")
    hf.save_pretrained(tmp_path)
    assert hf.config.num_nextn_predict_layers == 1
    with pytest.warns(UserWarning, match="weights hold no multi-token-prediction layer"):
        ours = fivefold.load_pretrained(tmp_path)
    assert ours.cfg.mtp_depth == 0
    assert_same_logits(logits(ours, VOCAB), logits(hf, VOCAB))
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.2.eh_proj.weight": torch.ones(32, 64)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="holds tensor model.layers.2.eh_proj.weight, which fivefold's deepseek_v3"):
        fivefold.load_pretrained(tmp_path)


def raw(**change) -> dict:
    """A config.json as transformers writes it, with keys changed."""
    return {**transformers.DeepseekV3Config(**SMALL).to_dict(), **change}


def test_keys_left_out_mean_what_transformers_says():
    """DeepseekV3Config's defaults (the 671B model's routing, latent sizes, ...) fill missing keys."""
    sizes = {k: SMALL[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads")}
    sizes.update(model_type="deepseek_v3", num_hidden_layers=4)  # first_k_dense_replace defaults to 3
    ours = config_from_hf(sizes)
    assert ours == config_from_hf(transformers.DeepseekV3Config(**sizes).to_dict())
    assert (ours.q_lora_rank, ours.max_seq_len, ours.moe.n_group, ours.moe.routed_scaling_factor) == (
        1536, 4096, 8, 2.5)


def test_written_config_json_is_what_transformers_reads():
    for case in OUR_CASES:
        cfg = our_config(case)
        written = hf_config_from(cfg)
        assert same_model(config_from_hf(written), cfg), case
        rewritten = transformers.DeepseekV3Config(**written).to_dict()
        assert same_model(config_from_hf(rewritten), cfg), case
        assert json.loads(json.dumps(written)) == written


@pytest.mark.parametrize("config, message", [
    (raw(num_key_value_heads=2), "has num_key_value_heads=2 and num_attention_heads=4; latent attention expands"),
    (raw(rope_interleave=False), "sets rope_interleave=false; fivefold's deepseek_v3 rotates interleaved channel"),
    (raw(rope_parameters=dict(YARN, attention_factor=1.2)), "sets the YaRN attention_factor; fivefold derives it"),
    (raw(rope_parameters=dict(YARN, truncate=False)), "sets the YaRN truncate=false"),
    (raw(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, original_max_position_embeddings=16)),
     "uses rope_type 'yarn' without a factor"),
    (raw(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=16)),
     "uses rope_type 'llama3'; fivefold's deepseek_v3 implements the default and 'yarn' RoPE"),
    (raw(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "uses rope_type 'dynamic'"),
    (raw(n_group=3), "has n_routed_experts=8, n_group=3 and topk_group=1; the groups must split the experts"),
    (raw(n_shared_experts=0), "needs a positive integer n_shared_experts, got 0"),
    (raw(q_lora_rank=0), "needs q_lora_rank null (a direct q projection) or a positive integer, got 0"),
    (raw(first_k_dense_replace=3), "has first_k_dense_replace=3; fivefold's deepseek_v3 needs 0 <= it < "
     "num_hidden_layers"),
    (raw(num_experts_per_tok=1), "sets num_experts_per_tok=1 with norm_topk_prob=true"),
    (raw(moe_layer_freq=2), "sets moe_layer_freq=2, which transformers' DeepseekV3ForCausalLM ignores"),
    (raw(scoring_func="softmax"), "sets scoring_func='softmax', which transformers' DeepseekV3ForCausalLM ignores"),
    (raw(attention_bias=True), "sets attention_bias=true"),
])
def test_config_json_deepseek_v3_cannot_express(config, message):
    with pytest.raises(ConfigError, match=f"^config.json {re.escape(message)}"):
        config_from_hf(config)


NOT_V3 = "model.moe (n_experts={}) is not DeepSeek-V3-shaped: Hugging Face export needs a sigmoid router"


@pytest.mark.parametrize("preset, change, experts", [
    ("deepseek-v2-lite", {}, 64),  # softmax scores
    ("tiny-deepseek-v3", dict(moe=dict(n_shared_experts=0)), 8),
    ("tiny-deepseek-v3", dict(moe=dict(every=2)), 8),
    ("tiny-deepseek-v3", dict(moe=dict(capacity_factor=1.25)), 8),
])
def test_export_refuses_what_transformers_cannot_express(preset, change, experts):
    cfg = load_config(None, {"model": {"preset": preset, **change}}).model
    with pytest.raises(ConfigError, match=f"^{re.escape(NOT_V3.format(experts))}"):
        hf_config_from(cfg)


@pytest.mark.parametrize("case", ["tiny", "tiny-direct-q-yarn"])
def test_meta_build_materialised_with_initial_values_is_the_direct_build(case):
    from fivefold.parallel.materialize import materialize

    cfg = our_config(case)
    direct = build_model(cfg, seed=5).eval()
    meta = build_meta_model(cfg)
    materialize([meta], torch.device("cpu"), initial_values(cfg, 5))
    assert meta.state_dict().keys() == direct.state_dict().keys()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(meta.state_dict()[name], tensor), name
    assert torch.equal(meta.inv_freq, direct.inv_freq)
    assert torch.equal(logits(meta.eval(), cfg.vocab_size), logits(direct, cfg.vocab_size))


@pytest.mark.parametrize("preset, billions", [("deepseek-v3", 671.0), ("deepseek-v2-lite", 15.7),
                                              ("tiny-deepseek-v3", None)])
def test_planner_statistics_count_the_built_model(preset, billions):
    cfg = load_config(None, {"model": {"preset": preset}})
    validate(cfg)
    stats = family_stats(cfg.model)
    assert sum(p.numel() for p in build_meta_model(cfg.model).parameters()) == stats.total_params
    if billions:  # the published totals of the main model (without DeepSeek-V3's multi-token prediction)
        assert round((stats.total_params - stats.mtp_params) / 1e9, 1) == billions
    if preset == "deepseek-v3":  # its files, MTP block with its copies of the two matrices: "685B"
        assert round((stats.total_params + 2 * stats.vocab_size * stats.dim) / 1e9, 1) == 684.5
    m = cfg.model
    assert stats.attention_flops_per_token(4096) == 6.0 * m.n_heads * (m.head_dim + m.v_head_dim) * 4096


@pytest.mark.parametrize("change, message", [
    (dict(moe=dict(n_group=3)), "model.moe.n_group=3 does not divide model.moe.n_experts=8"),
    (dict(moe=dict(topk_group=3)), "model.moe.topk_group=3 must be between 1 and model.moe.n_group=2"),
    (dict(moe=dict(top_k=5)), "model.moe.top_k=5 exceeds the 4 experts of model.moe.topk_group=1 groups"),
    (dict(n_kv_heads=2), "model.n_kv_heads=2 must equal model.n_heads=4"),
    (dict(head_dim=32), "model.head_dim=32 must be the q/k head dim model.qk_nope_head_dim+qk_rope_head_dim=24"),
    (dict(qk_rope_head_dim=7), "model.qk_rope_head_dim=7 must be even for RoPE"),
    (dict(kv_lora_rank=0), "model.kv_lora_rank must be > 0, got 0"),
    (dict(rope_scaling=8.0), "model.rope_scaling=8.0 (Llama 3.1 RoPE) is not available in model.family=deepseek_v3"),
    (dict(family="mixtral"), "model.kv_lora_rank=32 is a latent-attention / YaRN key, which only "
     "model.family=deepseek_v3 implements"),
    (dict(parallel=None, tp=8), "parallel.tp=8 does not divide model.n_heads=4"),
])
def test_validation_names_the_key_and_the_fix(change, message):
    change = dict(change)
    parallel = {"tp": change.pop("tp")} if change.pop("parallel", 0) is None else {}
    cfg = load_config(None, {"model": {"preset": "tiny-deepseek-v3", **change}, "parallel": parallel})
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        validate(cfg)
