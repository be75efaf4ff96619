"""`python -m fivefold.tools.chat_demo DIR`: everything the fine-tuning demo needs, made on this
machine with no download (docs/fine-tuning.md).

- DIR/tokenizer/: a byte-level BPE tokenizer.json (512 tokens) trained on the conversations and a
  slice of this Python's standard library, and a tokenizer_config.json with a ChatML chat template
  (Qwen's layout: `<|im_start|>role ... <|im_end|>`), its end-of-turn token and a pad token;
- DIR/conversations.jsonl: 4,000 short conversations, one per line as {"messages": [...]}: sums,
  differences, reversed and capitalised words, letter counts, some with a system message and some
  with a follow-up turn. Replies are short and exact, so a small model learns the format and part of
  the arithmetic in minutes, and the held-out loss shows it.

The base model comes from `fivefold train chat-demo-base` (a tiny Qwen3 pretrained on the standard
library's text with this tokenizer, exported as a Hugging Face folder); `fivefold train finetune`
then fine-tunes it on these conversations.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB = 512
N_CONVERSATIONS = 4000
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, end of turn
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = ("python", "module", "import", "return", "lambda", "string", "number", "object", "class", "tuple",
         "list", "value", "yield", "token", "layer", "model", "train", "batch", "tensor", "graph", "stage",
         "expert", "window", "shard", "rank", "queue", "cache", "state", "parse", "print")
SYSTEMS = ("You are a precise assistant.", "Answer briefly.", "You are a careful calculator.")


def conversation(rng: random.Random) -> list[dict]:
    kind = rng.randrange(5)
    word = rng.choice(WORDS)
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if kind == 0:
        turns = [(f"What is {a} + {b}?", f"{a} + {b} = {a + b}.")]
        if rng.random() < 0.3:
            turns.append(("And twice that?", f"2 * {a + b} = {2 * (a + b)}."))
    elif kind == 1:
        turns = [(f"What is {max(a, b)} - {min(a, b)}?", f"{max(a, b)} - {min(a, b)} = {max(a, b) - min(a, b)}.")]
    elif kind == 2:
        turns = [(f"Reverse the word {word}.", f"{word} reversed is {word[::-1]}.")]
    elif kind == 3:
        turns = [(f"Write {word} in capitals.", word.upper())]
    else:
        turns = [(f"How many letters are in {word}?", f"{word} has {len(word)} letters.")]
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages


def stdlib_sample(max_bytes: int = 400_000) -> list[str]:
    from fivefold.data.batches import builtin_documents

    return list(builtin_documents(max_bytes))


def make_tokenizer(folder: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    pad, _, end = SPECIAL
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": end,
        "pad_token": pad, "additional_special_tokens": list(SPECIAL[1:])}, indent=1) + "\n")
    return folder / "tokenizer.json"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m fivefold.tools.chat_demo DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    conversations = [conversation(rng) for _ in range(N_CONVERSATIONS)]
    with open(out / "conversations.jsonl", "w") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}) + "\n")
    rendered = [" ".join(m["content"] for m in c) for c in conversations]
    tokenizer = make_tokenizer(out / "tokenizer", rendered + stdlib_sample() + ["system user assistant"])
    print(f"wrote {out / 'conversations.jsonl'} ({N_CONVERSATIONS} conversations) and {tokenizer} "
          f"({VOCAB} tokens, ChatML template); next: fivefold train chat-demo-base --nproc 2")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
