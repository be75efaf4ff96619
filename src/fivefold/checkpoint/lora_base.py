"""What a LoRA checkpoint says of the base it was trained on, and the check on resume.

A LoRA checkpoint holds the adapters, their optimizer state and the persistent buffers, not the
frozen base (checkpoint/state_boxes.py): a resumed run reads the base again from where the first run
did, the Hugging Face folder of `model.init_from` or the seeded initialisation of `train.seed`.
So state.json records that source, and a resume refuses, in one sentence, a base that differs:
another folder's files (their sizes and a SHA-256 of their safetensors headers, which name every
tensor with its dtype, shape and place, and of SAMPLES evenly spaced 64 KiB samples of their
weights: another checkpoint of the same architecture differs there, while a 140 GB base is not
read whole at every resume), or another seed.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

from fivefold.config import Config, ConfigError

SAMPLES, SAMPLE_BYTES = 16, 64 * 1024  # per safetensors file


def lora_state(cfg: Config) -> dict:
    """The state.json entries of a LoRA run (none without adapters)."""
    if not cfg.lora.rank:
        return {}
    return {"lora": cfg.to_dict()["lora"], "lora_base": base_fingerprint(cfg)}


def base_fingerprint(cfg: Config) -> dict:
    if not cfg.model.init_from:
        return {"seed": cfg.train.seed}
    files = sorted(Path(cfg.model.init_from).glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            header = f.read(8)
            length = struct.unpack("<Q", header)[0] if len(header) == 8 else 0
            digest.update(file.name.encode() + header + f.read(length))
            start, size = f.tell(), file.stat().st_size
            for i in range(SAMPLES):  # the weights, sampled
                f.seek(start + (size - start) * i // SAMPLES)
                digest.update(f.read(SAMPLE_BYTES))
    # Absolute: a checkpoint's outputs (generate, convert, a PEFT folder) find it from any directory.
    return {"init_from": str(Path(cfg.model.init_from).resolve()), "bytes": sum(f.stat().st_size for f in files),
            "sha256": digest.hexdigest()}


def same_base(then: dict, now: dict) -> bool:
    """The same seed, or a folder with the same safetensors (sizes, headers, sampled weights),
    wherever it is now."""
    keys = ("seed",) if "seed" in then else ("bytes", "sha256")
    return all(then.get(k) == now.get(k) for k in keys) and ("seed" in then) == ("seed" in now)


def check_lora_resume(path: Path, state: dict, cfg: Config) -> None:
    """One sentence when the checkpoint's adapters do not fit this run, or its base is not this run's."""
    saved = state.get("lora", {"rank": 0})
    if not saved["rank"] and not cfg.lora.rank:
        return
    if not saved["rank"]:
        raise ConfigError(f"checkpoint {path} holds a whole model, not LoRA adapters; resume it with lora.rank = 0, "
                          "or adapt it: write it as a Hugging Face folder (fivefold convert) and start LoRA from "
                          "that folder with model.init_from")
    if not cfg.lora.rank or (saved["rank"], saved["targets"]) != (cfg.lora.rank, cfg.lora.targets):
        raise ConfigError(f"checkpoint {path} holds LoRA adapters of lora.rank={saved['rank']} on "
                          f"lora.targets='{saved['targets']}' and no base weights; resume it with those two keys "
                          f"(this run has lora.rank={cfg.lora.rank}, lora.targets='{cfg.lora.targets}')")
    changed = [f"lora.{key} {saved[key]} -> {getattr(cfg.lora, key)}" for key in ("alpha", "dropout")
               if saved[key] != getattr(cfg.lora, key)]
    if changed and _rank() == 0:  # as for changed training keys: the new values win
        print(f"warning: resuming {path} with changed LoRA keys ({', '.join(changed)}); the new values apply from "
              f"step {state['step'] + 1}", file=sys.stderr, flush=True)
    then, now = state.get("lora_base", {}), base_fingerprint(cfg)
    if same_base(then, now):  # the same weights, wherever the folder is now
        return
    if "seed" in then:
        base = f"the seeded initialisation of train.seed={then['seed']}"
        fix = f"resume with train.seed = {then['seed']} and no model.init_from"
    else:
        base = f"model.init_from={then['init_from']} ({then['bytes']} bytes of safetensors, headers and samples {then['sha256'][:12]})"
        fix = "point model.init_from at that base"
    if "seed" in now:
        this = f"the seeded initialisation of train.seed={now['seed']}"
    else:
        this = f"model.init_from={now['init_from']} ({now['bytes']} bytes, headers and samples {now['sha256'][:12]})"
    raise ConfigError(f"checkpoint {path} holds LoRA adapters trained on {base}, and this run's base is {this}; {fix}")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
