"""A family's Hugging Face adapter: how its weights are named and laid out in transformers' files,
and how its config.json reads and writes.

Names are translated by tables of templates, so a family is rows, not code: `names` maps one
Hugging Face tensor to one of ours (`{layer}` stands for a layer index); `experts` maps the
per-expert tensors of a Hugging Face MoE layer (`{expert}` for the expert index) to one stacked
(experts, out, in) tensor of ours; `parts` maps a Hugging Face tensor to several of ours, each a
strided `Part` of it, possibly transposed (gpt-oss stores its experts stacked (experts, in, out),
gate and up interleaved in one tensor). The file reader and writer (models/hf/stream.py) and
`fivefold convert` use only these methods.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from fivefold.config import ModelConfig

# Tensors of ours with no Hugging Face counterpart: bias balancing's state (zeros in a fresh model).
# A family whose Hugging Face class holds that state too (DeepSeek-V3's e_score_correction_bias)
# maps it in its names and sets its adapter's `ours_only` to NOTHING.
OURS_ONLY = re.compile(r".*\.router\.expert_bias$")
NOTHING = re.compile(r"(?!)")

# Tensors some checkpoints carry that are derived, not learned (older transformers saved these).
IGNORED_HF = re.compile(r".*\.rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Part:
    """One of our tensors as a part of a Hugging Face tensor: the elements start, start + step, ...
    along the Hugging Face tensor's dimension `dim`, its last two dimensions swapped when
    `transposed`. The parts of one Hugging Face tensor fill it exactly."""
    dim: int = -1
    start: int = 0
    step: int = 1
    transposed: bool = False

    def hf_shape(self, shape: tuple) -> tuple:
        """The whole Hugging Face tensor's shape, from the whole shape of ours."""
        out = list(shape)
        if self.transposed:
            out[-2], out[-1] = out[-1], out[-2]
        out[self.dim] *= self.step
        return tuple(out)

    def read(self, hf_slice, offsets, sizes):
        """Our box (offsets, sizes) from a safetensors slice of the Hugging Face tensor (contiguous
        ranges are read, the stride taken after)."""
        box = [slice(o, o + s) for o, s in zip(offsets, sizes)]
        if self.transposed:
            box[-2], box[-1] = box[-1], box[-2]
        d = self.dim % len(box)
        first, count = box[d].start, box[d].stop - box[d].start
        box[d] = slice(self.start + self.step * first, self.start + self.step * (first + count - 1) + 1)
        strided = [slice(None)] * len(box)
        strided[d] = slice(None, None, self.step)
        view = hf_slice[tuple(box)][tuple(strided)]
        return view.transpose(-2, -1) if self.transposed else view

    def write(self, hf_tensor, ours) -> None:
        """Place the whole tensor of ours into the whole Hugging Face tensor."""
        strided = [slice(None)] * hf_tensor.dim()
        strided[self.dim] = slice(self.start, None, self.step)
        hf_tensor[tuple(strided)].copy_(ours.transpose(-2, -1) if self.transposed else ours)


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    return re.compile(escaped.replace(re.escape("{expert}"), r"(?P<expert>\d+)") + "$")


def _translate(name: str, table) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.format(**match.groupdict())
    return None


@dataclass(frozen=True)
class HFAdapter:
    model_type: str  # config.json's model_type this family reads and writes
    names: list[tuple[str, str]]  # (Hugging Face template, our template)
    # config.json (a dict) -> ModelConfig; raises ConfigError("config.json ...") for what we cannot express
    read_config: Callable[[dict], ModelConfig]
    # (ModelConfig, torch dtype of the weights) -> config.json; raises ConfigError for what HF cannot express
    write_config: Callable
    experts: list[tuple[str, str]] = field(default_factory=list)  # (per-expert HF template, our stacked name)
    parts: list[tuple[str, str, Part]] = field(default_factory=list)  # (HF template, our template, which part)
    ours_only: re.Pattern = OURS_ONLY  # our tensors that are neither read nor written (zeros when read)
    # (HF tensor name, our config) -> whether a file's tensor is one transformers' class drops on
    # load too (DeepSeek-V3's multi-token-prediction layers past the last layer), never an error.
    dropped_by_hf: Callable[[str, ModelConfig], bool] = field(default=lambda name, cfg: False)
    # our config -> {Hugging Face name: our name} of tensors the family's files repeat (DeepSeek's
    # multi-token-prediction layers hold copies of the embedding and output matrices): written as
    # copies, accepted and not read on load.
    hf_copies: Callable[[ModelConfig], dict[str, str]] = field(default=lambda cfg: {})
    # (config read from config.json, names of the tensors in the files) -> the config those files hold
    fit_to_files: Callable[[ModelConfig, set], ModelConfig] = field(default=lambda cfg, names: cfg)

    def __post_init__(self):
        object.__setattr__(self, "_to_ours", [(_pattern(hf), ours) for hf, ours in self.names])
        object.__setattr__(self, "_to_hf", [(_pattern(ours), hf) for hf, ours in self.names])
        object.__setattr__(self, "_stacked_to_hf", [(_pattern(ours), hf) for hf, ours in self.experts])
        object.__setattr__(self, "_part_to_hf", [(_pattern(ours), hf, part) for hf, ours, part in self.parts])
        object.__setattr__(self, "_hf_to_parts", [(_pattern(hf), ours, part) for hf, ours, part in self.parts])

    def is_stacked(self, our_name: str) -> bool:
        """Whether our tensor stacks one Hugging Face tensor per expert along dim 0."""
        return any(pattern.match(our_name) for pattern, _ in self._stacked_to_hf)

    def part_of(self, our_name: str) -> tuple[str, Part] | None:
        """(the Hugging Face tensor, which part of it) when our tensor is a part of one, else None."""
        for pattern, hf, part in self._part_to_hf:
            match = pattern.match(our_name)
            if match:
                return hf.format(**match.groupdict()), part
        return None

    def parts_of(self, hf_name: str) -> list[tuple[str, Part]]:
        """Our tensors that make up a Hugging Face tensor, with their parts ([] when it is not split)."""
        out = []
        for pattern, ours, part in self._hf_to_parts:
            match = pattern.match(hf_name)
            if match:
                out.append((ours.format(**match.groupdict()), part))
        return out

    def hf_name(self, our_name: str) -> str:
        part = self.part_of(our_name)
        if part is not None:
            return part[0]
        hf = _translate(our_name, self._to_hf)
        if hf is None:
            raise KeyError(f"no Hugging Face name for parameter {our_name} in the {self.model_type} adapter; "
                           "add a row to its names")
        return hf

    def maybe_hf_name(self, our_name: str) -> str | None:
        """`hf_name`, or None for a tensor of ours with no Hugging Face name (a tied copy may have none)."""
        part = self.part_of(our_name)
        return part[0] if part is not None else _translate(our_name, self._to_hf)

    def our_name(self, hf_name: str) -> str | None:
        """Our parameter name for a Hugging Face tensor name, or None when the table has no row (a
        tensor split into parts has several: `parts_of`)."""
        return _translate(hf_name, self._to_ours)

    def hf_sources(self, our_name: str, n_experts: int) -> list[str]:
        """The Hugging Face tensors that make up one of ours: one name, or one per expert when stacked."""
        for pattern, hf in self._stacked_to_hf:
            match = pattern.match(our_name)
            if match:
                return [hf.format(expert=e, **match.groupdict()) for e in range(n_experts)]
        return [self.hf_name(our_name)]
