"""Hugging Face interop: read a Llama checkpoint folder into our model, and write one back.

A folder is `config.json` plus safetensors weights (one file, several, or several named by
`model.safetensors.index.json`). Only safetensors is read: a pickle file can run code on load.

Names are translated by a table of templates (`NAME_MAP`), so a new architecture is new rows, not
new code. Mixtral adds its router rows there, and `EXPERT_MAP`: Hugging Face files keep one matrix
per expert (`experts.{expert}.w1.weight`), fivefold one stacked (experts, out, in) tensor per layer. Our RoPE uses the rotate-half convention of Hugging Face's
Llama, so the q/k projections are copied as they are, without the head permutation that Meta's
original checkpoints would need.

Weights stream (models/hf_stream.py): reading takes one box of one tensor at a time from the
safetensors files, writing one tensor at a time into transformers' sharded layout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from fivefold.config import ConfigError, ModelConfig, MoEConfig
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
    ("model.layers.{layer}.block_sparse_moe.gate.weight", "layers.{layer}.feed_forward.router.gate.weight"),
]

# Per-expert Hugging Face tensors -> one stacked tensor of ours; `{expert}` stands for the expert index.
EXPERT_MAP: list[tuple[str, str]] = [
    ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight", "layers.{layer}.feed_forward.experts.w1"),
    ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight", "layers.{layer}.feed_forward.experts.w2"),
    ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight", "layers.{layer}.feed_forward.experts.w3"),
]

# Tensors of ours with no Hugging Face counterpart: bias balancing's state (zeros in a fresh model).
OURS_ONLY = re.compile(r".*\.router\.expert_bias$")

# Tensors some checkpoints carry that are derived, not learned (older transformers saved these).
IGNORED_HF = re.compile(r".*\.rotary_emb\.inv_freq$")


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    return re.compile(escaped.replace(re.escape("{expert}"), r"(?P<expert>\d+)") + "$")


_HF_TO_OURS = [(_pattern(hf), ours) for hf, ours in NAME_MAP]
_OURS_TO_HF = [(_pattern(ours), hf) for hf, ours in NAME_MAP]
_STACKED_TO_HF = [(_pattern(ours), hf) for hf, ours in EXPERT_MAP]


def is_stacked(our_name: str) -> bool:
    return any(pattern.match(our_name) for pattern, _ in _STACKED_TO_HF)


def hf_sources(our_name: str, n_experts: int) -> list[str]:
    """The Hugging Face tensors that make up one of ours: one name, or one per expert when stacked."""
    for pattern, hf in _STACKED_TO_HF:
        match = pattern.match(our_name)
        if match:
            return [hf.format(expert=e, **match.groupdict()) for e in range(n_experts)]
    return [hf_name(our_name)]


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
    if model_type not in ("llama", "mixtral"):
        refuse(f"has model_type '{model_type}'; fivefold reads Llama and Mixtral checkpoints only "
               "(model_type 'llama' or 'mixtral')")
    moe: dict = {}
    if model_type == "mixtral":
        if hf.get("sliding_window"):
            refuse(f"sets sliding_window={hf['sliding_window']}; fivefold's attention is full causal, set it to null")
        for key in ("num_local_experts", "num_experts_per_tok"):
            if not isinstance(hf.get(key), int) or hf[key] <= 0:
                refuse(f"needs a positive integer {key}, got {hf.get(key)!r}")
        # Mixtral: softmax router, top-k renormalised, every layer MoE, experts as wide as intermediate_size.
        moe = dict(moe=MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                                 expert_ffn_dim=hf["intermediate_size"], score="softmax", balance="aux_loss",
                                 aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01))))
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
                       max_seq_len=int(hf.get("max_position_embeddings", 2048)), **scaling, **moe)


def hf_config_from(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A Llama config.json for `cfg` (a Mixtral one for a Mixtral-shaped MoE).

    RoPE is written the pre-5.0 way (top-level rope_theta and rope_scaling): transformers 5 still
    reads it, while older readers would silently ignore `rope_parameters` and use the wrong theta.
    """
    m = cfg.moe
    if m.n_experts > 0:
        mixtral = (m.score == "softmax" and m.balance != "bias" and m.n_shared_experts == 0 and m.every == 1
                   and m.first_dense == 0 and (m.expert_ffn_dim or cfg.ffn_dim) == cfg.ffn_dim
                   and m.capacity_factor == 0 and cfg.rope_scaling == 0)
        if not mixtral:
            raise ConfigError(f"model.moe (n_experts={m.n_experts}) is not Mixtral-shaped: Hugging Face export "
                              "covers dense Llama models and Mixtral (softmax router, no bias balancing, no "
                              "shared experts, every layer MoE, expert_ffn_dim = ffn_dim, dropless)")
    rope_scaling = None
    if cfg.rope_scaling > 0:
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling,
                        "low_freq_factor": cfg.rope_low_freq_factor,
                        "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    out = {
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
    if m.n_experts > 0:
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=m.n_experts,
                   num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coeff, sliding_window=None,
                   router_jitter_noise=0.0, output_router_logits=False)
        for key in ("rope_scaling", "mlp_bias", "attention_bias"):
            del out[key]
    return out


# --------------------------------------------------------------------------------------------
# Weights

DEFAULT_SHARD_BYTES = 5 * 10**9  # the Hub's usual shard ("5GB"); writing streams, so memory does not depend on it


def hf_box_reader(folder) -> tuple[ModelConfig, Callable[[str, tuple, tuple, tuple], torch.Tensor]]:
    """(ModelConfig, fill): `fill(name, whole_shape, offsets, sizes)` reads that box of fivefold's
    tensor `name` from a Hugging Face folder as fp32 (see models/hf_stream.py)."""
    from fivefold.models.hf_stream import hf_box_reader as reader

    return reader(folder)


def load_pretrained(path, dtype: torch.dtype | None = torch.float32) -> Transformer:
    """Our model with the weights of a Hugging Face Llama checkpoint folder.

    Weights are converted to `dtype` (fp32 by default, the trainer's master precision; None keeps
    the stored dtype). They are read tensor by tensor into a meta-device model, so the peak is the
    model plus one tensor (not random initial weights and then the loaded ones).
    """
    from fivefold.models.hf_stream import HFBoxes

    reader = HFBoxes(path, dtype)
    tensors = {}
    for name in reader.shapes:
        tensors[name] = reader.whole(name)
        reader.close()  # unmap: the pages just read would otherwise stay in this process's RSS
    return model_from_tensors(reader.cfg, tensors)


def model_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Transformer:
    """The model of `cfg` around these whole tensors (a checkpoint's: a tied output is absent), not copied."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.tie_embeddings:
        tensors = {**tensors, "output.weight": tensors["tok_embeddings.weight"]}
    model.load_state_dict(tensors, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign=True gives each module its own Parameter; tie them again
        model.output.weight = model.tok_embeddings.weight
    _materialize_buffers(model, cfg)
    return model


def _materialize_buffers(model: Transformer, cfg: ModelConfig) -> None:
    """Non-persistent buffers (RoPE frequencies) are computed, not loaded: take them from a model of
    the same config with no layers and a one-token vocabulary, which costs nothing to build."""
    shell = Transformer(dataclasses.replace(cfg, n_layers=0, vocab_size=1))
    for name, buffer in shell.named_buffers():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, buffer)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a buffer inside a layer would need handling here
        raise RuntimeError(f"model_from_tensors left {left} unset; teach _materialize_buffers about it")


def save_hf(model: Transformer, path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
    """Write `model` as a Hugging Face folder (config.json + safetensors shards, with an index when
    there are several, as transformers writes them); returns the folder."""
    from fivefold.models.hf_stream import write_hf_folder

    missing = [m for m in ("tok_embeddings", "norm", "output") if getattr(model, m) is None]
    if missing:
        raise ValueError(f"save_hf needs the whole model, but this one has no {', '.join(missing)} "
                         "(a pipeline stage?)")
    state = model.state_dict()
    return write_hf_folder(path, model.cfg, {name: (tuple(t.shape), t.dtype) for name, t in state.items()},
                           lambda name: state[name].cpu(), max_shard_bytes)
