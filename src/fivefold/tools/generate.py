"""`fivefold generate CHECKPOINT --prompt TEXT`: a sample from a trained checkpoint, so a user sees
what the run learned.

The single-device model comes from the checkpoint (any saving layout, convert.checkpoint_to_model);
the tokenizer is the run's `data.tokenizer` (from the checkpoint's config.toml; byte when it names
none) unless --tokenizer is given. No KV cache: each new token runs the model over the last
`model.max_seq_len` tokens, which is plenty for a sample of a few hundred tokens from a small model.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import torch

from fivefold.config import ConfigError, DataConfig
from fivefold.tools.convert import checkpoint_folder, checkpoint_to_model
from fivefold.train.data import build_tokenizer


def run_tokenizer(folder: Path) -> str:
    """The tokenizer the run trained with: its config.toml's data.tokenizer (byte when absent)."""
    try:
        saved = tomllib.loads((folder / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return "byte"  # config.toml is for people, not required: byte is the default tokenizer
    return saved.get("data", {}).get("tokenizer", "byte")


def _tokenizer(name: str, what: str):
    """`what` says where the name came from: --tokenizer, or the run's data.tokenizer."""
    if name != "byte" and not Path(name).is_file():
        raise ConfigError(f"{what} '{name}' is not a file; pass --tokenizer byte or --tokenizer "
                          "PATH/tokenizer.json")
    try:
        return build_tokenizer(DataConfig(tokenizer=name))
    except Exception as err:  # tokenizers raises its own exception types for a bad file
        reason = " ".join(str(err).split())  # one line, whatever the library's message looks like
        raise ConfigError(f"{what} '{name}' could not be read as a tokenizer ({reason}); pass --tokenizer "
                          "byte or a Hugging Face tokenizer.json") from None


def generate(checkpoint, prompt: str, tokens: int = 200, temperature: float = 0.8, seed: int = 0,
             tokenizer: str = "") -> tuple[str, list[int]]:
    """(prompt + the sampled continuation, the new token ids). temperature 0 = greedy (argmax)."""
    if not prompt:
        raise ConfigError("--prompt is empty; give the text to continue, e.g. --prompt 'def main('")
    if tokens < 1:
        raise ConfigError(f"--tokens must be at least 1 (the number of new tokens), got {tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    folder = checkpoint_folder(checkpoint)
    name, what = (tokenizer, "--tokenizer") if tokenizer else (run_tokenizer(folder), "the run's data.tokenizer")
    tok = _tokenizer(name, what)
    model = checkpoint_to_model(folder).eval()
    vocab, window = model.cfg.vocab_size, model.cfg.max_seq_len
    if tok.vocab_size > vocab:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the checkpoint's model has "
                          f"{vocab}; pass the tokenizer the run trained with (--tokenizer)")
    ids = torch.as_tensor(tok.encode(prompt), dtype=torch.long)[None]
    if ids.numel() == 0:
        raise ConfigError(f"--prompt {prompt!r} encodes to no tokens; give some text to continue")
    generator = torch.Generator().manual_seed(seed)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            # Only the tokenizer's ids: a model's vocabulary may be padded beyond them.
            logits = model(ids[:, -window:])[0, -1, :tok.vocab_size].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return prompt + _continuation(tok, ids[0].tolist(), len(new)), new


def _continuation(tok, ids: list[int], n_new: int) -> str:
    """The text the new tokens add, decoded with the prompt in front (a BPE token's leading space
    or a byte sequence can depend on what comes before it)."""
    head = tok.decode(ids[:-n_new])
    whole = tok.decode(ids)
    return whole[len(head):] if whole.startswith(head) else tok.decode(ids[-n_new:])
