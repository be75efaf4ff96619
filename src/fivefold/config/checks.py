"""The values each config key accepts, declared once beside the key (`checked(default, gt=0)`).

A declaration covers what a key says about itself: a range, a set of choices, and for every float
key a finite value (a TOML `inf`/`nan` or `--train.lr inf` is refused by its type alone). Rules that
tie keys together (tp divides n_heads, top_k <= n_experts) stay in config/validate.py. `check_fields`
reads the declarations and raises a ConfigError whose one sentence names the key, the value and
the range; validate() calls it first, so a bad value is reported before a bad combination.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fivefold.config.errors import ConfigError


@dataclass(frozen=True)
class Check:
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple = ()
    note: str = ""  # what a special value means ("0 = off"): said in the sentence, so the fix is clear
    when: str = ""  # a key of the same section: the check applies only while that key is non-zero

    def problem(self, key: str, value, condition: str = "") -> str | None:
        """The sentence for a refused value, or None; `condition` says when the check applies."""
        note = (f" ({self.note})" if self.note else "") + (f" when {condition}" if condition else "")
        if self.choices:
            if value in self.choices:
                return None
            shown = f"'{value}'" if isinstance(value, str) else value
            return f"{key}={shown} is not one of {self._choices()}{note}"
        if self._inside(value):
            return None
        return f"{key} must be {self._range()}{note}, got {value}"

    def accepts(self) -> str:
        """What the key accepts, for `fivefold train --help`: "> 0", "in [0, 1)", "one of a, b"."""
        return f"one of {self._choices()}" if self.choices else self._range()

    def _choices(self) -> str:
        return ", ".join('""' if c == "" else str(c) for c in self.choices)  # an empty choice shown as ""

    def _inside(self, v) -> bool:
        return ((self.gt is None or v > self.gt) and (self.ge is None or v >= self.ge)
                and (self.lt is None or v < self.lt) and (self.le is None or v <= self.le))

    def _range(self) -> str:
        low = ("(", self.gt) if self.gt is not None else ("[", self.ge) if self.ge is not None else None
        high = (")", self.lt) if self.lt is not None else ("]", self.le) if self.le is not None else None
        if low and high:
            return f"in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
        if low:
            return f"{'>' if low[0] == '(' else '>='} {_num(low[1])}"
        return f"{'<' if high[0] == ')' else '<='} {_num(high[1])}"


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def checked(default, **check) -> dataclasses.Field:
    """A dataclass field with its accepted values: `lr: float = checked(3e-3, gt=0)`."""
    return dataclasses.field(default=default, metadata={"check": Check(**check)})


def check_fields(obj, section: str) -> None:
    """Every declared check of `obj` (a config section) and of its nested sections, in declaration
    order; the first refused value raises a ConfigError."""

    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{section}.{f.name}"
        if dataclasses.is_dataclass(value):
            check_fields(value, key)
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        check = f.metadata.get("check")
        if check is None or (check.when and not getattr(obj, check.when)):
            continue
        problem = check.problem(key, value, f"{section}.{check.when} is set" if check.when else "")
        if problem:
            raise ConfigError(problem)
