"""Hugging Face interop: read a Llama checkpoint folder into our model, and write one back.

A folder is `config.json` plus safetensors weights (one file, several, or several named by
`model.safetensors.index.json`). Only safetensors is read: a pickle file can run code on load.

Names are translated by a table of templates (`NAME_MAP`), so a new architecture (Mixtral's
experts, say) is new rows, not new code. Our RoPE uses the rotate-half convention of Hugging Face's
Llama, so the q/k projections are copied as they are, without the head permutation that Meta's
original checkpoints would need.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fivefold.config import ConfigError, ModelConfig
from fivefold.models.llama import Transformer

# (Hugging Face name, our name); `{layer}` stands for a layer index.
NAME_MAP: list[tuple[str, str]] = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.attention_norm.weight"),
    ("model.layers.{layer}.self_attn.q_proj.weight", "layers.{layer}.attention.wq.weight"),
    ("model.layers.{layer}.self_attn.k_proj.weight", "layers.{layer}.attention.wk.weight"),
    ("model.layers.{layer}.self_attn.v_proj.weight", "layers.{layer}.attention.wv.weight"),
    ("model.layers.{layer}.self_attn.o_proj.weight", "layers.{layer}.attention.wo.weight"),
    ("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.ffn_norm.weight"),
    ("model.layers.{layer}.mlp.gate_proj.weight", "layers.{layer}.feed_forward.w1.weight"),
    ("model.layers.{layer}.mlp.up_proj.weight", "layers.{layer}.feed_forward.w3.weight"),
    ("model.layers.{layer}.mlp.down_proj.weight", "layers.{layer}.feed_forward.w2.weight"),
]

# Tensors some checkpoints carry that are derived, not learned (older transformers saved these).
IGNORED_HF = re.compile(r".*\.rotary_emb\.inv_freq$")


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{layer}"), r"(?P<layer>\d+)") + "$")


_HF_TO_OURS = [(_pattern(hf), ours) for hf, ours in NAME_MAP]
_OURS_TO_HF = [(_pattern(ours), hf) for hf, ours in NAME_MAP]


def _translate(name: str, table) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.format(**match.groupdict())
    return None


def hf_name(our_name: str) -> str:
    hf = _translate(our_name, _OURS_TO_HF)
    if hf is None:
        raise KeyError(f"no Hugging Face name for parameter {our_name}; add a row to NAME_MAP")
    return hf


def our_name(hf: str) -> str | None:
    """Our parameter name for a Hugging Face tensor name, or None when the table has no row."""
    return _translate(hf, _HF_TO_OURS)


# --------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama config.json; anything our model cannot express is refused."""
    def refuse(message: str) -> None:
        raise ConfigError(f"config.json {message}")

    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        refuse(f"has model_type '{model_type}'; fivefold reads Llama checkpoints only (model_type 'llama')")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(hf.get(key), int) or hf[key] <= 0:
            refuse(f"needs a positive integer {key}, got {hf.get(key)!r}")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if dim % n_heads or n_heads % n_kv_heads:
        refuse(f"has hidden_size={dim}, num_attention_heads={n_heads}, num_key_value_heads={n_kv_heads}; "
               "the heads must divide hidden_size and the kv heads must divide the heads")
    head_dim = hf.get("head_dim") or dim // n_heads
    if head_dim != dim // n_heads:
        refuse(f"has head_dim={head_dim} but fivefold needs head_dim = hidden_size/num_attention_heads "
               f"= {dim // n_heads}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(f"sets {key}=true; fivefold's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"has hidden_act '{hf['hidden_act']}'; fivefold's feed-forward is SwiGLU (hidden_act 'silu')")
    if hf.get("attention_dropout", 0.0):
        refuse(f"sets attention_dropout={hf['attention_dropout']}; fivefold has no dropout, set it to 0")

    # transformers 5 writes `rope_parameters` (with rope_theta inside); older files write
    # `rope_theta` and `rope_scaling` at the top level (and very old ones say `type`, not `rope_type`).
    # Where a file has both, the precedence is transformers 5's: rope_scaling over rope_parameters,
    # and a rope_theta inside them over the top-level one.
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("sets partial_rotary_factor; fivefold rotates the whole head")
    scaling: dict = {}
    if rope_type == "llama3":
        needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(key not in rope for key in needed):
            refuse(f"uses rope_type 'llama3' but lacks some of {', '.join(needed)}")
        scaling = dict(rope_scaling=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        refuse(f"uses rope_type '{rope_type}'; fivefold implements only the default and 'llama3' RoPE")

    return ModelConfig(dim=dim, n_layers=hf["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads,
                       ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       max_seq_len=int(hf.get("max_position_embeddings", 2048)), **scaling)


def hf_config_from(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A Llama config.json for `cfg`.

    RoPE is written the pre-5.0 way (top-level rope_theta and rope_scaling): transformers 5 still
    reads it, while older readers would silently ignore `rope_parameters` and use the wrong theta.
    """
    if cfg.moe.n_experts > 0:
        raise ConfigError(f"model.moe.n_experts={cfg.moe.n_experts}: Hugging Face export covers dense "
                          "Llama models only for now")
    rope_scaling = None
    if cfg.rope_scaling > 0:
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling,
                        "low_freq_factor": cfg.rope_low_freq_factor,
                        "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# --------------------------------------------------------------------------------------------
# Weights


def _weight_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = (f"; it has {', '.join(sorted(other))}, which fivefold does not read because pickle files "
                "can run code: convert them to safetensors first") if other else ""
        raise ConfigError(f"{folder} has no *.safetensors weight files{hint}")
    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            where.update({name: file for name in f.keys()})
    return where


def load_pretrained(path, dtype: torch.dtype | None = torch.float32) -> Transformer:
    """Our model with the weights of a Hugging Face Llama checkpoint folder.

    Weights are converted to `dtype` (fp32 by default, the trainer's master precision; None keeps
    the stored dtype). The model is built on the meta device so that a large checkpoint is held once,
    not twice (random initial weights and then the loaded ones).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; pass a Hugging Face checkpoint folder "
                          "(config.json + *.safetensors)")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} has no config.json; load_pretrained reads Hugging Face checkpoint "
                          "folders (config.json + *.safetensors), and fivefold checkpoints cannot be "
                          "loaded this way yet")
    try:
        hf_cfg = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{folder / 'config.json'} is not valid JSON: {err}") from None
    if not isinstance(hf_cfg, dict):
        raise ConfigError(f"{folder / 'config.json'} must hold a JSON object of model settings")
    try:
        cfg = config_from_hf(hf_cfg)
    except ConfigError as err:
        raise ConfigError(f"{folder}/{err}") from None

    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        del expected["output.weight"]  # HF omits lm_head when it is tied; embed_tokens fills both
    where = _weight_files(folder)
    tensors = _read_tensors(folder, where, expected, dtype)
    if cfg.tie_embeddings:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign=True gives each module its own Parameter; tie them again
        model.output.weight = model.tok_embeddings.weight
    _materialize_buffers(model, cfg)
    return model


def _read_tensors(folder: Path, where: dict[str, Path], expected: dict[str, tuple],
                  dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    hf_names = {hf_name(ours): ours for ours in expected}
    for name in where:
        if name not in hf_names and not IGNORED_HF.match(name) and not (
                name == "lm_head.weight" and "output.weight" not in expected):
            raise ConfigError(f"{folder} holds tensor {name}, which fivefold's Llama has no place for; "
                              "check that config.json describes these weights")
    by_file: dict[Path, list[str]] = {}
    for name, ours in hf_names.items():
        if name not in where:
            raise ConfigError(f"{folder} is missing tensor {name} (shape {list(expected[ours])}) that "
                              "config.json implies")
        by_file.setdefault(where[name], []).append(name)
    tensors = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise ConfigError(f"{file} is named by model.safetensors.index.json but does not exist")
        with safe_open(file, framework="pt") as f:
            for name in names:
                ours = hf_names[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[ours]:
                    raise ConfigError(f"tensor {name} in {file} has shape {list(shape)}, but config.json "
                                      f"implies {list(expected[ours])}")
                tensor = f.get_tensor(name)
                tensors[ours] = tensor.to(dtype) if dtype is not None else tensor
    return tensors


def _materialize_buffers(model: Transformer, cfg: ModelConfig) -> None:
    """Non-persistent buffers (RoPE frequencies) are computed, not loaded: take them from a model of
    the same config with no layers and a one-token vocabulary, which costs nothing to build."""
    shell = Transformer(dataclasses.replace(cfg, n_layers=0, vocab_size=1))
    for name, buffer in shell.named_buffers():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, buffer)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a buffer inside a layer would need handling here
        raise RuntimeError(f"load_pretrained left {left} unset; teach _materialize_buffers about it")


def save_hf(model: Transformer, path) -> Path:
    """Write `model` as a Hugging Face Llama folder (config.json + model.safetensors); returns the folder."""
    missing = [m for m in ("tok_embeddings", "norm", "output") if getattr(model, m) is None]
    if missing:
        raise ValueError(f"save_hf needs the whole model, but this one has no {', '.join(missing)} "
                         "(a pipeline stage?)")
    hf_cfg = hf_config_from(model.cfg, model.tok_embeddings.weight.dtype)  # refuses what HF Llama lacks
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        del state["output.weight"]  # safetensors refuses shared storage; HF re-ties lm_head on load
    tensors = {hf_name(name): t.detach().cpu().contiguous() for name, t in state.items()}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
