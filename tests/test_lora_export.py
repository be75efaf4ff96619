"""LoRA out of fivefold (train/lora_export.py, models/hf/peft_names.py): a run fine-tuned from a
transformers-made folder (`model.init_from`) exports a PEFT adapter folder (`checkpoint.export_hf`)
that `peft` loads onto the transformers base, `fivefold convert --merge` writes the merged model
that transformers loads, and `fivefold.load_pretrained` / `fivefold generate` read the LoRA
checkpoint itself: every logit within 1e-5 (fp32) of fivefold's adapted model of the final
checkpoint, and greedy tokens equal. Llama and Qwen3 (every attention and MLP projection; Qwen3's
q/k norms beside the adapted projections), Mixtral and Qwen3-MoE (the experts' adapters, one per
expert in PEFT's names)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import fivefold  # noqa: E402
from layouts import run_layout  # noqa: E402

from fivefold.config import ConfigError  # noqa: E402
from fivefold.configure import load_config, validate  # noqa: E402
from fivefold.tools.convert import convert  # noqa: E402
from fivefold.tools.generate import generate  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False)
LORA = {"rank": 4, "alpha": 8.0}
# lr 1e-2 for 3 steps: B moves far from zero, so the adapted logits differ from the base's by far
# more than the 1e-5 bound (checked below), and a wrong name, scale or transpose cannot pass.
TRAIN = {"steps": 3, "lr": 1e-2, "warmup": 1}
TOL = 1e-5


def _decisive(model):
    """Weights N(0, 0.1): the default init leaves Mixtral's router near zero, where rounding could
    flip a top-2 choice between two implementations; here routing is decisive."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.1)
    return model


def _folder(path, kind: str) -> str:
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
                                            sliding_window=None, router_jitter_noise=0.0)
        _decisive(transformers.MixtralForCausalLM(config)).save_pretrained(path)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                             head_dim=16, rope_theta=1e6)
        _decisive(transformers.Qwen3MoeForCausalLM(config)).save_pretrained(path)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**SHAPE, head_dim=16, rope_theta=1e6)
        transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    else:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, rope_theta=10000.0)).save_pretrained(path)
    return str(path)


def _trained(tmp, kind: str, targets: str) -> dict:
    """A LoRA run from a transformers-made folder of `kind` (or from the seed: kind "seeded")."""
    folder = None if kind == "seeded" else _folder(tmp / "base", kind)
    run = run_layout({"model": {"init_from": folder} if folder else {}, "train": TRAIN,
                      "lora": {**LORA, "targets": targets},
                      "checkpoint": {"dir": str(tmp / "ckpt"), "export_hf": str(tmp / "peft")}})
    return {"base": folder, "ckpt": str(tmp / "ckpt"), "peft": str(tmp / "peft"), "tmp": tmp, "run": run}


# The runs the tests read, each trained once per module on first use: kind -> its lora.targets.
TARGETS = {"llama": "attention|mlp", "mixtral": "attention|experts", "seeded": "attention|mlp",
           "qwen3_moe": "attention|experts", "qwen3": "attention|mlp"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {}

    def run(kind: str) -> dict:
        if kind not in runs:
            runs[kind] = _trained(tmp_path_factory.mktemp(f"lora_{kind}"), kind, TARGETS[kind])
        return runs[kind]

    return run


@pytest.fixture
def llama(trained):
    return trained("llama")


@pytest.fixture
def mixtral(trained):
    return trained("mixtral")


def _tokens():
    return torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(_tokens()).logits


def _ours(ckpt) -> torch.Tensor:
    with torch.no_grad():
        return fivefold.load_pretrained(ckpt).eval()(_tokens())


def _base(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen3_moe", "qwen3"])
def test_peft_loads_the_exported_adapter(kind, trained):
    run = trained(kind)
    written = json.loads((run["tmp"] / "peft" / "adapter_config.json").read_text())
    assert written["peft_type"] == "LORA" and written["r"] == 4 and written["lora_alpha"] == 8.0
    assert written["base_model_name_or_path"] == run["base"]
    ours, base = _ours(run["ckpt"]), _hf_logits(_base(run["base"]))
    adapted = _hf_logits(peft.PeftModel.from_pretrained(_base(run["base"]), run["peft"]))
    moved = (ours - base).abs().max().item()
    assert moved > 100 * TOL, f"the adapters moved the logits by {moved} only: the comparison would prove nothing"
    diff = (adapted - ours).abs().max().item()
    assert diff <= TOL, f"{kind}: PEFT's model differs from fivefold's adapted model by {diff}"


def test_the_export_names_the_modules_as_peft_does(llama, mixtral):
    from safetensors import safe_open

    names = set(safe_open(f"{llama['peft']}/adapter_model.safetensors", "pt").keys())
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names and len(names) == 2 * 2 * 7
    experts = set(safe_open(f"{mixtral['peft']}/adapter_model.safetensors", "pt").keys())
    assert "base_model.model.model.layers.0.block_sparse_moe.experts.3.w2.lora_A.weight" in experts
    assert len(experts) == 2 * 2 * (4 + 4 * 3)  # 2 layers, A and B, 4 attention + 4 experts x 3 projections


@pytest.mark.parametrize("kind", ["llama", "seeded"])
def test_the_adapted_model_is_the_run_s_final_model(kind, trained):
    """Every weight the run ended with, bit for bit: the base read again (from the folder, or drawn
    again from the seed) and the adapters read from the checkpoint."""
    run = trained(kind)
    loaded = fivefold.load_pretrained(run["ckpt"]).state_dict()
    assert set(run["run"].weights) <= set(loaded)
    for name, want in run["run"].weights.items():
        assert torch.equal(loaded[name], want), name


@pytest.mark.parametrize("kind", ["llama", "mixtral", "seeded"])
def test_merged_folder_equals_the_adapted_model(kind, trained):
    run = trained(kind)
    merged = run["tmp"] / "merged"
    if not merged.exists():
        assert "merged into it" in convert(run["ckpt"], merged, merge=True)
    diff = (_hf_logits(_base(merged)) - _ours(run["ckpt"])).abs().max().item()
    assert diff <= TOL, f"{kind}: the merged folder differs from the adapted model by {diff}"


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_load_pretrained_reads_the_peft_folder(kind, trained):
    run = trained(kind)
    with torch.no_grad():
        back = fivefold.load_pretrained(run["peft"]).eval()(_tokens())
    diff = (back - _ours(run["ckpt"])).abs().max().item()
    assert diff <= TOL, f"{kind}: the PEFT folder read back differs from the adapted model by {diff}"


def test_generate_reads_the_lora_checkpoint_the_merged_and_the_peft_folder(llama):
    merged = llama["tmp"] / "merged"
    if not merged.exists():
        convert(llama["ckpt"], merged, merge=True)
    _, from_checkpoint = generate(llama["ckpt"], "The ", tokens=12, temperature=0)
    _, from_merged = generate(str(merged), "The ", tokens=12, temperature=0)
    _, from_peft = generate(llama["peft"], "The ", tokens=12, temperature=0)
    _, from_base = generate(llama["base"], "The ", tokens=12, temperature=0)
    assert from_checkpoint == from_merged == from_peft
    assert from_checkpoint != from_base  # the adapters changed what the model says


def test_convert_without_merge_writes_the_peft_folder(llama):
    again = llama["tmp"] / "peft-again"
    assert convert(llama["ckpt"], again).startswith("wrote PEFT adapter folder")
    assert (again / "adapter_model.safetensors").read_bytes() == (llama["tmp"] / "peft" / "adapter_model.safetensors").read_bytes()


def test_a_changed_base_is_refused(llama):
    from fivefold.checkpoint.save_load import read_state
    from fivefold.train.export import checkpoint_folder, model_config
    from fivefold.train.lora_export import adapted_model

    path = checkpoint_folder(llama["ckpt"])
    state = read_state(path)
    other = {**state, "lora_base": {**state["lora_base"], "sha256": "0" * 64}}
    with pytest.raises(ConfigError, match=r"that folder now holds other weights.*put the base the run trained on back"):
        adapted_model(path, other, model_config(state, path))


def test_merge_of_a_whole_model_checkpoint_is_refused(tmp_path):
    run_layout({"train": {"steps": 1}, "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1}})
    with pytest.raises(ConfigError, match=r"--merge merges LoRA adapters, and checkpoint .* holds a whole model.*drop --merge"):
        convert(tmp_path / "ckpt", tmp_path / "out", merge=True)


def test_fused_experts_are_refused_before_the_run():
    """gpt-oss keeps gate and up interleaved in one (experts, in, 2 f) tensor: no module for PEFT."""
    cfg = load_config(None, {"model": {"preset": "tiny-gpt-oss", "n_layers": 2},
                             "lora": {**LORA, "targets": "attention|experts"},
                             "checkpoint": {"dir": "unused", "export_hf": "unused-export"}})
    with pytest.raises(ConfigError, match=r"lora.targets='attention\|experts' adapts layers.0.feed_forward.experts.w1, "
                                          r"which .* stores inside the fused tensor .*gate_up_proj.*convert --merge"):
        validate(cfg)  # the one gate the planner calls too


@pytest.mark.parametrize("change, sentence", [
    ({"use_dora": True}, r"sets use_dora=True, which fivefold's LoRA does not compute"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.1-8B"},
     r"names base_model_name_or_path='meta-llama/Llama-3.1-8B', which is not a Hugging Face folder on this machine")])
def test_a_peft_folder_fivefold_cannot_read_is_one_sentence(llama, tmp_path, change, sentence):
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(llama["peft"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=sentence):
        fivefold.load_pretrained(folder)


def test_fivefold_convert_merge_on_the_command_line(llama, tmp_path, capsys):
    from fivefold import cli

    assert cli.main(["convert", "--merge", llama["ckpt"], str(tmp_path / "merged")]) == 0
    assert "merged into it" in capsys.readouterr().out and (tmp_path / "merged" / "config.json").is_file()
    with pytest.raises(ConfigError, match=r"--merge merges the adapters of a LoRA checkpoint, and .* is not a fivefold "
                                          r"checkpoint.*give the checkpoint of a run with lora.rank > 0"):
        convert(llama["base"], tmp_path / "other", merge=True)


DEEPSEEK_V3 = {"preset": "tiny-deepseek-v3", "n_layers": 2, "n_kv_heads": 4}


def test_what_peft_would_load_wrongly_is_refused_before_the_run():
    """DeepSeek-V3: its balancing bias moves during the run (a PEFT folder holds adapters only), and
    its dense and shared MLPs' gate_proj/up_proj/down_proj share the routed experts' names, which
    PEFT on transformers 5 moves onto the fused experts (measured: logits 0.77 off)."""
    from fivefold.models.hf.peft_names import peft_names

    cfg = load_config(None, {"model": DEEPSEEK_V3, "lora": {**LORA, "targets": "attention|experts"},
                             "checkpoint": {"dir": "unused", "export_hf": "unused-export"}})
    with pytest.raises(ConfigError, match=r"model.moe.balance='bias' moves the routers' expert_bias during the run.*"
                                          r"unset checkpoint.export_hf and write the merged model after the run"):
        validate(cfg)
    with pytest.raises(ConfigError, match=r"adapts model.layers.0.mlp.down_proj, named like the routed experts' "
                                          r"down_proj.*leave mlp out of lora.targets"):
        peft_names(cfg.model, load_config(None, {"lora": {**LORA, "targets": "attention|mlp"}}).lora)


def test_deepseek_v3_merges_with_its_moved_bias_and_refuses_the_peft_folder(tmp_path):
    run_layout({"model": DEEPSEEK_V3, "train": TRAIN, "lora": {**LORA, "targets": "attention|experts"},
                "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": TRAIN["steps"]}})
    with pytest.raises(ConfigError, match=r"holds layers.1.feed_forward.router.expert_bias "
                                          r"\(model.layers.1.mlp.gate.e_score_correction_bias in Hugging Face's files\) "
                                          r"moved by the run.*fivefold convert --merge"):
        convert(tmp_path / "ckpt", tmp_path / "peft")
    convert(tmp_path / "ckpt", tmp_path / "merged", merge=True)
    diff = (_hf_logits(_base(tmp_path / "merged")) - _ours(tmp_path / "ckpt")).abs().max().item()
    assert diff <= TOL, f"deepseek_v3: the merged folder differs from the adapted model by {diff}"
