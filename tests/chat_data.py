"""Chat data the tests build with no download: a byte-level BPE tokenizer trained on a few words
with a Qwen-style ChatML template (replies in `{% generation %}` tags, so transformers computes its
own assistant mask to compare with), and 200 conversations of every record kind, as jsonl and
parquet. Used by tests/test_chat_prepare.py, tests/test_sft.py and tests/test_context_parallel.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

N = 200
PAD, START, END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen-style ChatML: a default system turn, the reply and its end-of-turn marker (and the newline
# after it, which the next prefix rendering also ends with) inside generation tags.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = ["hello", "world", "how", "are", "you", "the", "answer", "is", "forty", "two", "héllo", "wörld", "✓",
         "question", "please", "explain", "why", "sky", "blue", "because", "light", "scatters", "42", "?", "."]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _conversations() -> list[dict]:
    """Records: prompt/completion, system-led, multi-turn (with tool turns), and a few too long for a bin."""
    rng, records = random.Random(0), []
    for i in range(N):
        if i % 5 == 0:
            records.append({"prompt": _text(rng, rng.randint(1, 8)), "completion": _text(rng, rng.randint(1, 12))})
            continue
        messages = [{"role": "system", "content": _text(rng, 4)}] if i % 3 == 0 else []
        for turn in range(1 + i % 3):
            messages.append({"role": "user", "content": _text(rng, rng.randint(1, 10))})
            if i % 7 == 0 and turn == 0:
                messages.append({"role": "tool", "content": _text(rng, 3)})
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(1, 15))})
        if i % 41 == 7:  # longer than a bin: truncated
            messages[-1]["content"] = _text(rng, 120)
        records.append({"messages": messages})
    return records


def messages(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def make_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json (vocabulary 400) with a tokenizer_config.json holding CHATML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[PAD, START, END], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS), "system user assistant tool", "You are a helpful assistant."] * 3,
                            trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": END, "pad_token": PAD,
        "additional_special_tokens": [START, END]}))
    return folder / "tokenizer.json"


def write_corpus(root: Path) -> tuple[list[str], list[dict]]:
    """Records 0-149 as jsonl, 150-179 as parquet messages, 180-199 as parquet prompt/completion:
    (the source files, the records in the order they are read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _conversations()
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[:150]))
    threads = [r for r in records[150:] if "messages" in r]
    pairs = [r for r in records[150:] if "prompt" in r]
    pq.write_table(pa.table({"messages": [r["messages"] for r in threads]}), root / "b.parquet", row_group_size=8)
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in pairs], "completion": [r["completion"] for r in pairs]}),
                   root / "c.parquet", row_group_size=8)
    order = records[:150] + threads + pairs  # the order the sources are read in
    return [str(root / "a.jsonl"), str(root / "b.parquet"), str(root / "c.parquet")], order


def prepare_folder(root: Path, seq_len: int) -> Path:
    """The tokenizer, the corpus and `fivefold prepare --chat` of it into bins of `seq_len` tokens,
    under `root`: root/tokenizer/tokenizer.json, root/prepared."""
    from fivefold.data.prepare import prepare
    from fivefold.data.prepare_chat import chat_settings

    tokenizer = make_tokenizer(root / "tokenizer")
    sources, _ = write_corpus(root / "conversations")
    out = root / "prepared"
    prepare(sources, str(tokenizer), str(out), workers=1, progress=False, chat=chat_settings(str(tokenizer), seq_len))
    return out


def make_chat_demo_inputs(root: Path) -> Path:
    """What the shipped configs chat-demo-base and finetune read, under root/runs/chat-demo: the demo's
    tokenizer and conversations (fivefold.tools.chat_demo), a base Hugging Face folder of the
    chat-demo-base model (random weights: standing in for its pretraining) and `prepare --chat` of the
    conversations. Those configs name these paths relative to the folder they run in."""
    from fivefold.configure import load_config
    from fivefold.models import build_model
    from fivefold.models.hf.interop import save_hf
    from fivefold.tools import chat_demo
    from fivefold.data.prepare import prepare
    from fivefold.data.prepare_chat import chat_settings

    demo = root / "runs" / "chat-demo"
    assert chat_demo.main([str(demo)]) == 0
    base = load_config(None, {"model": {"preset": "tiny-qwen3", "vocab_size": chat_demo.VOCAB}}).model
    save_hf(build_model(base, seed=0), demo / "base")
    tokenizer = str(demo / "tokenizer" / "tokenizer.json")
    prepare([str(demo / "conversations.jsonl")], tokenizer, str(demo / "chat"), workers=1, progress=False,
            chat=chat_settings(tokenizer, 128))
    return root


# The layout tests' tiny shape (tests/layouts.py BASE) as a Qwen3 made by transformers, with room for
# the tokenizer's 400 tokens: the starting folder (`model.init_from`) of the fine-tuning tests.
QWEN3_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=1024, tie_word_embeddings=False)


def make_qwen3_folder(folder: Path):
    """A random tiny Qwen3ForCausalLM saved as a Hugging Face folder; returns the model."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_SHAPE)).float()
    model.save_pretrained(folder)
    return model.eval()

