"""train.param_groups: optimizer settings per group of parameters, chosen by kind or by name.

The value is one line of groups separated by ';', each `SELECTOR: key=value, key=value`:
- SELECTOR: kinds joined by '|' (embedding, output, norm, bias, router, attention, mlp, experts,
  other; models/param_kinds.py says which parameter has which kind), or `re:PATTERN`, a regular
  expression searched in the single-device parameter name (e.g. `re:layers\\.0\\.`);
- keys: lr_scale (a factor on train.lr and its schedule), weight_decay (replaces
  train.weight_decay), optimizer (adamw | muon).
Every group that selects a parameter applies its keys in order, so a later group refines an earlier
one. Before any group: train.weight_decay, lr_scale 1, and the optimizer train.optimizer names
(for muon: Muon on the matrices inside the blocks, AdamW on everything else).
The default, as Megatron-LM, torchtitan and nanoGPT ship it: no weight decay on norms, biases and
embeddings (a tied output matrix is the embedding).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The parameter kinds a selector names (models/param_kinds.py says which parameter has which):
# declared here, with the key, so that checking a config needs no model code (and no torch).
KINDS = ("embedding", "output", "norm", "bias", "router", "attention", "mlp", "experts", "other")
DEFAULT = "norm|bias|embedding:weight_decay=0"
OPTIMIZERS = ("adamw", "muon")
_KEYS = ("lr_scale", "weight_decay", "optimizer")


@dataclass(frozen=True)
class GroupSettings:
    """What the optimizer does with one parameter (hashable: tensors with equal settings share a
    group, and ZeRO's buckets never mix two settings, parallel/data/zero.py)."""

    lr_scale: float = 1.0
    weight_decay: float = 0.0
    optimizer: str = "adamw"


@dataclass(frozen=True)
class Group:
    kinds: tuple[str, ...]  # empty when `pattern` selects
    pattern: str
    keys: tuple[tuple[str, object], ...]

    def selects(self, name: str, kind: str) -> bool:
        return kind in self.kinds if self.kinds else re.search(self.pattern, name) is not None


def refuse(text: str, problem: str):
    from fivefold.config.errors import ConfigError

    raise ConfigError(f"train.param_groups='{text}': {problem}; write groups as 'SELECTOR: key=value, ...' "
                      f"separated by ';' (e.g. '{DEFAULT}; output: lr_scale=0.5'), see docs/optimizers.md")


def parse(text: str) -> list[Group]:
    """The groups of a train.param_groups value; one sentence naming the fault if it is malformed."""
    groups = []
    for raw in (g.strip() for g in text.split(";")):
        if not raw:
            continue
        selector, colon, settings = raw.rpartition(":")
        selector = selector.strip()
        if not colon or not selector or selector == "re":
            refuse(text, f"group '{raw}' has no 'SELECTOR:' before its settings")
        kinds, pattern = (), ""
        if selector.startswith("re:"):
            pattern = selector[3:]
            try:
                re.compile(pattern)
            except re.error as err:
                refuse(text, f"'{pattern}' is not a regular expression ({err})")
        else:
            kinds = tuple(k.strip() for k in selector.split("|"))
            unknown = [k for k in kinds if k not in KINDS]
            if unknown:
                refuse(text, f"'{unknown[0]}' is not a parameter kind (kinds: {', '.join(KINDS)}; "
                             "or select by name with re:PATTERN)")
        keys = []
        for item in (s.strip() for s in settings.split(",")):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or key not in _KEYS:
                refuse(text, f"'{item}' is not one of {', '.join(k + '=...' for k in _KEYS)}")
            keys.append((key, _value(text, key, value)))
        groups.append(Group(kinds, pattern, tuple(keys)))
    return groups


def _value(text: str, key: str, value: str):
    if key == "optimizer":
        if value not in OPTIMIZERS:
            refuse(text, f"optimizer={value} is not one of {' | '.join(OPTIMIZERS)}")
        return value
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not (number > 0 if key == "lr_scale" else number >= 0):  # nan fails both
        refuse(text, f"{key}={value} must be a number {'> 0' if key == 'lr_scale' else '>= 0'}")
    return number
