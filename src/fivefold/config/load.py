"""Building a Config: TOML files, `--section.key value` overrides, presets and model.init_from,
with a type check and a did-you-mean for every key; and the resolved config back as TOML.

A config is resolved in this order: dataclass defaults < model preset < TOML file < command line.
The dataclasses and their accepted values live in config/schema.py. model.init_from needs the
families' readers of config.json, which live above this layer: fivefold.configure.load_config passes
them in (config/ imports nothing of fivefold outside itself).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from pathlib import Path
from typing import Callable

from fivefold.config import shipped as shipped_configs
from fivefold.config.errors import ConfigError
from fivefold.config.schema import Config, ModelConfig
from fivefold.config.presets import PRESETS


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
            kwargs[key] = _coerce(dotted, _boolean_choice(cls, key, value), typ)
    return cls(**kwargs)


def _boolean_choice(cls, key: str, value):
    """A TOML or Python boolean given to a text key whose choices include "true" and "false"
    (train.compile: false | true | auto) is that choice."""
    if not isinstance(value, bool):
        return value
    check = next(f for f in dataclasses.fields(cls) if f.name == key).metadata.get("check")
    choices = getattr(check, "choices", None) or ()
    return ("true" if value else "false") if {"true", "false"} <= set(choices) else value


# A Hugging Face folder -> the ModelConfig of its config.json (only the families' adapters, in
# models/, know their keys; fivefold.configure passes their reader in).
FolderReader = Callable[[Path], ModelConfig]


def _model_from_folder(raw_model: dict, read_folder: FolderReader | None) -> dict:
    """model.init_from: every model key from the folder's config.json. A key also given explicitly
    must agree with it (another value would describe another model than the weights)."""
    folder = Path(raw_model["init_from"])
    if read_folder is None:
        raise ConfigError(f"model.init_from='{folder}' is read by fivefold.configure.load_config, which knows "
                          "the families' config.json keys; load the config with that function")
    try:
        resolved = dataclasses.asdict(read_folder(folder))
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
    # Absolute: the checkpoints record it, and their outputs are read from any directory.
    return {**resolved, "init_from": str(folder.resolve()), "preset": raw_model.get("preset", ModelConfig.preset)}


def _resolve_model(raw_model: dict, read_folder: FolderReader | None) -> dict:
    """Preset values first, explicit keys on top (the [model.moe] table merged key by key); or,
    with model.init_from, the folder's config.json."""
    if raw_model.get("init_from"):
        return _model_from_folder(raw_model, read_folder)
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


def config_from_dict(raw: dict, read_folder: FolderReader | None = None) -> Config:
    raw = dict(raw)
    sections = _hints(Config)
    for name in raw:
        if name not in sections:
            raise ConfigError(f"unknown section [{name}]{_suggest(name, sections)}")
        if not isinstance(raw[name], dict):
            raise ConfigError(f"[{name}] must be a section of keys, got {raw[name]!r}")
    raw["model"] = _resolve_model(raw.get("model", {}), read_folder)
    raw["data"] = _tokenizer_of_the_model(raw.get("data", {}), raw["model"])
    return Config(**{name: _build(sections[name], raw.get(name, {}), name) for name in sections})


def _tokenizer_of_the_model(raw_data: dict, model: dict) -> dict:
    """data.tokenizer left unset under model.init_from: the folder's own tokenizer.json, so that a
    model trained on its ids is not fed bytes. A folder without one, whose vocabulary is more than
    bytes, on text the run tokenizes itself: refused, since bytes would be a silent downgrade."""
    folder = model.get("init_from")
    if not folder or "tokenizer" in raw_data:
        return raw_data
    own = Path(folder) / "tokenizer.json"
    if own.is_file():
        return {**raw_data, "tokenizer": str(own)}
    source = str(raw_data.get("source", "builtin"))
    prepared = raw_data.get("mix") or (Path(source) / "manifest.json").is_file()  # their manifest names it
    vocab = model.get("vocab_size", 256)
    if not prepared and source != "builtin" and isinstance(vocab, int) and vocab > 256:
        raise ConfigError(f"model.init_from='{folder}' has no tokenizer.json and a vocabulary of {vocab}, so the "
                          f"text in data.source would be tokenized as bytes; set data.tokenizer to the model's "
                          f"tokenizer.json (or to 'byte' to train it on bytes anyway)")
    return raw_data


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


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                read_folder: FolderReader | None = None) -> Config:
    """TOML file (optional) plus command-line overrides -> a resolved Config (not yet validated).
    `read_folder` resolves model.init_from (fivefold.configure.load_config passes the families')."""
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
    return config_from_dict(raw, read_folder)


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
