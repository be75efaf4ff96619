"""Room for a checkpoint, checked at start: a save that fills the disk fails the run at its first
checkpoint, hours in, so the free space of the checkpoint folder's disk is compared with the size
of one checkpoint of this model before the first step, and a shortfall is said once.

A checkpoint holds every parameter once in fp32 and, unless it is weights only, each parameter's
optimizer state in fp32, whatever the layout: AdamW's two moments (12 bytes per parameter with the
weight), or Muon's one momentum for the matrices it updates (8 bytes; train.optimizer = muon leaves
embeddings, norms and biases to AdamW: config/param_groups.py). A new checkpoint is written in full
before older ones are pruned, so one checkpoint's size must be free.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fivefold.config import Config
from fivefold.plan.model_stats import model_stats
from fivefold.checkpoint.resume_optimizer import STATE_KEYS

FP32 = 4
MOST_PER_PARAMETER = FP32 * (1 + max(len(keys) for keys in STATE_KEYS.values()))  # AdamW's 12
GB = 1e9


def checkpoint_elements(cfg: Config) -> dict[str, int]:
    """fp32 elements of one checkpoint of this model by what they hold: 'weights', and each
    optimizer's state ('adamw', 'muon'), from a meta-device model (no memory)."""
    from fivefold.models.param_settings import settings_by_name
    from fivefold.models import build_meta_model
    from fivefold.models.lora.adapters import is_adapter

    model = build_meta_model(cfg.model, cfg.lora)
    settings = settings_by_name(cfg.train, model)
    out = {"weights": 0, **{name: 0 for name in STATE_KEYS}}
    for name, param in model.named_parameters():  # a tied matrix once, as the checkpoint holds it
        if cfg.lora.rank and not is_adapter(name):
            continue  # a LoRA checkpoint holds no frozen base (checkpoint/lora_base.py)
        optimizer = settings[name].optimizer
        out["weights"] += param.numel()
        out[optimizer] += param.numel() * len(STATE_KEYS[optimizer])
    return out


def checkpoint_bytes(cfg: Config) -> int:
    return FP32 * sum(checkpoint_elements(cfg).values())


def _what(elements: dict[str, int]) -> str:
    """What the checkpoint holds, in words, with its bytes per parameter."""
    state = [words for key, words in (("muon", "Muon's momentum of its matrices"),
                                      ("adamw", "AdamW's two moments")) if elements.get(key)]
    if len(state) == 2:
        state[1] += " of the rest"
    per = FP32 * sum(elements.values()) / max(1, elements["weights"])
    return f"fp32 weights{''.join(f' and {s}' for s in state)}, {per:.3g} bytes per parameter"


def _existing(path: Path) -> Path:
    """The folder itself or, before its first save creates it, the nearest folder above it."""
    return next((p for p in (path, *path.parents) if p.is_dir()), Path("."))


def space_warning(cfg: Config, root: Path | None, free_bytes=None) -> str | None:
    """The warning to print when `root`'s disk has less room than one checkpoint, else None.
    `free_bytes(folder)`: the free space of a folder's disk (shutil.disk_usage's, by default)."""
    if root is None or not (cfg.checkpoint.every or cfg.checkpoint.export_hf):
        return None
    folder = _existing(root)
    free = (free_bytes or (lambda p: shutil.disk_usage(p).free))(folder)
    if free >= model_stats(cfg.model).total_params * MOST_PER_PARAMETER:
        return None  # room for any optimizer's checkpoint: no model is built to count it exactly
    elements = checkpoint_elements(cfg)
    needed = FP32 * sum(elements.values())
    if free >= needed:
        return None
    return (f"warning: checkpoint folder {root} has {free / GB:.2f} GB free on its disk, but one checkpoint of "
            f"this model takes about {needed / GB:.2f} GB ({_what(elements)}); the first save will fail "
            "there: free space or set checkpoint.dir to a larger disk")
