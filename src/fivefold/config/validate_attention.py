"""Checks of the model keys only some families implement (config/families.py `FAMILY_KEYS`) and of
how sliding windows, sinks, YaRN and the clamped SwiGLU combine, and which families take Llama
3.1's RoPE scaling (config/families.py LLAMA3_ROPE_FAMILIES), each one sentence as in
config/validate.py, whose model checks call `check_family_keys` first. Every attention path,
context-parallel ones included, implements windows and sinks.
"""

from __future__ import annotations

import dataclasses

from fivefold.config.errors import require as _require
from fivefold.config.families import FAMILY_KEYS, LLAMA3_ROPE_FAMILIES
from fivefold.config.schema import Config, ModelConfig, MoEConfig


def _shown(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"'{value}'" if isinstance(value, str) else str(value)


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def check_family_keys(cfg: Config) -> None:
    m = cfg.model
    model_defaults, moe_defaults = _defaults(ModelConfig), _defaults(MoEConfig)
    for key, families in FAMILY_KEYS.items():
        section, _, name = key.rpartition(".")
        value = getattr(m.moe if section else m, name)
        default = (moe_defaults if section else model_defaults)[name]
        _require(value == default or m.family in families, f"model.{key}={_shown(value)} is implemented by "
                 f"model.family {' and '.join(families)} only (model.family={m.family}); remove it")
    e = m.moe
    if e.activation != "clamped_swiglu":
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(e, name)
            _require(value == moe_defaults[name], f"model.moe.{name}={value} shapes model.moe.activation="
                     f"'clamped_swiglu' only, and the activation is '{e.activation}'; remove it or set "
                     "model.moe.activation='clamped_swiglu'")
    _require(not (m.rope_yarn_factor > 0 and m.rope_scaling > 0), f"model.rope_yarn_factor={m.rope_yarn_factor} "
             f"and model.rope_scaling={m.rope_scaling} are two RoPE scalings; set one of them to 0")
    _require(m.rope_scaling == 0 or m.family in LLAMA3_ROPE_FAMILIES, f"model.rope_scaling={m.rope_scaling} "
             f"(Llama 3.1 RoPE) is not available in model.family={m.family}; use model.rope_yarn_factor, or set "
             "model.rope_scaling=0")
    if m.rope_yarn_factor > 0:
        _require(m.rope_yarn_beta_fast > m.rope_yarn_beta_slow, "model.rope_yarn_beta_fast="
                 f"{m.rope_yarn_beta_fast} must exceed model.rope_yarn_beta_slow={m.rope_yarn_beta_slow} > 0")
    if m.full_attention_every:
        _require(m.sliding_window > 0, f"model.full_attention_every={m.full_attention_every} picks the "
                 "full-attention layers among sliding-window ones, but model.sliding_window=0 (no layer "
                 "slides); set model.sliding_window or remove it")
        _require(m.full_attention_every > 1, f"model.full_attention_every=1 makes every layer full attention, "
                 f"so model.sliding_window={m.sliding_window} does nothing; set model.sliding_window=0, or "
                 "model.full_attention_every to 0 (every layer slides) or 2 or more")
