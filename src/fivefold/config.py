"""Configuration: one dataclass per TOML section, TOML loading, `--section.key value` overrides.

A config is resolved in this order: dataclass defaults < model preset < TOML file < command line.
Every problem is reported as a `ConfigError` holding one sentence that names the key and the fix;
the CLI prints that sentence and exits, so no traceback reaches the user for a bad config.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from fivefold import shipped_configs
from fivefold.presets import PRESETS


class ConfigError(ValueError):
    """A bad configuration, explained in one sentence."""


@dataclass
class MoEConfig:
    n_experts: int = 0  # 0 = dense model
    top_k: int = 2
    n_shared_experts: int = 0
    every: int = 1  # an MoE layer every `every` layers (after the first `first_dense`)
    first_dense: int = 0
    expert_ffn_dim: int = 0  # 0 = model.ffn_dim
    score: str = "softmax"  # softmax | sigmoid
    balance: str = "aux_loss"  # aux_loss | bias | none
    aux_loss_coeff: float = 0.01
    bias_update_rate: float = 0.001
    capacity_factor: float = 0.0  # 0 = dropless
    norm_topk_prob: bool = True  # renormalise the top-k combine weights to sum to 1 (when top_k > 1)
    dense_layers: str = ""  # e.g. "0,5": layers kept dense whatever `every`/`first_dense` say (Qwen's mlp_only_layers)
    # Group-limited routing (DeepSeek-V3): experts in n_group equal groups, each token choosing among the
    # topk_group groups whose two best (biased) scores sum highest; 1 and 1 = no grouping.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' combine weights (after renormalising)


@dataclass
class ModelConfig:
    preset: str = "tiny"
    # The ModelSpec (models/registry.py): llama, mixtral, qwen3, qwen3_moe. Empty = from the preset,
    # or llama for a dense model and mixtral for an MoE one.
    family: str = ""
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0 = dim // n_heads (Qwen3 sets it explicitly: its heads need not add up to dim)
    ffn_dim: int = 384
    vocab_size: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 1024
    # Llama 3.1 RoPE frequency scaling; rope_scaling = 0 turns it off.
    rope_scaling: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # also YaRN's original context
    # YaRN RoPE scaling (deepseek_v3), as Hugging Face's config writes it; rope_yarn_factor = 0 turns it off.
    rope_yarn_factor: float = 0.0
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 0.0  # 0 = unset (Hugging Face's null)
    rope_yarn_mscale_all_dim: float = 0.0  # 0 = unset; set, it also scales the softmax by its mscale squared
    # Multi-head latent attention (deepseek_v3; kv_lora_rank = 0 elsewhere): keys and values expanded
    # per head from a kv_lora_rank latent, plus one qk_rope_head_dim RoPE key shared by all heads;
    # queries through a q_lora_rank latent (0 = one direct projection, as in DeepSeek-V2-Lite).
    # head_dim is then the q/k head dim, qk_nope_head_dim + qk_rope_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    moe: MoEConfig = field(default_factory=MoEConfig)
    # A Hugging Face folder (config.json + safetensors): the model's shape comes from its config.json
    # and a fresh run starts from its weights, each rank reading only the slices it holds.
    init_from: str = ""

    def __post_init__(self):
        # Derived defaults, fixed once the other keys are known (a config resolves in one go).
        if not self.head_dim and self.kv_lora_rank > 0:
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if not self.head_dim and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if not self.family:
            self.family = "mixtral" if self.moe.n_experts > 0 else "llama"


@dataclass
class ParallelConfig:
    dp: int = 1
    zero: int = 0  # 0 replicate, 1 shard optimizer, 2 + gradients, 3 + parameters (FSDP)
    dp_shard: int = 0  # HSDP: size of the sharded sub-group; 0 = all of dp
    tp: int = 1
    sp: bool = True  # sequence parallelism (only meaningful when tp > 1)
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_layers: str = ""  # e.g. "7,9,9,7"; empty = balance by estimated cost
    cp: int = 1
    cp_method: str = "ring"
    ep: int = 1
    order: str = "pp,dp,cp,tp"  # outermost to innermost
    timeout_s: float = 300.0  # every collective; a lost rank becomes an error, not a hang
    backend: str = "auto"  # auto | nccl | gloo | cpu:gloo,cuda:nccl (auto: the last on CUDA, gloo on CPU)
    gpus_per_node: int = 8

    def __post_init__(self):
        # The V schedules run exactly two stages per rank: pp_virtual left at its default 1 means
        # that (another explicit value is refused by fivefold.validate).
        if self.pp > 1 and self.pp_schedule in ("zbv", "dualpipev") and self.pp_virtual == 1:
            self.pp_virtual = 2


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    seq_len: int = 128
    global_batch: int = 16  # sequences per optimizer step
    micro_batch: int = 0  # sequences per micro-batch per dp rank; 0 = global_batch / dp
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    schedule: str = "cosine"  # cosine | wsd | constant
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    dtype: str = "fp32"  # fp32 | bf16 (bf16 compute, fp32 master weights and reductions)
    recompute: str = "none"  # none | selective | full
    compile: bool = False
    eval_every: int = 0  # 0 = no evaluation
    eval_batches: int = 4
    max_bad_steps: int = 3  # steps in a row with a non-finite loss/grad norm (skipped) before stopping


@dataclass
class DataConfig:
    source: str = "builtin"  # builtin | a prepared folder (fivefold prepare) | a .txt/.jsonl/.parquet file or folder
    mix: str = ""  # weighted prepared folders, "DIR_A:0.7,DIR_B:0.3" (instead of source)
    text_field: str = "text"  # jsonl/parquet column holding the text
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizer.json
    val_fraction: float = 0.05
    builtin_max_bytes: int = 4_000_000


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty = <log.dir>/checkpoints
    every: int = 0  # 0 = never
    keep: int = 3
    resume: str = "none"  # none | auto | path
    async_save: bool = False  # rank 0 writes in a background thread while training continues


@dataclass
class DebugConfig:
    """Test-only fault injection (step 0 = off). Crashes and hangs fire only in a job's first attempt."""
    crash_at_step: int = 0  # rank `crash_rank` exits abruptly as step N begins
    crash_rank: int = 0
    hang_at_step: int = 0  # rank `crash_rank` stops answering as step N begins (collective timeout)
    nan_at_step: int = 0  # step N's gradient norm is treated as NaN (exercises the skip path)
    nan_steps: int = 1  # ... and this many steps from N on
    slow_save_step: int = 0  # rank 0 pauses half-way through writing this step's checkpoint...
    slow_save_s: float = 60.0  # ... for this long (a window in which to kill the job mid-save)


@dataclass
class LogConfig:
    dir: str = ""  # run directory for metrics.jsonl (and TensorBoard); empty = none
    every: int = 10  # console line every N steps
    # Steps whose communication the ledger measures (`comm_bytes` in metrics.jsonl): the first, the
    # last and every N-th; 0 = every log.every-th. Measuring costs a dispatch hook per operator.
    comm_every: int = 0
    tensorboard: bool = False
    progress: bool = True
    # MoE: warn (once per expert) when an expert has received no tokens for this many steps in a
    # row, a sign of router collapse; 0 = off.
    dead_expert_steps: int = 100


@dataclass
class ClusterConfig:
    """The planner's cluster; the trainer reads only `peak_tflops` (for MFU, where set)."""
    gpus: int = 0
    gpu: str = "h100"
    gpus_per_node: int = 8
    # Overrides of the GPU profile's figures; 0 = the profile's own.
    peak_tflops: float = 0.0
    memory_gb: float = 0.0
    intra_gbps: float = 0.0  # NVLink-class bandwidth inside a node, GB/s
    inter_gbps: float = 0.0  # network bandwidth between nodes per GPU, GB/s


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Building a Config from nested dicts, with type checks and did-you-mean


def _hints(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class CliText(str):
    """A value typed on the command line: text to be parsed as the key's type (a TOML value
    must already have the right type)."""


def _coerce(key: str, value, typ):
    """Check `value` (from TOML, or text from the command line) against `typ`."""
    if isinstance(value, CliText) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                low = text.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return low in ("true", "1", "yes", "on")
            return typ(text)
        except ValueError:
            raise ConfigError(f"{key} must be {_type_name(typ)}, got '{value}'") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {_type_name(typ)}, got {value!r}")
    return value


def _type_name(typ) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[typ]


def _build(cls, raw: dict, prefix: str):
    hints = _hints(cls)
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}"
        if key not in hints:
            raise ConfigError(f"unknown key {dotted}{_suggest(key, hints)}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted} must be a section of keys, got {value!r}")
            kwargs[key] = _build(typ, value, dotted)
        else:
            kwargs[key] = _coerce(dotted, value, typ)
    return cls(**kwargs)


def _model_from_folder(raw_model: dict) -> dict:
    """model.init_from: every model key from the folder's config.json. A key also given explicitly
    must agree with it (another value would describe another model than the weights)."""
    from fivefold.models.hf_stream import read_hf_config  # here: models/ builds on this module

    folder = Path(raw_model["init_from"])
    try:
        resolved = dataclasses.asdict(read_hf_config(folder))
    except ConfigError as err:
        raise ConfigError(f"model.init_from='{folder}' needs a Hugging Face folder: {err}") from None
    for key, value in raw_model.items():
        if key in ("init_from", "preset") or key not in resolved:  # unknown keys: refused by _build
            continue
        given = value.items() if key == "moe" and isinstance(value, dict) else [(None, value)]
        for sub, v in given:
            have = resolved[key].get(sub) if sub else resolved[key]
            name = f"model.{key}.{sub}" if sub else f"model.{key}"
            if have is not None and _coerce(name, v, type(have)) != have:
                raise ConfigError(f"{name}={v} differs from {folder / 'config.json'} ({have}); drop it: "
                                  "model.init_from takes the model's shape from the folder")
    return {**resolved, "init_from": str(folder), "preset": raw_model.get("preset", ModelConfig.preset)}


def _resolve_model(raw_model: dict) -> dict:
    """Preset values first, explicit keys on top (the [model.moe] table merged key by key); or,
    with model.init_from, the folder's config.json."""
    if raw_model.get("init_from"):
        return _model_from_folder(raw_model)
    preset = raw_model.get("preset", ModelConfig.preset)
    if preset not in PRESETS:
        raise ConfigError(f"model.preset '{preset}' is unknown{_suggest(preset, PRESETS)}; "
                          f"choose one of {', '.join(PRESETS)}")
    merged = {k: v for k, v in PRESETS[preset].items() if k != "moe"}
    merged.update({k: v for k, v in raw_model.items() if k != "moe"})
    moe = dict(PRESETS[preset].get("moe", {}))
    explicit_moe = raw_model.get("moe", {})
    if not isinstance(explicit_moe, dict):
        raise ConfigError(f"model.moe must be a section of keys, got {explicit_moe!r}")
    moe.update(explicit_moe)
    merged["moe"] = moe
    merged["preset"] = preset
    return merged


def config_from_dict(raw: dict) -> Config:
    raw = dict(raw)
    sections = _hints(Config)
    for name in raw:
        if name not in sections:
            raise ConfigError(f"unknown section [{name}]{_suggest(name, sections)}")
        if not isinstance(raw[name], dict):
            raise ConfigError(f"[{name}] must be a section of keys, got {raw[name]!r}")
    raw["model"] = _resolve_model(raw.get("model", {}))
    return Config(**{name: _build(sections[name], raw.get(name, {}), name) for name in sections})


def parse_overrides(args: list[str]) -> dict:
    """`--section.key value` (or `--section.key=value`) pairs -> nested dict of strings."""
    nested: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"expected an override like --parallel.tp 2, got '{arg}'")
        if "=" in arg:
            dotted, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value, e.g. {arg} 2")
            dotted, value = arg[2:], args[i + 1]
            i += 2
        *path, key = dotted.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{dotted} conflicts with another override")
        node[key] = CliText(value)
    return nested


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    """TOML file (optional) plus command-line overrides -> a resolved Config (not yet validated)."""
    raw: dict = {}
    if path is not None:
        path = shipped_configs.resolve(path)  # or a shipped config by name: `tiny`, `demo`
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass a TOML file or the name of a "
                              f"shipped config: {', '.join(shipped_configs.names())}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        raw = _deep_merge(raw, extra)
    return config_from_dict(raw)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (what `fivefold config show` prints)."""
    lines: list[str] = []

    def emit(section: str, obj) -> None:
        lines.append(f"[{section}]")
        nested = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((f"{section}.{f.name}", value))
            elif isinstance(value, bool):
                lines.append(f"{f.name} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                lines.append(f"{f.name} = {json.dumps(value, ensure_ascii=False)}")  # TOML-escaped
            else:
                lines.append(f"{f.name} = {value!r}")
        lines.append("")
        for name, sub in nested:
            emit(name, sub)

    for f in dataclasses.fields(cfg):
        emit(f.name, getattr(cfg, f.name))
    return "\n".join(lines)


def micro_batches(cfg: Config) -> int:
    """Micro-batches per step on each data-parallel rank: global_batch / (dp · micro_batch), where
    micro_batch = 0 means the rank's whole share at once (DESIGN.md batch arithmetic)."""
    per_rank = cfg.train.global_batch // cfg.parallel.dp
    return per_rank // (cfg.train.micro_batch or per_rank)


from fivefold.validate import validate  # noqa: E402  (re-exported: config.validate is the contract)

__all__ = ["Config", "ConfigError", "load_config", "parse_overrides", "to_toml", "validate"]
