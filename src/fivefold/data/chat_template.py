"""Chat templates for `fivefold prepare --chat`: which template, one conversation rendered, its loss mask.

Rendering goes through transformers, not a Jinja renderer of our own: a model's chat template is a
program written against transformers' renderer (its globals, `raise_exception`, the `generation`
tag, its handling of special tokens), and a conversation rendered any other way is one the model
never sees at inference.

The mask comes from prefix renderings, so it works for any template, tagged with
`{% generation %}` or not: the trained characters of turn i are those the full rendering adds after
render(messages[:i], add_generation_prompt=True), up to render(messages[:i+1]) - the reply and its
end-of-turn marker, exactly what the model must produce once the generation prompt is given. The
full rendering is tokenized once, with character offsets, so the ids are those
`apply_chat_template(tokenize=True)` gives, and a token is trained when its first character is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fivefold.config import ConfigError
from fivefold.config.file_errors import guarded
from fivefold.config.tokenizer_file import read_tokenizer

ROLES = ("system", "user", "assistant", "tool")
CONFIG = "tokenizer_config.json"
JINJA = "chat_template.jinja"  # where recent transformers versions save a folder's template
# The special tokens a template may name ({{ bos_token }} ...): handed to the renderer as strings, so
# the tokenizer itself is never changed (transformers would add a missing one to the vocabulary).
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
MISSING = "fivefold prepare --chat needs transformers for chat templates: pip install 'fivefold[chat]'"
# What a tokenizer folder holds beside tokenizer.json that serving needs (the chat template above all).
TOKENIZER_FILES = ("tokenizer.json", CONFIG, "special_tokens_map.json", JINJA)


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise ConfigError(MISSING) from None
    return transformers


@dataclass(frozen=True)
class Template:
    """A chat template and what rendering it needs beside the conversation."""

    text: str
    name: str  # the template file's name, or tokenizer_config.json
    where: str  # its path, for error messages
    special: dict = field(default_factory=dict)  # special token strings from tokenizer_config.json
    pad_id: int = 0

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def copy_tokenizer(tokenizer: Path, dst: Path) -> None:
    """tokenizer.json (under its usual name, whatever it was called) and its folder's companions:
    into a prepared folder's `tokenizer/` (so a run knows its template) and into an export."""
    dst.mkdir(parents=True, exist_ok=True)
    for name, source in ((TOKENIZER_FILES[0], tokenizer), *((n, tokenizer.parent / n) for n in TOKENIZER_FILES[1:])):
        if source.is_file():
            tmp = dst / f".{name}.tmp"
            tmp.write_bytes(source.read_bytes())
            tmp.replace(dst / name)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(value, path: Path) -> str | None:
    """`chat_template` is a string, or a list of named templates of which `default` is the chat one."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ConfigError(f"{path} has a chat_template that is neither text nor a list holding a 'default' "
                      "template; give --chat-template FILE")


def load_template(tokenizer: str, template_file: str = "") -> Template:
    """The template (--chat-template wins over the tokenizer's own) and the special tokens beside it."""
    tok_path = Path(tokenizer)
    config_path = tok_path.parent / CONFIG
    config = {}
    if config_path.is_file():
        try:
            with guarded(config_path, "read", "or remove it"):
                text = config_path.read_text()
            config = json.loads(text)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(f"{config_path} is not valid JSON ({err}); fix it or remove it") from None
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ConfigError(f"--chat-template '{template_file}' is not a file; give a Jinja chat template")
        with guarded(path, "read", "or give another --chat-template"):
            text, name, where = path.read_text(), path.name, str(path)
    else:
        text, name, where = _config_template(config.get("chat_template"), config_path), CONFIG, str(config_path)
        if text is None and (tok_path.parent / JINJA).is_file():
            text, name, where = (tok_path.parent / JINJA).read_text(), JINJA, str(tok_path.parent / JINJA)
        if text is None:
            raise ConfigError(f"{tokenizer} has no chat_template ({CONFIG} beside it); give --chat-template FILE")
    special = {key: t for key in SPECIAL if (t := _token_text(config.get(key))) is not None}
    return Template(text, name, where, special, _pad_id(tokenizer, special.get("pad_token")))


def _pad_id(tokenizer: str, pad_token: str | None) -> int:
    """The tokenizer's pad token id: the config's pad token, else the tokenizer.json padding, else 0."""
    tok = read_tokenizer(tokenizer, "tokenizer")
    if pad_token is not None and tok.token_to_id(pad_token) is not None:
        return tok.token_to_id(pad_token)
    return int(tok.padding["pad_id"]) if tok.padding else 0


class Renderer:
    """One process's template renderer and tokenizer (built once per worker)."""

    def __init__(self, tokenizer: str, template: Template, train_roles: tuple[str, ...]):
        transformers = transformers_module()
        self.template, self.train_roles = template, train_roles
        self.tok = transformers.PreTrainedTokenizerFast(tokenizer_object=read_tokenizer(tokenizer, "tokenizer"))
        self.tok.chat_template = template.text
        self.backend = self.tok.backend_tokenizer  # the `tokenizers` encoder: it gives character offsets

    def render(self, messages: list[dict], where, generation_prompt: bool = False) -> str:
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                **self.template.special)
        except Exception as err:  # noqa: BLE001 - Jinja and the template's raise_exception raise their own types
            raise ConfigError(f"{where}: the chat template of {self.template.where} failed on this conversation "
                              f"({type(err).__name__}: {err})") from None
        if not isinstance(text, str):
            raise ConfigError(f"the chat template of {self.template.where} did not render text")
        return text

    def trained_spans(self, messages: list[dict], full: str, where) -> list[tuple[int, int]]:
        """[start, end) character spans of `full` that are trained: each trained turn's reply."""
        spans = []
        for i, message in enumerate(messages):
            # The first message is never trained: nothing of the conversation comes before it (and
            # transformers renders no empty conversation to find where it starts).
            if i == 0 or message["role"] not in self.train_roles:
                continue
            # The generation prompt is the assistant's header; another trained role's turn is taken
            # with its own header, which the conversation so far does not predict either way.
            before = self.render(messages[:i], where, message["role"] == "assistant")
            through = self.render(messages[: i + 1], where)
            for n, prefix in ((i, before), (i + 1, through)):
                if not full.startswith(prefix):
                    raise ConfigError(
                        f"the chat template of {self.template.where} does not render conversations prefix by "
                        f"prefix ({where}: the first {n} of {len(messages)} messages do not render as the start "
                        "of all of them), so the trained turns cannot be found; give one that does with "
                        "--chat-template FILE")
            spans.append((len(before), len(through)))
        return spans

    def encode(self, messages: list[dict], where) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, loss mask) of one conversation; the mask's first entry is always False."""
        full = self.render(messages, where)
        spans = self.trained_spans(messages, full, where)
        # No added special tokens: the template writes them, as apply_chat_template(tokenize=True) assumes.
        encoding = self.backend.encode(full, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        starts = np.fromiter((a for a, _ in encoding.offsets), dtype=np.int64, count=len(ids))
        mask = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        if len(mask):
            mask[0] = False  # never predicted from its own conversation: packed, it follows another one
        return ids, mask
