"""A LoRA checkpoint (adapters, no base: checkpoint/lora_base.py) out of fivefold, three ways:

- `write_peft_folder`: a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`
  under PEFT's names, models/hf/peft_names.py) that `peft.PeftModel.from_pretrained(base, folder)` loads
  onto the transformers model of `model.init_from`: what `checkpoint.export_hf` and
  `fivefold convert CKPT DST` write for a LoRA run.
- `write_merged_folder`: a Hugging Face folder of W + (alpha / rank) · B A for each adapted
  weight (`fivefold convert --merge`), streamed one tensor at a time as the full-model export is:
  each base tensor read from where the run read it (the folder, or the seed), merged, written.
- `adapted_model`: the single-device model with its adapters (`fivefold.load_pretrained`,
  `fivefold generate`).

The base is checked against what state.json recorded (the folder's sizes and header hash, or the
seed) first: adapters merged onto another base would be a different model, silently.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fivefold.config import ConfigError, ModelConfig
from fivefold.config.schema import LoraConfig
from fivefold.models.hf.peft_names import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from fivefold.models.lora.adapters import is_adapter
from fivefold.checkpoint.save_load import read_tensors


def lora_of(state: dict) -> LoraConfig | None:
    """The [lora] section a checkpoint was trained with, or None for a whole-model checkpoint."""
    saved = state.get("lora")
    return LoraConfig(**saved) if saved and saved.get("rank") else None


def with_base(path: Path, state: dict, base: str) -> dict:
    """The checkpoint's state with its base folder at `base` (`--base FOLDER`, when the base is no
    longer where the run read it), in its LoRA record and its model settings; the weights there are
    still checked against what the run recorded. `base` empty: as recorded."""
    if not base:
        return state
    recorded = state.get("lora_base", {})
    if "init_from" not in recorded:
        what = "the seeded initialisation (no base folder)" if "seed" in recorded else "a whole model, not adapters"
        raise ConfigError(f"--base names the base folder of LoRA adapters, and checkpoint {path} holds {what}; "
                          "drop --base")
    folder = str(Path(base).resolve())
    if not Path(folder).is_dir():
        raise ConfigError(f"--base {base} is not a folder; give the Hugging Face folder the adapters were trained on")
    return {**state, "lora_base": {**recorded, "init_from": folder}, "model": {**state["model"], "init_from": folder}}


def _checked_base(path: Path, state: dict, cfg: ModelConfig) -> None:
    """One sentence when the base the adapters were trained on is not the one that would be read now."""
    from fivefold.config import Config
    from fivefold.config.schema import TrainConfig
    from fivefold.checkpoint.lora_base import base_fingerprint, same_base

    then = state.get("lora_base", {})
    if "seed" in then:
        return  # the seeded initialisation is a pure function of the seed and the model config
    folder = then.get("init_from", "")
    if not Path(folder).is_dir():
        raise ConfigError(f"checkpoint {path} holds LoRA adapters trained on model.init_from={folder}, which is "
                          "not a folder now; put that Hugging Face folder back at that path, or give its new "
                          "place with --base FOLDER")
    now = base_fingerprint(Config(model=cfg, train=TrainConfig()))
    if not same_base(then, now):
        raise ConfigError(f"checkpoint {path} holds LoRA adapters trained on model.init_from={folder} "
                          f"({then['bytes']} bytes of safetensors, headers {then['sha256'][:12]}), and that folder "
                          f"now holds other weights ({now['bytes']} bytes, headers {now['sha256'][:12]}); put the "
                          "base the run trained on back there")


def base_reader(path: Path, state: dict, cfg: ModelConfig):
    """read(name) -> the whole fp32 base tensor `name` of the run (no tied copy), one at a time."""
    _checked_base(path, state, cfg)
    then = state["lora_base"]
    if "seed" in then:
        from fivefold.models import initial_values

        fill = initial_values(cfg, then["seed"])
        return lambda name, shape: fill(name, shape, (0,) * len(shape), shape)
    from fivefold.models.hf.stream import HFBoxes

    reader = HFBoxes(then["init_from"])

    def read(name: str, shape) -> torch.Tensor:
        tensor = reader.whole(name)
        reader.close()  # unmap: the pages just read would otherwise stay in this process's RSS
        return tensor
    return read


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: LoraConfig) -> torch.Tensor:
    """W + (alpha / rank) · B A; stacked experts (experts, out, in) expert by expert."""
    delta = torch.bmm(b.float(), a.float()) if base.dim() == 3 else b.float() @ a.float()
    return base.float() + (lora.alpha / lora.rank) * delta


def _adapters(path: Path, cfg: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors (adapters and persistent buffers: small), checked against the model."""
    from fivefold.checkpoint import sharded_io
    from fivefold.checkpoint.state_shapes import check_shapes, expected_tensors

    check_shapes(path, sharded_io.shapes(path), expected_tensors(cfg, with_optimizer=False, lora=lora), "model")
    return read_tensors(path)


def write_peft_folder(path: Path, state: dict, cfg: ModelConfig, dst) -> Path:
    """adapter_config.json and adapter_model.safetensors of LoRA checkpoint `path` in `dst`."""
    from safetensors.torch import save_file

    from fivefold.models.hf.peft_names import peft_names

    lora = lora_of(state)
    names = peft_names(cfg, lora)  # refuses what PEFT cannot load, before anything is written
    tensors = _adapters(path, cfg, lora)
    _refuse_moved_buffers(path, state, cfg, tensors)
    out = {}
    for ours, targets in names.tensors.items():
        for peft_name, expert in targets:
            out[peft_name] = (tensors[ours] if expert is None else tensors[ours][expert]).float().contiguous()
    base = state.get("lora_base", {}).get("init_from") or None  # a seeded base has no folder to name
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": names.target_modules,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
              "revision": None}
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / ADAPTER_WEIGHTS), metadata={"format": "pt"})  # transformers wants "format"
    (dst / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


def _refuse_moved_buffers(path: Path, state: dict, cfg: ModelConfig, tensors: dict) -> None:
    """A persistent buffer the run moved (the MoE balancing bias) is not in a PEFT folder: refused."""
    from fivefold.models.hf.peft_names import hf_name_of

    read_base = None
    for name, tensor in tensors.items():
        if is_adapter(name):
            continue
        read_base = read_base or base_reader(path, state, cfg)
        if not torch.equal(read_base(name, tuple(tensor.shape)).float(), tensor.float()):
            raise ConfigError(f"checkpoint {path} holds {name} ({hf_name_of(cfg, name)} in Hugging Face's files) moved "
                              "by the run, and a PEFT adapter folder holds adapters only; write the merged model "
                              f"instead (fivefold convert --merge {path} DST), which carries it")


def write_merged_folder(path: Path, state: dict, cfg: ModelConfig, dst, max_shard_bytes: int) -> Path:
    """A Hugging Face folder of the merged weights (fp32), one tensor in memory at a time."""
    from fivefold.models import build_meta_model
    from fivefold.models.hf.peft_names import adapted_weight
    from fivefold.models.hf.stream import write_hf_folder
    from fivefold.checkpoint.state_shapes import expected_shapes

    lora = lora_of(state)
    tensors = _adapters(path, cfg, lora)
    pairs = {}  # adapted weight -> (A, B)
    for name in tensors:
        if is_adapter(name) and name.endswith(("lora_A.weight", "_lora_A")):
            pairs[adapted_weight(name)] = (tensors[name], tensors[name.replace("lora_A", "lora_B")])
    read_base = base_reader(path, state, cfg)
    shapes = expected_shapes(build_meta_model(cfg))  # the whole model's tensors, in state-dict order

    def read(name: str) -> torch.Tensor:
        if name in tensors:  # a persistent buffer the run moved (the MoE balancing bias)
            return tensors[name].float()
        base = read_base(name, shapes[name])
        return merged(base, *pairs[name], lora) if name in pairs else base.float()

    return write_hf_folder(dst, cfg, {name: (shape, torch.float32) for name, shape in shapes.items()}, read,
                           max_shard_bytes)


def adapted_model(path: Path, state: dict, cfg: ModelConfig) -> torch.nn.Module:
    """The single-device model of LoRA checkpoint `path`: its base with the trained adapters beside it."""
    from fivefold.models import build_meta_model
    from fivefold.models.hf.interop import model_from_tensors
    from fivefold.models.lora.adapters import add_adapters
    from fivefold.checkpoint.state_shapes import expected_shapes

    lora = lora_of(state)
    tensors = _adapters(path, cfg, lora)
    read_base = base_reader(path, state, cfg)
    whole = {name: tensors[name] if name in tensors else read_base(name, shape)
             for name, shape in expected_shapes(build_meta_model(cfg)).items()}
    model = model_from_tensors(cfg, whole)
    add_adapters(model, lora)
    adapters = {name: t for name, t in tensors.items() if is_adapter(name)}
    missing = [name for name, _ in model.named_parameters() if is_adapter(name) and name not in adapters]
    if missing:  # check_shapes above makes this unreachable unless the model's adapters changed
        raise RuntimeError(f"adapted_model: no tensor for {missing[0]}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in adapters:
                param.copy_(adapters[name])
    return model
