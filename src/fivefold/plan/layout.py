"""A layout: one choice of the five parallel degrees plus the knobs that change memory and speed.

Written on the command line as "dp=8,zero=1,tp=2,pp=4,cp=1,ep=1,mbs=1,recompute=selective,
pp_schedule=1f1b", or as a JSON object with the same keys (one per line of --layouts FILE.jsonl).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from fivefold.config import Config, ConfigError
from fivefold.plan.cached_hash import HASH_ATTRIBUTE

RECOMPUTE = ("none", "selective", "full")


from fivefold.config.schedules import SPLIT_BACKWARD_SCHEDULES  # noqa: E402,F401 - the planner's name for it


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    mbs: int = 1  # sequences per micro-batch per data-parallel rank; 0 = the whole per-rank batch
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    dp_shard: int = 0  # HSDP shard group; 0 = all of dp
    sp: bool = True
    cp_method: str = "ring"
    pp_layers: str = ""  # layers per pipeline chunk, e.g. "7,9,9,7"; empty = balance by FLOPs

    @property
    def split_backward(self) -> bool:
        """A zero-bubble schedule: backward split into an input pass and a later weight pass."""
        return self.pp > 1 and self.pp_schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_degree(self) -> int:
        """Ranks a ZeRO-sharded dense tensor is split over (dp_shard x cp, as FSDP over dp_shard_cp)."""
        return (self.dp_shard or self.dp) * self.cp

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    def resolved(self, global_batch: int) -> "Layout":
        """mbs=0 (train.micro_batch's default) means one micro-batch of the per-rank batch."""
        if self.mbs:
            return self
        return dataclasses.replace(self, mbs=max(1, global_batch // self.dp))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def short(self) -> str:
        """Compact form for tables: only what differs from 1 / the default, always dp, tp, pp."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"z{self.zero}")
        if self.dp_shard and self.dp_shard != self.dp:
            parts.append(f"hsdp{self.dp_shard}")
        parts.append(f"mbs{self.mbs}")
        if self.pp > 1:
            sched = self.pp_schedule + (f"/v{self.pp_virtual}" if self.pp_virtual > 1 else "")
            parts.append(sched)
        parts.append({"none": "no-ac", "selective": "sel-ac", "full": "full-ac"}[self.recompute])
        return " ".join(parts)


_FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))


def replaced(layout: Layout, **changes) -> Layout:
    """dataclasses.replace for a Layout, without its __init__: a copy of the fields with `changes`
    (the search builds ~2 x 10^4 layouts; replace's generic path cost 8 us each). Same value."""
    unknown = changes.keys() - _FIELDS
    if unknown:
        raise TypeError(f"Layout has no field {sorted(unknown)[0]}")
    new = object.__new__(Layout)
    new.__dict__.update(layout.__dict__)
    new.__dict__.update(changes)
    new.__dict__.pop(HASH_ATTRIBUTE, None)  # were Layout to cache its hash (plan/cached_hash.py), not the old one
    return new


_KINDS = {"dp": int, "zero": int, "tp": int, "pp": int, "cp": int, "ep": int, "mbs": int,
          "pp_virtual": int, "dp_shard": int, "sp": bool, "recompute": str, "pp_schedule": str,
          "cp_method": str, "pp_layers": str}
_ALIASES = {"micro_batch": "mbs", "schedule": "pp_schedule", "virtual": "pp_virtual"}


def _value(key: str, raw, kind):
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"layout key {key} must be true or false, got '{raw}'")
    if kind is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ConfigError(f"layout key {key} must be an integer, got '{raw}'")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"layout key {key} must be an integer, got '{raw}'") from None
    return str(raw).strip()


def layout_from_mapping(items: dict, base: Layout | None = None) -> Layout:
    """Keys of a --layout string or a JSON line -> Layout (unknown keys are an error)."""
    values = {}
    for key, raw in items.items():
        name = _ALIASES.get(key, key)
        if name not in _KINDS:
            raise ConfigError(f"unknown layout key '{key}'; use {', '.join(_KINDS)}")
        values[name] = _value(name, raw, _KINDS[name])
    layout = dataclasses.replace(base or Layout(), **values)
    if layout.recompute not in RECOMPUTE:
        raise ConfigError(f"layout recompute='{layout.recompute}' is not one of {', '.join(RECOMPUTE)}")
    for key in ("dp", "tp", "pp", "cp", "ep", "pp_virtual"):
        if getattr(layout, key) < 1:
            raise ConfigError(f"layout {key} must be >= 1, got {getattr(layout, key)}")
    if layout.mbs < 0:
        raise ConfigError(f"layout mbs must be >= 1 (or 0 for the whole per-rank batch), got {layout.mbs}")
    return layout


def parse_layout(text: str, base: Layout | None = None) -> Layout:
    """'dp=8,tp=2,...' -> Layout."""
    items: dict[str, str] = {}
    last = None
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            if last == "pp_layers" and part.isdigit():  # pp_layers=7,9,9,7 keeps its commas
                items[last] += "," + part
                continue
            raise ConfigError(f"--layout part '{part}' must look like key=value, e.g. tp=2")
        key, value = part.split("=", 1)
        last = key.strip()
        items[last] = value.strip()
    return layout_from_mapping(items, base)


def parse_layout_line(line: str, number: int, base: Layout | None = None) -> Layout:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"line {number} of --layouts is not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"line {number} of --layouts must be a JSON object like {{\"dp\": 8, \"tp\": 2}}")
    try:
        return layout_from_mapping(obj, base)
    except ConfigError as err:
        raise ConfigError(f"line {number} of --layouts: {err}") from None


def layout_from_config(cfg: Config) -> Layout:
    """The layout a config already describes (the base that --layout keys override)."""
    p, t = cfg.parallel, cfg.train
    dp = p.dp or 1  # dp = 0 (the world size decides): planned as one replica until a launch resolves it
    mbs = t.micro_batch or t.global_batch // dp  # 0: each rank's whole share at once
    return Layout(dp=dp, zero=p.zero, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, mbs=mbs,
                  recompute=t.recompute, pp_schedule=p.pp_schedule, pp_virtual=p.pp_virtual,
                  dp_shard=p.dp_shard, sp=p.sp, cp_method=p.cp_method, pp_layers=p.pp_layers)


def config_with_layout(cfg: Config, layout: Layout) -> Config:
    """A copy of cfg whose [parallel] and train.micro_batch/recompute say what the layout says,
    so that fivefold.configure.validate can check the layout with the training code's own rules."""
    parallel = dataclasses.replace(
        cfg.parallel, dp=layout.dp, zero=layout.zero, tp=layout.tp, pp=layout.pp, cp=layout.cp,
        ep=layout.ep, pp_schedule=layout.pp_schedule, pp_virtual=layout.pp_virtual,
        dp_shard=layout.dp_shard, sp=layout.sp, cp_method=layout.cp_method,
        pp_layers=layout.pp_layers)
    train = dataclasses.replace(cfg.train, micro_batch=layout.mbs, recompute=layout.recompute)
    return dataclasses.replace(cfg, parallel=parallel, train=train)
