"""`fivefold convert SRC DST`: fivefold checkpoints to and from Hugging Face folders.

- A fivefold checkpoint (a step_N folder, or a checkpoint root with `latest`), written by any
  layout, becomes a Hugging Face folder (config.json + model.safetensors) that transformers loads.
- A Hugging Face folder becomes a weights-only fivefold checkpoint: the model's tensors (one
  process's torch.distributed.checkpoint files), state.json marked weights_only, and config.toml with the model's [model] section. Training from it:
  `fivefold train DST/config.toml --checkpoint.resume DST` (a fresh optimizer, data and schedule
  from step 0, the imported weights).
Checkpoints store every tensor under its single-device name and whole shape, whichever layout
wrote them, so one process reads (or writes) them whole here, with no process group.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fivefold.config import ConfigError, load_config, to_toml


def _model_config(state: dict, path: Path):
    try:
        return load_config(None, {"model": state["model"]}).model
    except (KeyError, ConfigError) as err:
        raise ConfigError(f"checkpoint {path}/state.json has no usable [model] settings ({err})") from None


def checkpoint_to_model(path) -> torch.nn.Module:
    """The single-device model with the weights of a fivefold checkpoint (any saving layout)."""
    from fivefold.models import Transformer
    from fivefold.train.checkpoint import LATEST, _follow_latest, read_state, read_tensors

    path = Path(path)
    if (path / LATEST).is_file() and not (path / "state.json").is_file():
        path = _follow_latest(path)
    if not (path / "state.json").is_file():
        raise ConfigError(f"{path} is not a fivefold checkpoint (no state.json)")
    cfg = _model_config(read_state(path), path)
    model = Transformer(cfg)
    tensors = read_tensors(path, cfg)
    if cfg.tie_embeddings:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]
    model.load_state_dict(tensors, strict=True)
    return model


def hf_to_checkpoint(src, dst) -> Path:
    from fivefold.config import Config
    from fivefold.models.hf import load_pretrained
    from fivefold.train import sharded_io
    from fivefold.train.checkpoint import FORMAT

    model = load_pretrained(src)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = {f"model/{k}": sharded_io.whole(v.contiguous()) for k, v in model.state_dict().items()
             if not (k == "output.weight" and model.cfg.tie_embeddings)}
    sharded_io.save(state, dst, single_process=True)
    cfg = Config(model=model.cfg)
    (dst / "state.json").write_text(json.dumps({"format": FORMAT, "step": 0, "weights_only": True,
                                                "model": cfg.to_dict()["model"]}, indent=1))
    (dst / "config.toml").write_text(to_toml(cfg))
    return dst


def convert(src, dst) -> str:
    """Direction from what SRC is; returns a one-line summary."""
    src = Path(src)
    if (src / "config.json").is_file():
        hf_to_checkpoint(src, dst)
        return f"wrote fivefold checkpoint {dst} (train from it: fivefold train {dst}/config.toml " \
               f"--checkpoint.resume {dst})"
    if (src / "state.json").is_file() or (src / "latest").is_file():
        from fivefold.models.hf import save_hf

        save_hf(checkpoint_to_model(src), dst)
        return f"wrote Hugging Face folder {dst}"
    raise ConfigError(f"{src} is neither a Hugging Face folder (config.json) nor a fivefold checkpoint "
                      "(state.json or latest)")
