"""LoRA ([lora], models/lora/adapters.py): adapters beside the targeted linear layers, the base frozen.

One 2-rank spawn trains every layout (dp at zero 0/1/2/3, tp2, pp2 with 1f1b, zbv,
interleaved_1f1b and dualpipev, cp2, an MoE with adapters on its experts at dp2·ep2 and at tp2, DeepSeek-V3's latent attention at tp2) and each
must equal the single-process LoRA run under the harness rule (tests/layouts.py); in every layout
the base weights end bit for bit as they started, and only the adapters hold gradients and
optimizer state. The same spawn saves and resumes LoRA checkpoints (the base is not in them: it
comes back from the seed or from the model.init_from folder) in other layouts.
tests/test_lora_composition.py composes the dimensions on 4 ranks."""

import pytest
import torch

from layouts import TP_WEIGHT_ATOL, assert_resumed_bit_for_bit, assert_same_run, continued, reference, run_layout, tiny_config
from ranks import run_on_ranks

from fivefold.config import ConfigError

LORA = {"rank": 4, "alpha": 8.0}
# lr 1e-2: the adapters' updates must move the run well beyond the bounds (B starts at zero).
TRAIN = {"micro_batch": 2, "steps": 4, "lr": 1e-2}
MOE = {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}
DEEPSEEK_V3 = {"preset": "tiny-deepseek-v3", "n_layers": 2, "n_kv_heads": 4}
GPT_OSS = {"preset": "tiny-gpt-oss", "n_layers": 2}


def _lora(model=None, targets="attention|mlp", dtype="fp32", recompute="none", **parallel) -> dict:
    return {"model": model or {}, "parallel": parallel, "train": {**TRAIN, "dtype": dtype, "recompute": recompute},
            "lora": {**LORA, "targets": targets}}


def _v_schedule(schedule: str = "zbv") -> dict:
    """Four stages on two ranks (zbv and dualpipev: in a V, the backward split into input and
    weight passes; interleaved_1f1b: round robin)."""
    layout = _lora({"n_layers": 4}, pp=2, pp_schedule=schedule, pp_virtual=2)
    return {**layout, "train": {**TRAIN, "micro_batch": 1}}


LAYOUTS = {"dp2 zero0": _lora(dp=2, zero=0), "dp2 zero1": _lora(dp=2, zero=1),
           "dp2 zero2": _lora(dp=2, zero=2), "dp2 zero3": _lora(dp=2, zero=3),
           "tp2": _lora(tp=2), "pp2 1f1b": _lora(pp=2), "pp2 zbv": _v_schedule(),
           "pp2 interleaved": _v_schedule("interleaved_1f1b"), "pp2 dualpipev": _v_schedule("dualpipev"),
           "cp2": _lora(cp=2),
           "moe dp2 ep2 zero1": _lora(MOE, "attention|mlp|experts", dp=2, ep=2, zero=1),
           "moe tp2": _lora(MOE, "attention|mlp|experts", tp=2),
           # Latent attention's replicated down-projections (Partial gradients for A and B), an MoE
           # with shared experts, multi-token prediction's block.
           "deepseek tp2": _lora(DEEPSEEK_V3, "attention|mlp|experts", tp=2),
           # Biased attention projections and experts with biases and the clamped SwiGLU.
           "gpt-oss tp2": {**_lora(GPT_OSS, "attention|mlp|experts", tp=2), "train": {**TRAIN, "seed": 5}},
           # bf16: the frozen base in bf16 (zero 1) or FSDP2's fp32 shards gathered in bf16 (zero 3),
           # fp32 masters and moments for the adapters only; against the bf16 single process.
           "dp2 zero1 bf16": _lora(dp=2, zero=1, dtype="bf16"), "dp2 zero3 bf16": _lora(dp=2, zero=3, dtype="bf16"),
           # Recomputation replays the adapters inside backward: selective keeps the row-parallel
           # projections' inputs (the adapter is added inside that projection), full keeps nothing.
           "tp2 selective": _lora(tp=2, recompute="selective"), "dp2 full": _lora(dp=2, recompute="full")}


# Resume: "dp2 zero1" saves at step 2 of 4; the same layout continues bit for bit, and tp2, zero 3, pp2
# and one process (test_resume_on_one_process) within the layout tolerances.
SAVED = "dp2 zero1"
RESUMES = ("dp2 zero1", "tp2", "dp2 zero3", "pp2 1f1b")
# The experts' stacked adapters and their moments, saved whole-expert by tp2 and sliced by ep2.
MOE_SAVED, MOE_RESUME = "moe tp2", "moe dp2 ep2 zero1"
# From a transformers-made Llama folder (model.init_from): the base read from its files, saved by
# dp2 zero2 at step 2 and continued under tp2, whose base is read from the folder again.
HF_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=1024, tie_word_embeddings=False)


def _from_folder(folder: str, **parallel) -> dict:
    return {**_lora(**parallel), "model": {"init_from": folder}}


def _checkpointed(layout: dict, **keys) -> dict:
    return {**layout, "checkpoint": keys}


# torch.compile (aot_eager, as tests/test_composition.py: Dynamo and AOT autograd trace the blocks,
# the adapters' hooks and the row-parallel projection's added adapter with them), against the eager
# single process; it must really have compiled.
COMPILED = {**LAYOUTS["tp2"], "train": {**LAYOUTS["tp2"]["train"], "compile": "true"}}


def two_ranks(root: str, folder: str) -> dict:
    from test_composition import use_aot_eager_compile

    saving = {SAVED: root, MOE_SAVED: f"{root}/moe"}
    out = {label: run_layout(_checkpointed(layout, dir=saving[label], every=2) if label in saving else layout)
           for label, layout in LAYOUTS.items()}
    for label in RESUMES:
        out[f"resumed {label}"] = run_layout(_checkpointed(LAYOUTS[label], resume=f"{root}/step_00000002"))
    out[f"resumed {MOE_RESUME}"] = run_layout(_checkpointed(LAYOUTS[MOE_RESUME], resume=f"{root}/moe/step_00000002"))
    use_aot_eager_compile()
    out["tp2 compiled"] = run_layout(COMPILED)
    out["folder dp2 zero2"] = run_layout(_checkpointed(_from_folder(folder, dp=2, zero=2), dir=f"{root}/hf", every=2))
    out["folder resumed tp2"] = run_layout(_checkpointed(_from_folder(folder, tp=2), resume=f"{root}/hf/step_00000002"))
    return out


def _hf_folder(path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**HF_SHAPE)).float().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    return _hf_folder(tmp_path_factory.mktemp("hf_llama"), 0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora-ckpt"))


@pytest.fixture(scope="module")
def runs(root, folder):
    return run_on_ranks(2, two_ranks, root, folder)


def _atol(label: str) -> float:
    return TP_WEIGHT_ATOL if "tp" in label else 1e-5


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_layout_matches_the_single_process_lora_run(runs, label):
    want = reference(LAYOUTS[label])
    for rank, results in enumerate(runs):
        assert_same_run(results[label], want, weight_atol=_atol(label), label=f"lora {label} rank {rank}")


def test_compiled_layout_matches_the_eager_single_process(runs):
    want = reference(LAYOUTS["tp2"])
    for rank, results in enumerate(runs):
        assert results["tp2 compiled"].compile_s > 0, f"rank {rank} did not compile"
        assert_same_run(results["tp2 compiled"], want, weight_atol=TP_WEIGHT_ATOL, label=f"lora tp2 compiled rank {rank}")


def _initial(settings: dict) -> dict[str, torch.Tensor]:
    """The seeded initial value of every weight of the settings' model."""
    from fivefold.models import build_meta_model, initial_values

    cfg = tiny_config(settings)
    fill = initial_values(cfg.model, cfg.train.seed)
    return {name: fill(name, tuple(p.shape), (0,) * p.dim(), tuple(p.shape))
            for name, p in build_meta_model(cfg.model).named_parameters()}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_base_weights_end_bit_for_bit_as_they_started(runs, label):
    initial = _initial(LAYOUTS[label])
    for rank, results in enumerate(runs):
        adapters = {n for n in results[label].weights if "lora_" in n}
        assert adapters and set(results[label].weights) - adapters == set(initial)
        for name, value in initial.items():
            got = results[label].weights[name]
            if "bf16" in label:  # the run starts from the bf16-rounded values (docs/precision.md)
                got, value = got.float(), value.to(torch.bfloat16).float()
            assert torch.equal(got, value), f"{label} rank {rank}: {name} moved"


def test_the_adapters_learn():
    """The single process: the adapted run leaves the base run's path after step 1 (B starts at zero,
    so step 1 is the base model's loss), and its adapters' B moved from zero."""
    want = reference(LAYOUTS["dp2 zero1"])
    base = reference({"train": TRAIN})
    assert want.losses[0] == base.losses[0]
    assert all(abs(a - b) > 1e-4 for a, b in zip(want.losses[1:], base.losses[1:]))
    moved = [n for n, t in want.weights.items() if n.endswith("lora_B.weight") and t.abs().max() > 1e-3]
    assert len(moved) == 2 * 7, moved  # wq wk wv wo w1 w2 w3 in each of the 2 layers


def _adapter_elements(settings: dict) -> int:
    return sum(t.numel() for n, t in reference(settings).weights.items() if "lora_" in n)


def _base_elements(settings: dict) -> int:
    return sum(t.numel() for n, t in reference(settings).weights.items() if "lora_" not in n)


@pytest.mark.parametrize("label", ["dp2 zero0", "dp2 zero1"])
def test_only_adapters_hold_gradients_and_optimizer_state(runs, label):
    """fp32 AdamW: two moments per adapter element and one gradient, nothing for the frozen base
    (whose weights alone are 11x the adapters'). Zero 1 keeps the whole gradient bucket, and for
    the half of the elements it owns their gradient chunk, fp32 master and two moments."""
    elements, base = _adapter_elements(LAYOUTS[label]), _base_elements(LAYOUTS[label])
    for results in runs:
        held = results[label].state_bytes
        assert held["params"] == 4 * (base + elements), (held, elements, base)  # the frozen base is held, though
        if label == "dp2 zero0":
            assert held == {"params": 4 * (base + elements), "grads": 4 * elements, "optimizer": 8 * elements}, held
            # The step's all-reduce carries the adapters' gradients (and a few scalars), not the base's.
            assert 4 * elements <= results[label].comm["dp"] <= 4 * elements + 64, (results[label].comm, elements)
        else:
            assert 6 * elements <= held["grads"] <= 6 * elements + 64, (held, elements)
            assert 6 * elements <= held["optimizer"] <= 6 * elements + 64, (held, elements)


def test_one_process_holds_only_adapter_state():
    elements, base = _adapter_elements(LAYOUTS["dp2 zero0"]), _base_elements(LAYOUTS["dp2 zero0"])
    held = reference(LAYOUTS["dp2 zero0"]).state_bytes
    assert held == {"params": 4 * (base + elements), "grads": 4 * elements, "optimizer": 8 * elements}, held


@pytest.mark.parametrize("lora,problem", [
    ({"targets": "attn"}, "lora.targets='attn': 'attn' is not a kind"),
    ({"targets": "re:["}, "is not a regular expression"),
    ({"dropout": 1.0}, "lora.dropout must be in [0, 1)"),
    ({"rank": -1}, "lora.rank must be >= 0"),
])
def test_a_bad_lora_key_is_one_sentence(lora, problem):
    from fivefold.configure import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config({"lora": {**LORA, **lora}}))
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_lora_with_muon_is_refused():
    from fivefold.configure import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config({"lora": LORA, "train": {"optimizer": "muon"}}))
    assert str(err.value).startswith("lora.rank=4 trains its adapters with AdamW only")


def _adapted_model(settings: dict):
    """A real single-device model of the settings with adapters, B drawn at random (B = 0 would
    hide a wrong B·A)."""
    from fivefold.models import build_model
    from fivefold.models.lora.adapters import add_adapters, adapter_initial_values, is_adapter

    cfg = tiny_config(settings)
    model = build_model(cfg.model, cfg.train.seed)
    add_adapters(model, cfg.lora)
    fill = adapter_initial_values(lambda *box: None, cfg.train.seed)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(fill(name, tuple(param.shape), (0,) * param.dim(), tuple(param.shape)))
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator))
    return cfg, model


def test_an_adapted_linear_adds_the_scaled_low_rank_product():
    """y = W x + (alpha / rank) B A x, with A drawn within PEFT's Kaiming bound 1/sqrt(in)."""
    cfg, model = _adapted_model(LAYOUTS["dp2 zero0"])
    wq = model.layers["0"].attention.wq
    a, b = wq.lora_A.weight, wq.lora_B.weight
    assert a.shape == (4, 64) and b.shape == (wq.out_features, 4)
    assert 0.9 / 8 < a.abs().max() <= 1 / 8  # U(-1/sqrt(64), 1/sqrt(64))
    x = torch.randn(3, 64)
    want = x @ wq.weight.T + (cfg.lora.alpha / cfg.lora.rank) * (x @ a.T @ b.T)
    torch.testing.assert_close(wq(x), want, rtol=1e-5, atol=1e-5)


def test_adapted_experts_add_each_experts_low_rank_product():
    """The grouped path against one matmul per expert, written out: each projection of expert e
    gets (alpha / rank) B_e A_e beside it."""
    import torch.nn.functional as F

    cfg, model = _adapted_model(LAYOUTS["moe dp2 ep2 zero1"])
    experts = model.layers["0"].feed_forward.experts
    counts, scale = [3, 0, 5, 2], cfg.lora.alpha / cfg.lora.rank
    x = torch.randn(sum(counts), 64)

    def project(name, rows, e):
        a, b = getattr(experts, f"{name}_lora_A")[e], getattr(experts, f"{name}_lora_B")[e]
        return F.linear(rows, getattr(experts, name)[e]) + scale * F.linear(F.linear(rows, a), b)
    want = torch.cat([project("w2", F.silu(project("w1", part, e)) * project("w3", part, e), e)
                      for e, part in enumerate(x.split(counts))])
    torch.testing.assert_close(experts(x, counts), want, rtol=1e-5, atol=1e-5)


def test_same_layout_resume_is_bit_for_bit(runs):
    """The adapters and their AdamW moments come back exactly, and the base from the seed again."""
    for rank, results in enumerate(runs):
        assert_resumed_bit_for_bit(results[SAVED], results[f"resumed {SAVED}"], 2, label=f"rank {rank}")


@pytest.mark.parametrize("label", [label for label in RESUMES if label != SAVED])
def test_resume_under_another_layout(runs, label):
    want = continued(reference(LAYOUTS[SAVED]), 2)
    for rank, results in enumerate(runs):
        assert_same_run(results[f"resumed {label}"], want, weight_atol=_atol(label),
                        label=f"lora resumed under {label} rank {rank}")


def test_moe_resume_under_expert_parallelism(runs):
    want = continued(reference(LAYOUTS[MOE_SAVED]), 2)
    for rank, results in enumerate(runs):
        assert_same_run(results[f"resumed {MOE_RESUME}"], want, weight_atol=TP_WEIGHT_ATOL,  # saved under tp2
                        label=f"lora moe resumed under ep2 rank {rank}")


def test_resume_on_one_process(runs, root):
    got = run_layout(_checkpointed(_lora(), resume=f"{root}/step_00000002"))
    assert_same_run(got, continued(reference(LAYOUTS[SAVED]), 2), label="lora resumed on one process")


def test_the_checkpoint_holds_adapters_not_the_base(runs, root):
    """Every tensor saved is an adapter or its AdamW moment (or the RNG state): 8192 adapter
    elements three times, where the base alone is 90432."""
    from fivefold.models.lora.adapters import is_adapter
    from fivefold.checkpoint import sharded_io

    stored = sharded_io.shapes(f"{root}/step_00000002")
    kinds = {key.split("/", 1)[0] for key in stored}
    assert kinds == {"model", "exp_avg", "exp_avg_sq", "rng"}, kinds
    saved = [key.split("/", 1)[1] for key in stored if not key.startswith("rng/")]
    assert saved and all(is_adapter(name) for name in saved), [n for n in saved if not is_adapter(n)]
    assert len(saved) == 3 * 2 * 7 * 2  # model, two moments x 2 layers x 7 projections x (A, B)


def test_folder_base_trains_as_one_process_and_resumes(runs, folder):
    want = reference(_from_folder(folder))
    for rank, results in enumerate(runs):
        assert_same_run(results["folder dp2 zero2"], want, label=f"lora from a folder dp2 zero2 rank {rank}")
        assert_same_run(results["folder resumed tp2"], continued(want, 2), weight_atol=TP_WEIGHT_ATOL,
                        label=f"lora from a folder resumed under tp2 rank {rank}")
    initial = {name: t for name, t in want.weights.items() if "lora_" not in name}
    from fivefold.models.hf.interop import hf_box_reader

    read = hf_box_reader(folder)[1]
    for name, value in initial.items():  # the base stayed the folder's weights
        assert torch.equal(value, read(name, tuple(value.shape), (0,) * value.dim(), tuple(value.shape))), name


def test_resume_refuses_another_base(runs, root, folder, tmp_path):
    """Adapters resumed onto another base: another seed, or another folder, is one sentence."""
    from fivefold.train.trainer import train

    with pytest.raises(ConfigError, match=r"trained on the seeded initialisation of train.seed=3, and this run's "
                                          r"base is the seeded initialisation of train.seed=4; resume with train.seed = 3"):
        settings = _checkpointed(_lora(), resume=f"{root}/step_00000002")
        train(tiny_config({**settings, "train": {**TRAIN, "seed": 4}}))
    other = _hf_folder(tmp_path / "other", 1)
    with pytest.raises(ConfigError, match=r"trained on model.init_from=.* bytes of safetensors.*point model.init_from at that base"):
        train(tiny_config(_checkpointed(_from_folder(other), resume=f"{root}/hf/step_00000002")))
    with pytest.raises(ConfigError, match=r"holds LoRA adapters of lora.rank=4 on lora.targets='attention\|mlp' and no base"):
        train(tiny_config({**_checkpointed(_lora(), resume=f"{root}/step_00000002"), "lora": {**LORA, "rank": 8}}))


def test_resume_refuses_other_weights_in_the_same_folder(tmp_path):
    """The same folder, the same architecture (identical safetensors headers and sizes), other
    weights (another seed wrote them): the base's sampled bytes differ, and the resume is refused."""
    from fivefold.train.trainer import train

    folder = _hf_folder(tmp_path / "base", 0)
    saving = _checkpointed({**_from_folder(folder), "parallel": {}}, dir=str(tmp_path / "ckpt"), every=2)
    train(tiny_config({**saving, "train": {**saving["train"], "steps": 2}}))
    _hf_folder(tmp_path / "base", 1)  # rewritten in place
    with pytest.raises(ConfigError, match=r"headers and samples .*point model.init_from at that base"):
        train(tiny_config(_checkpointed({**_from_folder(folder), "parallel": {}},
                                        resume=str(tmp_path / "ckpt" / "step_00000002"))))


def test_dropout_draws_in_training_only():
    """lora.dropout masks the adapter's input while gradients are on (training, and its recomputation),
    never in evaluation (no gradients): the same weights give the undropped output there."""
    settings = {**LAYOUTS["dp2 zero0"], "lora": {**LORA, "dropout": 0.5}}
    _, dropped = _adapted_model(settings)
    _, plain = _adapted_model(LAYOUTS["dp2 zero0"])
    x = torch.randn(3, 64)
    wq, plain_wq = dropped.layers["0"].attention.wq, plain.layers["0"].attention.wq
    with torch.no_grad():
        torch.testing.assert_close(wq(x), plain_wq(x), rtol=0, atol=0)
    assert not torch.allclose(wq(x), plain_wq(x), atol=1e-3)


def test_a_pattern_that_selects_no_layer_is_one_sentence():
    """Refused at validation (a meta-device model), before any process group."""
    from fivefold.configure import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config({"lora": {**LORA, "targets": "re:router"}}))
    assert str(err.value).startswith("lora.targets='re:router' selects no linear layer of this model")
    validate(tiny_config({"lora": {**LORA, "targets": "re:attention\\.w[qv]"}}))
    assert [n for n, _ in _adapted_model({"lora": {**LORA, "targets": "re:attention\\.w[qv]"}})[1].named_parameters()
            if "lora_A" in n] == [f"layers.{i}.attention.{w}.lora_A.weight" for i in (0, 1) for w in ("wq", "wv")]


def test_resume_with_changed_alpha_warns_once(runs, root, capsys):
    from fivefold.train.trainer import train

    settings = _checkpointed(_lora(), resume=f"{root}/step_00000002")
    train(tiny_config({**settings, "lora": {**LORA, "alpha": 16.0}}))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: resuming")]
    assert len(warnings) == 1 and "changed LoRA keys (lora.alpha 8.0 -> 16.0)" in warnings[0], warnings
