"""The [lora] section: which linear layers get adapters (`lora.targets`) and what a LoRA run refuses
before any process group exists, one sentence each.

`lora.targets` is either parameter kinds joined by '|' (models/param_kinds.py says which weight has
which kind; only the kinds whose weights are linear maps inside the blocks can be adapted), or
`re:PATTERN`, a regular expression searched in the single-device weight name
(`layers.0.attention.wq.weight`), as a train.param_groups selector is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fivefold.config.errors import ConfigError
from fivefold.config.validate_optimizer import runs_muon

# The kinds whose weights are linear maps an adapter can sit beside (a router is left alone: its
# scores choose experts, and adapting them would move tokens between experts, not adapt them).
TARGET_KINDS = ("attention", "mlp", "experts")


@dataclass(frozen=True)
class Targets:
    kinds: tuple[str, ...]  # empty when `pattern` selects
    pattern: str

    def selects(self, name: str, kind: str) -> bool:
        """Whether the weight `name` (single-device) of `kind` gets an adapter."""
        if kind not in TARGET_KINDS:
            return False
        return kind in self.kinds if self.kinds else re.search(self.pattern, name) is not None


def _refuse(text: str, problem: str):
    raise ConfigError(f"lora.targets='{text}': {problem}; write kinds among {', '.join(TARGET_KINDS)} joined "
                      "by '|' (e.g. 'attention|mlp'), or re:PATTERN on the weight names (e.g. "
                      "'re:attention\\.w[qv]')")


def parse_targets(text: str) -> Targets:
    text = text.strip()
    if text.startswith("re:"):
        pattern = text[3:]
        if not pattern:
            _refuse(text, "re: has no pattern after it")
        try:
            re.compile(pattern)
        except re.error as err:
            _refuse(text, f"'{pattern}' is not a regular expression ({err})")
        return Targets((), pattern)
    kinds = tuple(k.strip() for k in text.split("|"))
    unknown = [k for k in kinds if k not in TARGET_KINDS]
    if unknown:
        _refuse(text, f"'{unknown[0]}' is not a kind of layer an adapter can sit beside")
    return Targets(kinds, "")


def check_lora(cfg) -> None:
    """The rules tying [lora] to the other sections (its keys' own ranges are declared in schema.py;
    a pattern that selects no linear layer needs the model: fivefold/configure/model_rules.py)."""
    lora, t = cfg.lora, cfg.train
    if lora.rank == 0:
        return
    parse_targets(lora.targets)
    if runs_muon(t.optimizer, t.param_groups):
        raise ConfigError(f"lora.rank={lora.rank} trains its adapters with AdamW only, but train.optimizer or "
                          "train.param_groups names muon; set train.optimizer = adamw and drop optimizer=muon "
                          "from train.param_groups, or set lora.rank = 0")
    if cfg.parallel.ep_replicas:
        raise ConfigError(f"lora.rank={lora.rank} does not run with parallel.ep_replicas={cfg.parallel.ep_replicas} "
                          "yet (the replica slots would train frozen expert copies); set parallel.ep_replicas = 0")
    if t.fp8:
        raise ConfigError(f"lora.rank={lora.rank} does not run with train.fp8='{t.fp8}' yet (the FP8 "
                          "projections would drop the adapters beside them); set train.fp8 = \"\" or lora.rank = 0")
