"""A tokenizer.json that is cut short, is not a tokenizer, or that the storage will not read (issue
45): on a rank, in a chat template's pad token, in prepare and in generate, one sentence naming the
file, the problem and the fix, not the tokenizers library's bare Exception. The OS's error is
injected at the read (the test may run as root, whom permissions do not stop)."""

from __future__ import annotations

import errno

import pytest
from chat_data import make_tokenizer
from file_faults import one_sentence, refuse_reads
from layouts import tiny_config

from fivefold.config import DataConfig
from fivefold.config.file_errors import FileProblem
from fivefold.train import trainer
from fivefold.data.chat_template import load_template
from fivefold.data.batches import load_splits

FIX = "give the tokenizer.json of a model (its folder holds one) or 'byte'"
EIO = ("the storage reported an input/output error; check the disk or network file system (dmesg, the storage's "
       "health), then retry")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def tok(made, tmp_path):
    """A copy of the tokenizer folder (tokenizer.json and tokenizer_config.json) to damage."""
    for path in made.parent.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "corpus.txt").write_text("hello world\n" * 50)
    return tmp_path / "tokenizer.json"


def _cut_short(path):
    path.write_bytes(path.read_bytes()[:300])


def _rank_reads(tok) -> str:
    """What a rank does with data.tokenizer on a raw-text source (data/batches.py)."""
    with pytest.raises(FileProblem) as err:
        load_splits(DataConfig(source=str(tok.parent / "corpus.txt"), tokenizer=str(tok)), seq_len=8, vocab_size=512)
    return str(err.value)


def test_on_the_rank_cut_short(tok):
    _cut_short(tok)
    message = _rank_reads(tok)
    assert message.startswith(f"data.tokenizer '{tok}' is not a Hugging Face tokenizer.json (EOF while parsing")
    assert message.endswith(f"); {FIX}") and "\n" not in message


def test_on_the_rank_not_a_tokenizer(tok):
    tok.write_text('{"vocab": {"a": 0}}')
    message = _rank_reads(tok)
    assert message.startswith(f"data.tokenizer '{tok}' is not a Hugging Face tokenizer.json (")  # the library's words
    assert message.endswith(f"); {FIX}") and "\n" not in message


def test_on_the_rank_the_storage_fails(tok, monkeypatch):
    refuse_reads(monkeypatch, tok, errno.EIO, method="read_bytes")
    assert _rank_reads(tok) == f"cannot read tokenizer {tok}: {EIO} or give data.tokenizer another copy of it"


def test_a_training_rank_whose_tokenizer_was_damaged_after_the_check(tok, monkeypatch):
    """The launcher's validation read a whole file; the rank reads it again and finds it cut short."""
    validate = trainer.validate

    def then_damage(*args, **kwargs):
        validate(*args, **kwargs)
        _cut_short(tok)

    monkeypatch.setattr(trainer, "validate", then_damage)
    cfg = tiny_config({"train": {"steps": 1}, "model": {"vocab_size": 512},
                       "data": {"source": str(tok.parent / "corpus.txt"), "tokenizer": str(tok)}})
    with pytest.raises(FileProblem) as err:
        trainer.train(cfg)
    assert str(err.value).startswith(f"data.tokenizer '{tok}' is not a Hugging Face tokenizer.json (")


@pytest.mark.parametrize("damage", ["cut_short", "EACCES"])
def test_the_chat_templates_pad_token(tok, monkeypatch, damage):
    """prepare --chat and generate --chat read the tokenizer's pad token beside its template."""
    if damage == "cut_short":
        _cut_short(tok)
    else:
        refuse_reads(monkeypatch, tok, errno.EACCES, method="read_bytes")
    with pytest.raises(FileProblem) as err:
        load_template(str(tok))
    if damage == "cut_short":
        assert str(err.value).startswith(f"tokenizer '{tok}' is not a Hugging Face tokenizer.json (EOF while parsing")
        assert str(err.value).endswith(f"); {FIX}")
    else:
        assert str(err.value) == (f"cannot read tokenizer {tok}: permission denied; give this user access to it or "
                                  "give tokenizer another copy of it")


def test_prepare_and_generate_name_the_damaged_tokenizer(tok, tmp_path, capsys, monkeypatch):
    _cut_short(tok)
    assert one_sentence(capsys, "prepare", tok.parent / "corpus.txt", "--tokenizer", tok, "--out",
                         tmp_path / "data").startswith(f"--tokenizer '{tok}' is not a Hugging Face tokenizer.json (")
    assert not (tmp_path / "data").exists()
    hf = tmp_path / "hf"
    from fivefold.models.hf.stream import make_random_hf_llama

    make_random_hf_llama(hf, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32, vocab=512)
    refuse_reads(monkeypatch, tok, errno.EIO, method="read_bytes")
    assert one_sentence(capsys, "generate", hf, "--prompt", "hi", "--tokenizer", tok) == (
        f"cannot read tokenizer {tok}: {EIO} or give --tokenizer another copy of it")
