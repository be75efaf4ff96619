"""What the console says between the rank map and step 1: each start-up phase with its seconds, and
what the data is (which source, which tokenizer), so that a long silence has a name and a run on the
wrong tokenizer shows before its first step."""

from __future__ import annotations

import time
from pathlib import Path

from fivefold.config import Config
from fivefold.config.manifest import read_manifest


class StartupPhases:
    def __init__(self):
        self.phases: list[tuple[str, float]] = []
        self._since = time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        self.phases.append((what, now - self._since))
        self._since = now

    def describe(self) -> str:
        return "start-up: " + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in self.phases)


def model_phase(cfg: Config) -> str:
    return f"weights read from {cfg.model.init_from}" if cfg.model.init_from else "model built"


def describe_data(cfg: Config) -> str:
    """data: where the tokens come from and the tokenizer that made them."""
    d = cfg.data
    if d.mix:
        return f"data: the mix {d.mix} (prepared; tokenizer {_prepared_tokenizer(d.mix.split(',')[0].rsplit(':', 1)[0])})"
    if (Path(d.source) / "manifest.json").is_file():
        return f"data: {d.source} (prepared; tokenizer {_prepared_tokenizer(d.source)})"
    what = "the built-in corpus (Python's standard library)" if d.source == "builtin" else d.source
    tokenizer = "byte (256 ids)" if d.tokenizer == "byte" else d.tokenizer
    return f"data: {what}, tokenized by {tokenizer}"


def _prepared_tokenizer(folder: str) -> str:
    return read_manifest(folder)["tokenizer"]["name"]
