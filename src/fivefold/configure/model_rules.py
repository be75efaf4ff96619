"""The rules that need the model code: the family's own (its ModelSpec: what the family has, and
multi-token prediction only where it exists), what a Hugging Face export can express, whether
train.param_groups gives Muon a tensor that is not a matrix, and whether lora.targets = re:PATTERN
selects any linear layer. The last two depend on the parameters' names, kinds and shapes, which only
the families' classes say; the model is built on the meta device (no memory), and only when a
config asks for Muon or for a pattern."""

from __future__ import annotations

from fivefold.config import Config, ConfigError
from fivefold.config.lora import parse_targets
from fivefold.config.validate_optimizer import runs_muon


def check_family(cfg: Config) -> None:
    """One sentence if the family cannot be what the keys ask (its ModelSpec's facts: experts or
    none, multi-token prediction; then its own `check`), or if checkpoint.export_hf asks for a folder
    transformers (or PEFT, for an adapter) could not load. Keys of the model only, not the layout:
    checked once per model for the search's many layouts."""
    m = cfg.model
    key = (repr(m), cfg.checkpoint.export_hf, repr(cfg.lora))
    if key in _FAMILY_CHECKED:
        return
    from fivefold.models.registry import model_spec

    spec = model_spec(m)
    _check_experts(m, spec)
    if m.mtp_depth and not spec.multi_token_prediction:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} needs a family with multi-token prediction "
                          f"(deepseek_v3); model.family={m.family} has none, so set model.mtp_depth = 0")
    spec.check(m)
    if cfg.checkpoint.export_hf:
        from fivefold.models.hf.interop import hf_config_from

        hf_config_from(m)  # what transformers cannot express is refused now, not after the run
        if cfg.lora.rank:  # a PEFT adapter folder: an adapter PEFT cannot load, likewise
            from fivefold.models.hf.peft_names import check_peft_export

            check_peft_export(m, cfg.lora)
    _FAMILY_CHECKED.add(key)


_FAMILY_CHECKED: set[tuple] = set()  # (model, export, lora) that passed check_family


def _check_experts(m, spec) -> None:
    """A dense-only family with experts, or an MoE-only one without: the family to name instead."""
    n = m.moe.n_experts
    if spec.experts == "none" and n > 0:
        raise ConfigError(f"model.family={m.family} is dense but model.moe.n_experts={n}; "
                          f"use model.family={spec.other_kind} for an MoE model")
    if spec.experts == "required" and n == 0:
        why = f" ({spec.experts_why})" if spec.experts_why else ""
        raise ConfigError(f"model.family={m.family} needs model.moe.n_experts > 0{why}; "
                          f"use model.family={spec.other_kind} for a dense model")


def check_param_groups(cfg: Config) -> None:
    """One sentence if a group gives Muon a vector (models/param_settings.py)."""
    t = cfg.train
    if not runs_muon(t.optimizer, t.param_groups):
        return
    # The verdict depends on the model and the optimizer keys only, not on the layout: the planner's
    # search validates many layouts of one model (a meta model of qwen3-30b-a3b: ~7 s).
    key = (repr(cfg.model), t.optimizer, t.param_groups, t.weight_decay)
    if key in _GROUPS_CHECKED:
        return
    from fivefold.models import build_meta_model
    from fivefold.models.param_settings import settings_by_name

    settings_by_name(t, build_meta_model(cfg.model))
    _GROUPS_CHECKED.add(key)


_GROUPS_CHECKED: set[tuple] = set()  # (model, optimizer keys) whose groups passed check_param_groups


def check_lora_targets(cfg: Config) -> None:
    """One sentence if lora.targets' pattern selects no linear layer (models/lora/adapters.py says so while
    it builds the adapters)."""
    if cfg.lora.rank and parse_targets(cfg.lora.targets).pattern:
        from fivefold.models import build_meta_model

        build_meta_model(cfg.model, cfg.lora)
