"""`fivefold prepare --chat`: conversations rendered with the tokenizer's chat template, packed into
bins of --seq-len tokens with a loss mask. The mask and ids agree token for token with transformers'
own `apply_chat_template(..., return_assistant_tokens_mask=True)` (a ChatML template whose replies
carry `{% generation %}` tags); the packing contract holds; the output does not depend on the
worker count, resumes byte for byte and re-runs as a no-op; each bad input gets one sentence.

Everything is built here, with no download: a byte-level BPE tokenizer trained on a few strings.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import chat_data
from chat_data import CHATML, make_tokenizer, messages, write_corpus

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.data import prepare_chat
from fivefold.data.prepare import prepare
from fivefold.data.prepare_chat import chat_settings
from fivefold.data.token_shards import TokenShards

pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

L = 128
N = chat_data.N


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], list[dict]]:
    return write_corpus(tmp_path_factory.mktemp("chat"))


def _chat(tokenizer: Path, **kw) -> prepare_chat.ChatSettings:
    return chat_settings(str(tokenizer), kw.pop("seq_len", L), **kw)


@pytest.fixture(scope="module")
def prepared(tokenizer, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "out"
    prepare(corpus[0], str(tokenizer), str(out), workers=1, unit_bytes=3000, progress=False, chat=_chat(tokenizer))
    return out


def _folder_bytes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _documents(shards: TokenShards) -> list[tuple[int, int]]:
    starts = [int(s) for s in shards.document_starts]
    return list(zip(starts, starts[1:] + [shards.num_tokens]))


def _split(shards: TokenShards, pad_id: int):
    """(conversation documents, padding documents): a conversation starts with <|im_start|>, never a pad."""
    convs, pads = [], []
    for a, b in _documents(shards):
        (pads if shards.read(a, 1)[0] == pad_id else convs).append((a, b))
    return convs, pads


def test_ids_and_mask_match_transformers_assistant_mask(tokenizer, corpus, prepared):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizer.parent))
    shards = TokenShards(str(prepared))
    convs, _ = _split(shards, reference.pad_token_id)
    assert len(convs) == N
    checked = truncated = 0
    for (a, b), record in zip(convs, corpus[1]):
        ref = reference.apply_chat_template(messages(record), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = np.array(ref["input_ids"]), np.array(ref["assistant_masks"], dtype=bool)
        assert mask.any() and not mask[0]
        if len(ids) > L:  # truncated to one bin
            ids, mask, truncated = ids[:L], mask[:L], truncated + 1
        assert shards.read(a, b - a).tolist() == ids.tolist()
        assert shards.read_mask(a, b - a).tolist() == mask.tolist()
        checked += 1
    assert checked == N and truncated == TokenShards(str(prepared)).manifest["chat"]["truncated"] == 4


def test_packing_contract_and_manifest(tokenizer, corpus, prepared):
    shards = TokenShards(str(prepared))
    manifest = shards.manifest
    pad_id = 0  # <|endoftext|>, the tokenizer's pad token
    assert shards.has_loss_mask and shards.packed_seq_len == L and manifest["loss_mask"] is True
    assert len(manifest["shards"]) > 5  # several units: bins must not straddle their shards
    for entry in manifest["shards"]:
        tokens = (prepared / entry["file"]).stat().st_size // 2  # uint16
        assert tokens == entry["tokens"] and tokens % L == 0
        assert (prepared / entry["file"].replace(".bin", ".mask.bin")).stat().st_size == tokens
    convs, pads = _split(shards, pad_id)
    mask = shards.read_mask(0, shards.num_tokens)
    stream = shards.read(0, shards.num_tokens)
    for a, b in convs + pads:
        assert a // L == (b - 1) // L, (a, b)  # inside one bin
    for a, b in pads:
        assert b % L == 0 and (stream[a:b] == pad_id).all() and not mask[a:b].any()
    assert not mask[[a for a, _ in convs]].any()  # a conversation's first token is never a target
    # Greedy: padding comes only where the next conversation of the shard does not fit.
    ends = set(np.cumsum([s["tokens"] for s in manifest["shards"]]).tolist())
    following = dict(zip([a for a, _ in _documents(shards)][:-1], _documents(shards)[1:]))
    for a, b in pads:
        if b not in ends:
            nxt_a, nxt_b = following[a]
            assert nxt_b - nxt_a > b - a  # the next conversation did not fit in the rest of the bin
    chat = manifest["chat"]
    assert chat["conversations"] == N and chat["truncated"] == 4
    assert chat["trained_tokens"] == int(mask.sum()) and chat["pad_tokens"] == sum(b - a for a, b in pads)
    assert chat["template"] == "tokenizer_config.json" and chat["train_roles"] == ["assistant"]
    assert chat["template_sha256"] == hashlib.sha256(CHATML.encode()).hexdigest()
    assert manifest["documents"] == len(convs) + len(pads) and manifest["tokens"] == shards.num_tokens
    assert sorted(p.name for p in prepared.iterdir()) == sorted(
        ["manifest.json", "documents.npy", "tokenizer"] + [f for s in manifest["shards"] for f in
                                              (s["file"], s["file"].replace(".bin", ".mask.bin"))])


def test_workers_resume_and_rerun_give_the_same_bytes(tokenizer, corpus, prepared, tmp_path, monkeypatch):
    two = tmp_path / "two"
    prepare(corpus[0], str(tokenizer), str(two), workers=2, unit_bytes=3000, progress=False, chat=_chat(tokenizer))
    assert _folder_bytes(two) == _folder_bytes(prepared)

    # A prepare that dies at its fourth unit keeps three; the re-run does the rest, byte for byte.
    killed, real, calls = tmp_path / "killed", prepare_chat.pack_unit, []

    def dies(*args):
        calls.append(args[1])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(prepare_chat, "pack_unit", dies)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus[0], str(tokenizer), str(killed), workers=1, unit_bytes=3000, progress=False,
                chat=_chat(tokenizer))
    assert len(list(killed.glob("shard_*.mask.bin"))) == 3
    monkeypatch.setattr(prepare_chat, "pack_unit", real)
    calls.clear()
    prepare(corpus[0], str(tokenizer), str(killed), workers=1, unit_bytes=3000, progress=False, chat=_chat(tokenizer))
    assert _folder_bytes(killed) == _folder_bytes(prepared)

    before = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}
    again = prepare(corpus[0], str(tokenizer), str(prepared), workers=1, unit_bytes=3000, progress=False,
                    chat=_chat(tokenizer))  # finished: nothing is redone
    assert again == json.loads((prepared / "manifest.json").read_text())
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == before
    for changed in (_chat(tokenizer, seq_len=L + 1), _chat(tokenizer, train_roles="assistant,user")):
        with pytest.raises(ConfigError, match="already holds prepared data from other sources or settings"):
            prepare(corpus[0], str(tokenizer), str(prepared), workers=1, unit_bytes=3000, progress=False, chat=changed)


def test_cli_prepares_and_summarizes(tokenizer, corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["prepare", corpus[0][2], "--tokenizer", str(tokenizer), "--out", str(out), "--chat",
                 "--seq-len", str(L), "--workers", "1"]) == 0
    line = capsys.readouterr().out.strip()
    manifest = json.loads((out / "manifest.json").read_text())
    share = manifest["chat"]["trained_tokens"] / manifest["tokens"]
    assert f"10 conversations (0 truncated to {L}), {share:.1%} of tokens trained" in line, line
    # A template file given with --chat-template wins, and is named in the manifest.
    (tmp_path / "mine.jinja").write_text(CHATML.replace("You are a helpful assistant.", "Be brief."))
    assert main(["prepare", corpus[0][2], "--tokenizer", str(tokenizer), "--out", str(tmp_path / "own"), "--chat",
                 "--seq-len", str(L), "--workers", "1", "--chat-template", str(tmp_path / "mine.jinja")]) == 0
    chat = json.loads((tmp_path / "own" / "manifest.json").read_text())["chat"]
    assert chat["template"] == "mine.jinja" and chat["trained_tokens"] == manifest["chat"]["trained_tokens"]
    assert chat["template_sha256"] == hashlib.sha256((tmp_path / "mine.jinja").read_bytes()).hexdigest()
    assert chat["pad_tokens"] != manifest["chat"]["pad_tokens"]  # another default system turn was rendered


def _error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("error: ")
    return captured.err.strip()[len("error: "):]


def _jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_each_bad_input_gets_one_sentence(tokenizer, tmp_path, capsys, monkeypatch):
    tok = str(tokenizer)

    def chat(src: str, *more: str) -> str:
        return _error(capsys, ["prepare", src, "--tokenizer", tok, "--out", str(tmp_path / "o"), "--chat",
                               "--seq-len", "64", "--workers", "1", *more])

    f = _jsonl(tmp_path / "neither.jsonl", [GOOD, {"text": "plain"}])
    assert chat(f) == (f"{f}:2 has neither 'messages' nor text 'prompt' and 'completion'; give each record one "
                       "of them")
    f = _jsonl(tmp_path / "content.jsonl", [GOOD, GOOD, {"messages": [{"role": "user", "content": 3}]}])
    assert chat(f) == f"{f}:3 message 1 is not a {{role, content}} object with text content"
    f = _jsonl(tmp_path / "role.jsonl", [{"messages": [GOOD["messages"][0], {"role": "narrator", "content": "x"}]}])
    assert chat(f) == f"{f}:1 message 2 role 'narrator' is not one of system, user, assistant, tool"
    f = _jsonl(tmp_path / "untrained.jsonl", [GOOD, {"messages": [GOOD["messages"][0]]}])
    assert chat(f) == f"{f}:2 has no assistant turn to train on (--train-roles assistant)"
    f = str(tmp_path / "rows.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "completion": ["x", None, "z"]}), f)
    assert chat(f) == (f"{f} row 2 has neither 'messages' nor text 'prompt' and 'completion'; give each record "
                       "one of them")
    f = str(tmp_path / "role.parquet")
    pq.write_table(pa.table({"messages": [GOOD["messages"], [{"role": "narrator", "content": "x"}]]}), f)
    assert chat(f) == f"{f} row 2 message 1 role 'narrator' is not one of system, user, assistant, tool"

    good = _jsonl(tmp_path / "good.jsonl", [GOOD])
    assert chat(good, "--chat-template", str(tmp_path / "nope.jinja")) == (
        f"--chat-template '{tmp_path / 'nope.jinja'}' is not a file; give a Jinja chat template")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    assert _error(capsys, ["prepare", good, "--tokenizer", str(bare / "tokenizer.json"), "--out", str(tmp_path / "o"),
                           "--chat", "--seq-len", "64"]) == (
        f"{bare / 'tokenizer.json'} has no chat_template (tokenizer_config.json beside it); give --chat-template FILE")
    (tmp_path / "last.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}"
                                         "{% endfor %}")
    assert "does not render conversations prefix by prefix" in chat(good, "--chat-template",
                                                                    str(tmp_path / "last.jinja"))
    base = ["prepare", good, "--out", str(tmp_path / "o"), "--chat"]
    assert _error(capsys, base + ["--tokenizer", tok]).startswith("fivefold prepare --chat needs --seq-len L")
    assert _error(capsys, base + ["--tokenizer", tok, "--seq-len", "1"]) == (
        "--seq-len 1 is too short: a packed sequence needs at least 2 tokens")
    assert _error(capsys, base + ["--tokenizer", "byte", "--seq-len", "64"]) == (
        "fivefold prepare --chat needs a Hugging Face tokenizer.json with a chat template; --tokenizer byte has none")
    assert _error(capsys, ["prepare", good, "--out", str(tmp_path / "o"), "--seq-len", "64"]) == (
        "--seq-len, --chat-template and --train-roles describe chat data; add --chat")
    (tmp_path / "notes.txt").write_text("plain text\n")
    assert chat(str(tmp_path / "notes.txt")).endswith("is not a .jsonl or .parquet file; fivefold prepare --chat "
                                                      "reads conversation records from those only")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    assert chat(good) == "fivefold prepare --chat needs transformers for chat templates: pip install 'fivefold[chat]'"
    assert not (tmp_path / "o" / "manifest.json").exists()
