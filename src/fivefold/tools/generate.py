"""`fivefold generate CHECKPOINT --prompt TEXT [--chat]`: a sample from a trained checkpoint or an
exported Hugging Face folder, so a user sees what the run learned.

The single-device model comes from the checkpoint (any saving layout, convert.checkpoint_to_model;
a LoRA checkpoint: its base with the adapters), the folder (models.hf.load_pretrained) or a PEFT
adapter folder (its base with the adapters, models/hf/peft_names.py); the tokenizer is the run's `data.tokenizer` (from the
checkpoint's config.toml; byte when it names none), or the folder's tokenizer.json, unless
--tokenizer is given. `--chat` renders the prompt as a user message with the tokenizer's chat
template (data/chat_template.py, as `fivefold prepare --chat` renders the training data) and
prints the assistant's reply. No KV cache: each new token runs the model over the last
`model.max_seq_len` tokens, which is plenty for a sample of a few hundred tokens from a small model.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from fivefold.config import ConfigError
from fivefold.config.file_errors import need_folder
from fivefold.models.hf.peft_names import ADAPTER_CONFIG
from fivefold.tools.convert import checkpoint_folder, checkpoint_to_model
from fivefold.train.export import run_tokenizer
from fivefold.data.batches import ByteTokenizer, HFTokenizer


def _tokenizer(name: str, what: str):
    """`what` says where the name came from: --tokenizer, or the run's data.tokenizer."""
    if name != "byte" and not Path(name).is_file():
        raise ConfigError(f"{what} '{name}' is not a file; pass --tokenizer byte or --tokenizer "
                          "PATH/tokenizer.json")
    return ByteTokenizer() if name == "byte" else HFTokenizer(name, what)


def _source(path, tokenizer: str, base: str = ""):
    """(single-device model, tokenizer name, where the name came from) of a fivefold checkpoint or
    of a Hugging Face folder (an export: its own tokenizer.json beside the weights)."""
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():  # a PEFT adapter folder: its base with the adapters
        from fivefold.models.hf.peft_names import load_peft_folder

        own = path / "tokenizer.json"
        name, what = (tokenizer, "--tokenizer") if tokenizer else (str(own) if own.is_file() else "byte",
                                                                   f"the tokenizer of {path}")
        return load_peft_folder(path, base), name, what
    if (path / "config.json").is_file() and not (path / "state.json").is_file():
        from fivefold.models.hf.interop import load_pretrained

        if base:
            raise ConfigError(f"--base names the base of LoRA adapters, and {path} is a whole Hugging Face model; "
                              "drop --base")
        own = path / "tokenizer.json"
        name, what = (tokenizer, "--tokenizer") if tokenizer else (str(own) if own.is_file() else "byte",
                                                                   f"the tokenizer of {path}")
        return load_pretrained(path), name, what
    folder = checkpoint_folder(path)
    name, what = (tokenizer, "--tokenizer") if tokenizer else (run_tokenizer(folder), "the run's data.tokenizer")
    return checkpoint_to_model(folder, base), name, what


def generate(checkpoint, prompt: str, tokens: int = 200, temperature: float = 0.8, seed: int = 0,
             tokenizer: str = "", chat: bool = False, system: str = "", chat_template: str = "",
             base: str = "") -> tuple[str, list[int]]:
    """(prompt + the sampled continuation, the new token ids). temperature 0 = greedy (argmax).
    With `chat`, the prompt is a user message (after `system`, if given) rendered with the
    tokenizer's chat template and its generation prompt, and the text returned is the reply alone,
    ended by the template's end-of-turn token (the tokenizer's eos_token)."""
    need_folder(checkpoint, "generate CHECKPOINT", "give a step_N folder, a checkpoint root or a Hugging Face folder")
    if not prompt:
        raise ConfigError("--prompt is empty; give the text to continue, e.g. --prompt 'def main('")
    if tokens < 1:
        raise ConfigError(f"--tokens must be at least 1 (the number of new tokens), got {tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if (system or chat_template) and not chat:
        raise ConfigError("--system and --chat-template render a conversation; add --chat")
    model, name, what = _source(checkpoint, tokenizer, base)
    tok = _tokenizer(name, what)
    model = model.eval()
    vocab, window = model.cfg.vocab_size, model.cfg.max_seq_len
    if tok.vocab_size > vocab:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the checkpoint's model has "
                          f"{vocab}; pass the tokenizer the run trained with (--tokenizer)")
    stop = None
    if chat:
        ids, stop = chat_prompt(name, prompt, system, chat_template)
        ids = torch.as_tensor(ids, dtype=torch.long)[None]
    else:
        ids = torch.as_tensor(tok.encode(prompt), dtype=torch.long)[None]
    if ids.numel() == 0:
        raise ConfigError(f"--prompt {prompt!r} encodes to no tokens; give some text to continue")
    note = window_note(ids.shape[1], tokens, window)
    if note:
        print(note, file=sys.stderr, flush=True)
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
            if nxt == stop:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    if chat:
        return tok.decode(new), new
    return prompt + _continuation(tok, ids[0].tolist(), len(new)), new


def window_note(prompt_tokens: int, tokens: int, window: int) -> str | None:
    """What generation does when the text outgrows the model's window (model.max_seq_len): the
    model only ever reads its last `window` tokens, so the start of a long prompt is never seen."""
    if prompt_tokens > window:
        return (f"note: the prompt is {prompt_tokens} tokens but the model reads at most {window} "
                f"(model.max_seq_len); it continues from the prompt's last {window} tokens, and its first "
                f"{prompt_tokens - window} are not read")
    if prompt_tokens + tokens > window:
        return (f"note: the prompt ({prompt_tokens} tokens) and --tokens {tokens} pass the model's "
                f"{window}-token window (model.max_seq_len); past it, each new token is predicted from the "
                f"last {window} tokens only")
    return None


def chat_prompt(tokenizer: str, prompt: str, system: str = "", template_file: str = "") -> tuple[list[int], int | None]:
    """(token ids of a user message rendered up to the assistant's turn, the end-of-turn token id)."""
    if tokenizer == "byte":
        raise ConfigError("--chat needs a tokenizer with a chat template (a tokenizer.json with its "
                          "tokenizer_config.json); the byte tokenizer has none: pass --tokenizer PATH/tokenizer.json")
    from fivefold.data.chat_template import Renderer, load_template

    template = load_template(tokenizer, template_file)
    renderer = Renderer(tokenizer, template, ("assistant",))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = renderer.render(messages, "--prompt", generation_prompt=True)
    eos = template.special.get("eos_token")
    return renderer.backend.encode(text, add_special_tokens=False).ids, (
        renderer.backend.token_to_id(eos) if eos is not None else None)


def _continuation(tok, ids: list[int], n_new: int) -> str:
    """The text the new tokens add, decoded with the prompt in front (a BPE token's leading space
    or a byte sequence can depend on what comes before it)."""
    head = tok.decode(ids[:-n_new])
    whole = tok.decode(ids)
    return whole[len(head):] if whole.startswith(head) else tok.decode(ids[-n_new:])
