"""gpt-oss (issue 30) against transformers' own GptOssForCausalLM (eager attention): a random tiny
model (both layer types, nonzero sinks and biases, sequences longer than the window) loaded by us
gives transformers' logits (1e-5, fp32) and its first training loss; exports round-trip every
tensor exactly and load in transformers with the same logits; an MXFP4 folder (the released
weights' format) loads as transformers dequantises it; the window and the sinks really
change the model; what fivefold cannot do yet is refused in one sentence; the layouts that
tensor, expert, pipeline and data parallelism make of it train as the single process does."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hf_parity import assert_same_logits, logits, random_weights, stored

transformers = pytest.importorskip("transformers")

import fivefold  # noqa: E402
from fivefold.cli import main as cli  # noqa: E402
from fivefold.config import ConfigError  # noqa: E402
from fivefold.configure import load_config  # noqa: E402
from fivefold.models import build_model  # noqa: E402
from fivefold.models.hf.interop import config_from_hf, hf_config_from, load_pretrained, model_from_tensors, save_hf  # noqa: E402

VOCAB, SEQ, WINDOW = 256, 40, 8  # the byte vocabulary of the built-in data; SEQ > WINDOW
# head_dim 16 != hidden/heads = 8; experts narrower than the stream; layers 0, 2 slide, 1, 3 do not.
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=WINDOW, max_position_embeddings=256)


def hf_model(**change) -> torch.nn.Module:
    config = transformers.GptOssConfig(**{**SHAPE, **change}, attn_implementation="eager")
    return random_weights(transformers.GptOssForCausalLM(config), seed=1)


def hf_from(folder) -> torch.nn.Module:
    return transformers.GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    hf = hf_model()
    folder = tmp_path_factory.mktemp("hf_gpt_oss")
    hf.save_pretrained(folder)
    return folder, hf


def test_load_matches_transformers(hf_folder):
    folder, hf = hf_folder
    ours = fivefold.load_pretrained(folder)
    cfg = ours.cfg
    assert (cfg.family, cfg.sliding_window, cfg.full_attention_every) == ("gpt_oss", WINDOW, 2)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.moe.router_bias and cfg.moe.projection_bias
    assert (cfg.rope_yarn_factor, cfg.rope_yarn_truncate) == (32.0, False)  # GptOssConfig's YaRN
    sinks = [layer.self_attn.sinks for layer in hf.model.layers]
    assert all(s.abs().min() > 0 for s in sinks) and hf.model.layers[0].mlp.experts.down_proj_bias.abs().min() > 0
    assert_same_logits(logits(ours, VOCAB, SEQ), logits(hf, VOCAB, SEQ))


def test_first_training_loss_is_transformers(hf_folder):
    _assert_first_loss_is_transformers(*hf_folder)


def _assert_first_loss_is_transformers(folder, hf):
    from fivefold.data.batches import GlobalBatchSampler, load_splits
    from fivefold.train.trainer import train

    cfg = load_config(None, {"model": {"init_from": str(folder)}, "log": {"progress": False},
                             "train": {"steps": 1, "seq_len": 32, "global_batch": 4},
                             "data": {"builtin_max_bytes": 200_000}})
    loss = train(cfg).losses[0]
    split, _ = load_splits(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)
    windows = split.windows(GlobalBatchSampler(split.num_windows, cfg.train.global_batch, cfg.train.seed).indices(0))
    with torch.no_grad():  # transformers shifts the labels itself: position t predicts token t + 1
        want = hf(windows, labels=windows).loss.item()
    assert abs(loss - want) <= 1e-5 * want, (loss, want)


def test_export_round_trips_every_tensor_and_loads_in_transformers(hf_folder, tmp_path):
    folder, hf = hf_folder
    ours = fivefold.load_pretrained(folder)
    save_hf(ours, tmp_path)
    files, written = stored(folder), stored(tmp_path)
    assert written.keys() == files.keys()
    for name, tensor in files.items():  # the fused, interleaved gate_up tensors included
        assert torch.equal(written[name], tensor), name
    back, info = transformers.GptOssForCausalLM.from_pretrained(tmp_path, output_loading_info=True,
                                                                 attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_same_logits(logits(back.eval(), VOCAB, SEQ), logits(hf, VOCAB, SEQ))
    again = load_pretrained(tmp_path)
    assert again.cfg == ours.cfg
    for name, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize("change", [
    {},  # tiny-gpt-oss: YaRN, a 16-token window in layers 0 and 2
    # full attention, plain RoPE (the YaRN keys at their defaults: unused, so not written)
    {"sliding_window": 0, "full_attention_every": 0, "rope_yarn_factor": 0.0, "rope_yarn_truncate": True,
     "rope_original_max_seq_len": 8192},
    {"full_attention_every": 0, "attention_bias": False},  # every layer slides; no attention biases
    {"full_attention_every": 3, "rope_yarn_truncate": True, "tie_embeddings": True},
], ids=["tiny", "full-attention", "all-sliding-no-bias", "every-3rd-full-tied"])
def test_our_model_exports_to_transformers(tmp_path, change):
    cfg = load_config(None, {"model": {"preset": "tiny-gpt-oss", **change}}).model
    ours = random_weights(build_model(cfg, seed=2), seed=4)
    save_hf(ours, tmp_path)
    back = hf_from(tmp_path)
    assert [layer.self_attn.sliding_window is not None for layer in back.model.layers] == [
        bool(layer.attention.core.window) for layer in ours.layers.values()]
    assert_same_logits(logits(back, cfg.vocab_size, SEQ), logits(ours, cfg.vocab_size, SEQ))
    again = load_pretrained(tmp_path)
    assert again.cfg == dataclasses.replace(cfg, preset=again.cfg.preset)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_convert_both_ways(hf_folder, tmp_path):
    folder, hf = hf_folder
    assert cli(["convert", str(folder), str(tmp_path / "ckpt")]) == 0
    assert_same_logits(logits(fivefold.load_pretrained(tmp_path / "ckpt"), VOCAB, SEQ), logits(hf, VOCAB, SEQ))
    assert cli(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    files, again = stored(folder), stored(tmp_path / "back")
    assert again.keys() == files.keys() and all(torch.equal(again[k], v) for k, v in files.items())


def test_any_box_of_a_fused_tensor_reads_alone(hf_folder):
    """A rank reads slices of the experts (ep: some experts; any box: a stride into gate_up)."""
    from fivefold.models.hf.stream import HFBoxes

    reader = HFBoxes(hf_folder[0])
    for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
        name = f"layers.1.feed_forward.experts.{name}"
        whole = reader.whole(name)
        offsets = tuple(min(1, n - 1) for n in whole.shape)
        sizes = tuple(max(1, n - 2) for n in whole.shape)
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(reader(name, whole.shape, offsets, sizes), whole[box]), name


# --------------------------------------------------------------------------------------------
# MXFP4 checkpoints (the released weights): transformers' own dequantisation is the reference

MXFP4_SHAPE = {**SHAPE, "hidden_size": 64, "intermediate_size": 32}  # MXFP4 groups 32 inputs
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
QUANTISED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # what gpt-oss's release quantises


def _mxfp4_pair(shape, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales for a Hugging Face weight (experts, inputs, outputs): every byte,
    exponents 2^-9 .. 2^-3 so that the tiny model's logits stay of order one."""
    experts, inputs, outputs = shape
    blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=gen)
    return blocks, torch.randint(118, 125, blocks.shape[:-1], dtype=torch.uint8, generator=gen)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """A tiny gpt-oss folder as the release stores it: experts as _blocks/_scales pairs."""
    import json

    from safetensors.torch import save_file

    plain = tmp_path_factory.mktemp("gpt_oss_plain")
    hf_model(**MXFP4_SHAPE).save_pretrained(plain)
    gen, tensors = torch.Generator().manual_seed(4), {}
    for name, tensor in stored(plain).items():
        if name.endswith(QUANTISED):
            tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4_pair(tensor.shape, gen)
        else:
            tensors[name] = tensor
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    return folder, tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantises_every_code_and_scale_as_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from fivefold.models.hf.mxfp4 import dequantise

    # Every pair of E2M1 codes (a byte) at every exponent whose 6 is finite (2^-127 .. 2^125):
    # (253 experts, 3 rows, 16 groups, 16 bytes).
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16).expand(253, 3, 16, 16).contiguous()
    scales = torch.arange(253, dtype=torch.uint8)[:, None, None].expand(253, 3, 16).contiguous()
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (253, 16·32 inputs, 3 rows)
    ours = dequantise(blocks, scales, dtype).transpose(1, 2)
    assert ours.dtype == dtype and theirs.isfinite().all() and theirs.abs().max() == 6 * 2.0**125
    assert theirs[0].abs().min() == 0 and theirs[0][theirs[0] != 0].abs().min() == 2.0**-128
    assert torch.equal(ours, theirs) and torch.equal(ours.signbit(), theirs.signbit())


def test_mxfp4_checkpoint_loads_as_transformers_loads_it(mxfp4_folder, capsys):
    from fivefold.models.hf.stream import HFBoxes

    folder, tensors = mxfp4_folder
    theirs = transformers.GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert_same_logits(logits(fivefold.load_pretrained(folder), VOCAB, SEQ), logits(theirs, VOCAB, SEQ))
    reader = HFBoxes(folder)
    assert reader.dequantised == sorted(f"model.layers.{i}.{q}" for i in range(4) for q in QUANTISED)
    # A rank's box (ep: some experts; tp: some rows, from inside a 32-input group) reads alone.
    for name in ("w1", "w2", "w3"):
        name = f"layers.2.feed_forward.experts.{name}"
        whole = reader.whole(name)
        offsets, sizes = (1, 3, 5), (2, whole.shape[1] - 7, whole.shape[2] - 9)
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(reader(name, whole.shape, offsets, sizes), whole[box]), name
    down = theirs.model.layers[2].mlp.experts.down_proj  # (experts, ffn, hidden), as transformers holds it
    assert torch.equal(reader.whole("layers.2.feed_forward.experts.w2"), down.detach().transpose(1, 2))

    _assert_first_loss_is_transformers(folder, theirs)  # the trainer's ranks read boxes too
    assert f"{folder}: dequantised 8 MXFP4 weights to torch.float32" in capsys.readouterr().out


def test_mxfp4_import_names_what_it_dequantised(mxfp4_folder, tmp_path, capsys):
    folder, _ = mxfp4_folder
    assert cli(["convert", str(folder), str(tmp_path / "ckpt")]) == 0
    assert ("dequantised 8 MXFP4 weights to torch.float32: model.layers.*.mlp.experts.down_proj, "
            "model.layers.*.mlp.experts.gate_up_proj") in capsys.readouterr().out


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.update({"model.layers.1.mlp.experts.down_proj_scales": torch.zeros(4, 64, 2, dtype=torch.uint8)}),
     "model.layers.1.mlp.experts.down_proj_blocks has shape [4, 64, 1, 16] and "
     "model.layers.1.mlp.experts.down_proj_scales [4, 64, 2]; MXFP4 stores"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 64, 2, 16)}),
     "model.layers.0.mlp.experts.gate_up_proj_blocks and model.layers.0.mlp.experts.gate_up_proj_scales must be "
     "uint8 (MXFP4), got F32 and U8"),
    (lambda t: t.pop("model.layers.3.mlp.experts.down_proj_scales"),
     "holds tensor model.layers.3.mlp.experts.down_proj_blocks, which fivefold's gpt_oss has no place for"),
])
def test_a_damaged_mxfp4_pair_is_one_sentence(mxfp4_folder, tmp_path, damage, message):
    import shutil

    from safetensors.torch import save_file

    folder, tensors = mxfp4_folder
    tensors = dict(tensors)
    damage(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match=re.escape(message)):
        fivefold.load_pretrained(tmp_path)


def test_the_nan_scale_of_mxfp4_is_one_sentence(mxfp4_folder, tmp_path):
    import shutil

    from safetensors.torch import save_file

    folder, tensors = mxfp4_folder
    scales = tensors["model.layers.1.mlp.experts.gate_up_proj_scales"].clone()
    scales[2, 7, 0] = 255
    save_file({**tensors, "model.layers.1.mlp.experts.gate_up_proj_scales": scales}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match=re.escape("model.layers.1.mlp.experts.gate_up_proj_scales holds the "
                                                    "E8M0 NaN scale 255; the checkpoint is damaged")):
        fivefold.load_pretrained(tmp_path)


def _variant(model, **change):
    tensors = {name: t.clone() for name, t in model.state_dict().items() if name != "output.weight" or
               not model.cfg.tie_embeddings}
    return tensors, dataclasses.replace(model.cfg, **change)


def test_the_window_and_the_sinks_change_the_model(hf_folder):
    ours = fivefold.load_pretrained(hf_folder[0])
    want = logits(ours, VOCAB, SEQ)
    full = model_from_tensors(*reversed(_variant(ours, sliding_window=0, full_attention_every=0)))
    assert (logits(full, VOCAB, SEQ) - want).abs().max() > 1e-2  # the window hides keys ...
    assert torch.equal(logits(full, VOCAB, WINDOW), logits(ours, VOCAB, WINDOW))  # ... only past it
    tensors, cfg = _variant(ours)
    for name in tensors:
        if name.endswith("sinks.weight"):
            tensors[name].zero_()
    assert (logits(model_from_tensors(cfg, tensors), VOCAB, SEQ) - want).abs().max() > 1e-2


def test_documents_with_windows_and_sinks_are_separate_sequences():
    from fivefold.models.attention.documents import document_positions

    cfg = load_config(None, {"model": {"preset": "tiny-gpt-oss"}}).model
    model = random_weights(build_model(cfg, seed=0), seed=5)
    tokens = torch.randint(0, cfg.vocab_size, (1, 50), generator=torch.Generator().manual_seed(0))
    documents = torch.tensor([[0] * 30 + [1] * 20])  # both longer than the window of 16
    with torch.no_grad():
        packed = model(tokens, positions=document_positions(documents), documents=documents)
        alone = torch.cat([model(tokens[:, :30]), model(tokens[:, 30:])], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [0, 5])
def test_a_window_without_sinks_is_the_sink_path_with_silent_sinks(window):
    """PyTorch's attention with the boolean mask (no sinks) against the plain sink path whose sinks
    take no share of the softmax: the same outputs and gradients, with documents too."""
    from fivefold.models.attention.masked import allowed_keys, masked_attention, sink_attention

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, heads, 12, 8, generator=gen).requires_grad_() for heads in (4, 2, 2))
    documents = torch.tensor([[0] * 7 + [1] * 5, [0] * 12])
    got = masked_attention(q, k, v, window, documents)
    want = sink_attention(q, k, v, allowed_keys(12, q.device, window, documents), torch.full((4,), -1e9))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(got.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), upstream), torch.autograd.grad(want, (q, k, v), upstream)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_grouped_experts_with_biases_and_clamped_swiglu_equal_the_loop():
    """The grouped matmul path (with each row's expert bias) against one matmul per expert."""
    import functools

    from fivefold.models.moe.layer import clamped_swiglu, grouped_swiglu, grouped_mm_usable, looped_swiglu

    gen = torch.Generator().manual_seed(0)
    counts, dim, hidden = [3, 0, 5, 2], 16, 8
    x = torch.randn(sum(counts), dim, generator=gen, requires_grad=True)
    ws = [(torch.randn(4, *shape, generator=gen) * 2).requires_grad_() for shape in
          ((hidden, dim), (dim, hidden), (hidden, dim), (hidden,), (dim,), (hidden,))]
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=1.0)  # a low limit: the clamps act
    assert grouped_mm_usable(x.device, x.dtype, dim, hidden)
    outs = [f(x, *ws[:3], counts, tuple(ws[3:]), act) for f in (grouped_swiglu, looped_swiglu)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    up = torch.randn(outs[0].shape, generator=gen)
    grads = [torch.autograd.grad(out, [x, *ws], up) for out in outs]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------- refusals

def _dry_run(argv, capsys) -> str:
    try:
        code = cli(["train", "--dry-run", *argv])
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err
    assert code not in (0, None) and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


GPT_OSS = ["--model.preset", "tiny-gpt-oss", "--train.seq_len", "32", "--train.global_batch", "4"]


@pytest.mark.parametrize("argv, fragment", [
    (["--model.attention_sinks", "true"], "model.attention_sinks=true is implemented by model.family gpt_oss only "
     "(model.family=llama); remove it"),
    (["--model.preset", "tiny-moe", "--model.moe.projection_bias", "true"],
     "model.moe.projection_bias=true is implemented by model.family gpt_oss only (model.family=mixtral)"),
    (["--model.sliding_window", "8"], "model.sliding_window=8 is implemented by model.family gpt_oss only"),
    (["--model.rope_yarn_factor", "4"], "model.rope_yarn_factor=4.0 is implemented by model.family deepseek_v3 "
     "and gpt_oss only (model.family=llama)"),
    ([*GPT_OSS, "--model.moe.activation", "swiglu", "--model.moe.swiglu_limit", "5"],
     "model.moe.swiglu_limit=5.0 shapes model.moe.activation='clamped_swiglu' only"),
    ([*GPT_OSS, "--model.sliding_window", "0"], "model.full_attention_every=2 picks the full-attention layers "
     "among sliding-window ones, but model.sliding_window=0"),
    ([*GPT_OSS, "--model.full_attention_every", "1"], "model.full_attention_every=1 makes every layer full attention"),
    ([*GPT_OSS, "--model.moe.n_shared_experts", "1"], "model.moe.n_shared_experts=1 is not yet available in "
     "model.family=gpt_oss"),
    ([*GPT_OSS, "--model.moe.first_dense", "1"], "model.family=gpt_oss has no dense layers yet"),
    ([*GPT_OSS, "--model.moe.n_experts", "0"], "model.family=gpt_oss needs model.moe.n_experts > 0"),
    ([*GPT_OSS, "--model.rope_yarn_mscale", "1"], "model.rope_yarn_mscale and rope_yarn_mscale_all_dim are "
     "DeepSeek's YaRN scalings, not available in model.family=gpt_oss"),
    ([*GPT_OSS, "--model.rope_scaling", "8"], "model.rope_yarn_factor=32.0 and model.rope_scaling=8.0 are two "
     "RoPE scalings"),
    ([*GPT_OSS, "--model.rope_yarn_factor", "0", "--model.rope_scaling", "8"], "model.rope_scaling=8.0 (Llama 3.1 "
     "RoPE) is not available in model.family=gpt_oss; use model.rope_yarn_factor"),
])
def test_what_fivefold_cannot_do_yet_is_one_sentence(argv, fragment, capsys):
    assert fragment in _dry_run(argv, capsys)


def raw(**change) -> dict:
    """A config.json as transformers writes it for SHAPE, with keys changed."""
    return {**transformers.GptOssConfig(**SHAPE).to_dict(), **change}


@pytest.mark.parametrize("config, message", [
    (raw(quantization_config={"quant_method": "fp8"}), "has a quantization_config with quant_method 'fp8'; "
     "fivefold reads unquantised and MXFP4 weights"),
    (raw(layer_types=["full_attention", "sliding_attention"] * 2), "has layer_types ['full_attention', "
     "'sliding_attention', 'full_attention', 'sliding_attention']; fivefold's sliding-window layers"),
    (raw(layer_types=["sliding_attention"] * 3), "needs layer_types as 4 of 'sliding_attention' and 'full_attention'"),
    (raw(sliding_window=None), "has sliding_attention layers and sliding_window=None"),
    (raw(num_experts_per_tok=1), "sets num_experts_per_tok=1, which gpt-oss weights by 1"),
    (raw(rope_parameters=dict(rope_type="llama3", factor=8.0, rope_theta=1e4)), "uses rope_type 'llama3'"),
    (raw(rope_parameters=dict(rope_type="yarn", factor=8.0, mscale=1.0, rope_theta=1e4)), "sets the YaRN mscale"),
    (raw(attention_dropout=0.1), "sets attention_dropout=0.1"),
])
def test_config_json_fivefold_cannot_read_yet(config, message):
    with pytest.raises(ConfigError, match=f"^config.json {re.escape(message)}"):
        config_from_hf(config)


def test_keys_left_out_mean_what_transformers_says():
    from fivefold.models.attention.layout import attention_window

    config = {k: v for k, v in raw().items() if k not in (
        "head_dim", "rope_parameters", "layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha",
        "attention_bias", "router_aux_loss_coef")}
    theirs = transformers.GptOssConfig(**config)
    ours = config_from_hf(config)
    assert (ours.head_dim, ours.sliding_window, ours.attention_bias) == (theirs.head_dim, theirs.sliding_window, True)
    assert [attention_window(ours, i) > 0 for i in range(4)] == [t == "sliding_attention" for t in theirs.layer_types]
    yarn = theirs.rope_parameters
    assert (ours.rope_theta, ours.rope_yarn_factor, ours.rope_original_max_seq_len, ours.rope_yarn_truncate) == (
        yarn["rope_theta"], yarn["factor"], yarn["original_max_position_embeddings"], yarn["truncate"])
    assert (ours.moe.swiglu_limit, ours.moe.swiglu_alpha, ours.moe.aux_loss_coeff) == (
        theirs.swiglu_limit, theirs.swiglu_alpha, theirs.router_aux_loss_coef)
    assert config_from_hf(hf_config_from(ours)) == ours


NOT_GPT_OSS = "model (n_experts=8) is not gpt-oss-shaped: Hugging Face export needs attention sinks"


@pytest.mark.parametrize("change", [dict(attention_sinks=False), dict(moe=dict(activation="swiglu")),
                                    dict(moe=dict(projection_bias=False)), dict(moe=dict(capacity_factor=1.25))])
def test_export_refuses_what_transformers_cannot_express(change):
    cfg = load_config(None, {"model": {"preset": "tiny-gpt-oss", **change}}).model
    with pytest.raises(ConfigError, match=f"^{re.escape(NOT_GPT_OSS)}"):
        hf_config_from(cfg)


# --------------------------------------------------------------------------------- the planner

def test_planner_counts_the_published_sizes_and_windowed_flops(capsys):
    from fivefold.plan.model_stats import model_stats

    small, large = (model_stats(load_config(None, ["--model.preset", p]).model) for p in ("gpt-oss-20b", "gpt-oss-120b"))
    assert small.total_params == pytest.approx(20.9e9, rel=0.01) and large.total_params == pytest.approx(116.8e9, rel=0.01)
    assert small.sliding_layers == tuple(range(0, 24, 2))
    # 12 layers see 4096 keys, 12 see 128: attention FLOPs 12·h·s per layer (h = 64 heads x 64).
    want = 6 * small.active_params + 12 * 4096 * (12 * 4096 + 12 * 128)
    assert small.flops_per_token(4096) == pytest.approx(want, rel=1e-12)
    assert cli(["plan", "gpt-oss-20b"]) == 0
    assert "dp8 tp1 pp1 ep4 z3" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- layouts

MODEL = {"preset": "tiny-gpt-oss", "n_layers": 2}  # layer 0 slides (16 keys of 32), layer 1 does not
TRAIN = {"micro_batch": 1, "seed": 5}
DOCUMENTS = {"document_mask": True}  # on the short documents of tests/layouts.py, filled in below
# name: (parallel, train, model changes, data). Under cp2 each rank holds chunks of 8 tokens: the
# 16-token window hides chunk 0 from chunk 3 entirely (that block is skipped) and crosses the others.
LAYOUTS = {
    "tp2 sp": ({"tp": 2, "sp": True}, {}, {}, {}),  # q/k/v biases and the sinks split by heads, wo's bias partial
    "tp2 no-sp selective": ({"tp": 2, "sp": False}, {"recompute": "selective"}, {}, {}),
    "dp2 ep2": ({"dp": 2, "ep": 2}, {}, {}, {}),  # expert biases split with their experts
    "tp2 ep2": ({"tp": 2, "ep": 2}, {}, {}, {}),
    "pp2 1f1b": ({"pp": 2, "pp_schedule": "1f1b"}, {}, {}, {}),
    # The V schedule: 4 layers, each rank its first and last stage (layers 0, 3 and 1, 2).
    "pp2 zbv": ({"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}, {"micro_batch": 2}, {"n_layers": 4}, {}),
    "dp2 z3 full": ({"dp": 2, "zero": 3}, {"recompute": "full"}, {}, {}),
    "cp2 ring": ({"cp": 2}, {}, {}, {}),  # windows skipped and trimmed, sinks merged once
    "cp2 allgather selective": ({"cp": 2, "cp_method": "allgather"}, {"recompute": "selective"}, {}, {}),
    "cp2 ulysses": ({"cp": 2, "cp_method": "ulysses"}, {}, {}, {}),
    "cp2 ring documents": ({"cp": 2}, {}, {}, DOCUMENTS),
}


def _setting(name: str, source: str) -> dict:
    parallel, train, model, data = LAYOUTS[name]
    data = {**data, "source": source} if data else {}
    return {"model": {**MODEL, **model}, "parallel": parallel, "train": {**TRAIN, **train}, "data": data}


def _on_two_ranks(settings: dict) -> dict:
    from layouts import run_layout

    return {name: run_layout(setting) for name, setting in settings.items()}


@pytest.fixture(scope="module")
def document_source(tmp_path_factory):
    from layouts import write_short_documents

    return write_short_documents(tmp_path_factory.mktemp("documents") / "short.jsonl")


@pytest.fixture(scope="module")
def two_rank_runs(document_source):
    from ranks import run_on_ranks

    return run_on_ranks(2, _on_two_ranks, {name: _setting(name, document_source) for name in LAYOUTS})


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_one_process(two_rank_runs, document_source, name):
    from layouts import TP_WEIGHT_ATOL, WEIGHT_ATOL, assert_same_run, reference

    setting = _setting(name, document_source)
    want = reference({key: value for key, value in setting.items() if key != "parallel"})
    for rank, runs in enumerate(two_rank_runs):
        atol = TP_WEIGHT_ATOL if setting["parallel"].get("tp", 1) > 1 else WEIGHT_ATOL
        assert_same_run(runs[name], want, weight_atol=atol, label=f"gpt_oss {name} rank {rank}")
