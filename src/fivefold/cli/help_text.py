"""The CLI's help texts: the command list, each command's usage, and every config key with its
default and one line of help, read from the config dataclasses themselves.

A key's help is, in this order: its field metadata `help` (`field(default=..., metadata={"help": ...})`),
the comment at the end of its line in config/schema.py, the comment block just above it, or, for the
self-explanatory keys config/schema.py leaves uncommented, the line in `UNCOMMENTED` below. Reading the
comments keeps config/schema.py as it is (one place to explain a key); tests/test_cli_help.py checks
that every key has a help line and that `UNCOMMENTED` names only keys with no comment. A number's
help ends with the values its declaration accepts (`checked(...)`, config/checks.py), e.g. `; > 0`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import shutil
import textwrap
import tokenize
import typing
from importlib import metadata

from fivefold.config import shipped as shipped_configs
from fivefold.config import Config

# Command -> (one-line summary, usage). `fivefold --help` lists the summaries.
COMMANDS = {
    "train": ("train a model on local ranks (--nproc N) or under torchrun", """\
  fivefold train [CONFIG] [--nproc N] [--max-restarts K] [--dry-run] [--section.key VALUE ...]
  fivefold train [CONFIG] --nproc N --nnodes M --node-rank R --rdzv HOST:PORT [...]   (one per node)
  fivefold train [CONFIG] --nproc N --parallel.auto true [--sweep K]   (the planner picks the layout;
                 or one key at a time: --parallel.pp auto, --train.micro_batch auto, ...)"""),
    "config": ("print the resolved config (defaults < preset < CONFIG < overrides)",
               "  fivefold config show [CONFIG] [--section.key VALUE ...]"),
    "layout": ("print the rank map: which rank holds which layers, heads and experts", """\
  fivefold layout [CONFIG] [--nproc N] [--all] [--section.key VALUE ...]   (rank map, no training)
  fivefold layout CONFIG --build [--rank R] [--json]   (build rank R's real shard here; what it holds)"""),
    "plan": ("predict memory, communication and speed of layouts; search for the best",
             '  fivefold plan [CONFIG] [--cluster.gpus N] [--cluster.gpu h100] [--layout "dp=8,tp=2,..."] [--json]'),
    "prepare": ("tokenize text/jsonl/parquet/Arrow files into token shards (data.source)", """\
  fivefold prepare SRC... --tokenizer byte|TOKENIZER.json --out DIR [--workers N] [--text-field text]
  fivefold prepare SRC... --tokenizer TOKENIZER.json --out DIR --chat --seq-len L [--chat-template FILE.jinja]
                   [--train-roles assistant] [--workers N]   (conversations: packed, with a loss mask)"""),
    "convert": ("turn a fivefold checkpoint into a Hugging Face folder, or the reverse",
                "  fivefold convert SRC DST   (direction from SRC; a LoRA checkpoint becomes a PEFT adapter folder)\n"
                "  fivefold convert --merge LORA_CHECKPOINT DST   (the adapters merged into the base, as a Hugging Face folder)"),
    "generate": ("print a sample from a trained checkpoint or an exported Hugging Face folder",
                 '  fivefold generate CHECKPOINT|HF_FOLDER --prompt "TEXT" [--tokens 200] [--temperature 0.8] [--seed 0]\n'
                 "                    [--tokenizer byte|TOKENIZER.json]   (temperature 0 = greedy)\n"
                 '  fivefold generate CHECKPOINT|HF_FOLDER --chat --prompt "A USER MESSAGE" [--system "TEXT"]\n'
                 "                    [--chat-template FILE.jinja]   (the reply, rendered with the chat template)"),
    "report": ("draw a run's metrics as pictures (loss, speed, memory per rank, bubble, MoE load)",
               "  fivefold report RUN_DIR   (the run's log.dir; writes RUN_DIR/report/*.png)"),
    "viz": ("draw a pipeline schedule",
            "  fivefold viz schedule --schedule 1f1b --pp 4 [--virtual 1] [--micro-batches 8] --out FILE.png"),
}

# Help for the keys config/schema.py leaves without a comment (their names say most of it).
UNCOMMENTED = {
    "model.moe.n_shared_experts": "experts every token goes through, beside the routed ones",
    "model.moe.first_dense": "the first N layers stay dense",
    "model.moe.aux_loss_coeff": "weight of the load-balancing auxiliary loss (balance = aux_loss)",
    "model.moe.bias_update_rate": "step of the routing-bias update (balance = bias)",
    "model.moe.topk_group": "groups each token may choose experts from (with n_group)",
    "model.preset": "a named model shape that fills the model keys (explicit keys override it)",
    "model.dim": "hidden size",
    "model.n_layers": "transformer blocks",
    "model.n_heads": "attention (query) heads",
    "model.n_kv_heads": "key/value heads (grouped-query attention when fewer than n_heads)",
    "model.ffn_dim": "hidden size of the SwiGLU feed-forward",
    "model.vocab_size": "vocabulary size (at least the tokenizer's)",
    "model.tie_embeddings": "the output layer shares the embedding matrix",
    "model.rope_theta": "RoPE base frequency",
    "model.norm_eps": "RMSNorm epsilon",
    "model.max_seq_len": "longest sequence the model is built for",
    "model.rope_low_freq_factor": "Llama 3.1 RoPE scaling: low-frequency factor",
    "model.rope_high_freq_factor": "Llama 3.1 RoPE scaling: high-frequency factor",
    "model.rope_yarn_beta_fast": "YaRN: beta_fast",
    "model.rope_yarn_beta_slow": "YaRN: beta_slow",
    "model.kv_lora_rank": "multi-head latent attention: rank of the key/value latent (0 = off)",
    "model.qk_nope_head_dim": "multi-head latent attention: per-head query/key dims without RoPE",
    "model.qk_rope_head_dim": "multi-head latent attention: the shared RoPE key's dims",
    "model.v_head_dim": "multi-head latent attention: per-head value dims",
    "model.mtp_loss_weight": "weight of the multi-token-prediction loss (mean over its depths) in the gradients",
    "parallel.tp": "tensor-parallel degree",
    "parallel.pp": "pipeline-parallel degree (stages)",
    "parallel.pp_schedule": "gpipe | 1f1b | interleaved_1f1b | zb | zbv | dualpipev",
    "parallel.pp_virtual": "pipeline stages per rank (interleaved and V schedules)",
    "parallel.cp": "context-parallel degree (the sequence split over ranks)",
    "parallel.cp_method": "ring | allgather | ulysses",
    "parallel.ep": "expert-parallel degree (ranks borrowed from dp*cp)",
    "parallel.gpus_per_node": "ranks per node, for the rank map's node-crossing warnings",
    "train.steps": "optimizer steps",
    "train.seed": "seed of the initial weights and the data order",
    "train.seq_len": "tokens per sequence",
    "train.lr": "peak learning rate",
    "train.min_lr_ratio": "final learning rate as a fraction of lr",
    "train.warmup": "linear warm-up steps",
    "train.weight_decay": "AdamW weight decay",
    "train.beta1": "AdamW beta1",
    "train.beta2": "AdamW beta2",
    "train.eval_batches": "held-out batches per evaluation",
    "data.val_fraction": "share of the tokens (documents, for prepared data) held out for evaluation",
    "data.builtin_max_bytes": "bytes of the builtin corpus (Python's standard library) to read",
    "checkpoint.keep": "checkpoints kept (the last k)",
    "debug.crash_rank": "the rank crash_at_step and hang_at_step act on",
    "log.tensorboard": "also write TensorBoard events to log.dir",
    "log.progress": "print the progress lines (and notes) on the console",
    "cluster.gpus": "GPUs the planner plans for (0 = the layout's world size)",
    "cluster.gpu": "GPU profile (plan/hardware.py), e.g. h100",
    "cluster.gpus_per_node": "GPUs per node",
    "cluster.memory_gb": "memory per GPU, GB",
}


def version() -> str:
    """The installed package's version (its metadata), or the source's when run uninstalled."""
    try:
        return metadata.version("fivefold")
    except metadata.PackageNotFoundError:
        from fivefold import __version__

        return __version__


@functools.cache
def _source_comments(cls) -> tuple[dict[str, str], str]:
    """(field -> its trailing comment or the comment block just above it, the class docstring)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except OSError:  # installed without sources: metadata and UNCOMMENTED still answer
        return {}, ""
    comments: dict[int, str] = {}  # line (1-based, in `lines`) -> comment text
    has_code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            has_code.add(tok.start[0])
    node = ast.parse("".join(lines)).body[0]
    found = {}
    for stmt in node.body:
        if not isinstance(stmt, ast.AnnAssign):
            continue
        line = stmt.lineno
        if line in comments:
            found[stmt.target.id] = comments[line]
            continue
        block = []
        while line - 1 in comments and line - 1 not in has_code:
            line -= 1
            block.insert(0, comments[line])
        if block:
            found[stmt.target.id] = " ".join(block)
    return found, ast.get_docstring(node) or ""


def key_help(cls, name: str, dotted: str) -> str:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.metadata.get("help") or _source_comments(cls)[0].get(name) or UNCOMMENTED.get(dotted, "")


def config_sections(cls=Config, section: str = "") -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """[(section, its docstring, [(dotted key, default as typed on the command line, help)])],
    nested sections after their parent ([model], then [model.moe])."""
    hints = typing.get_type_hints(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        dotted = f"{section}.{f.name}" if section else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            nested += config_sections(hints[f.name], dotted)
        else:
            rows.append((dotted, _as_typed(_default(f)), _with_range(key_help(cls, f.name, dotted), f)))
    return ([(section, _source_comments(cls)[1], rows)] if rows else []) + nested


def _with_range(help: str, f: dataclasses.Field) -> str:
    """The help and, for a number, the values it accepts (its declaration in config/schema.py)."""
    check = f.metadata.get("check")
    if check is None or check.choices:  # choices: the help comment lists them already
        return help
    return f"{help}; {check.accepts()}" if help else check.accepts()


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _as_typed(value) -> str:
    """A default as one would type it after --section.key ("" for an empty string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return repr(value)


def main_help() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join([
        f"fivefold {version()}: train language models with 5D parallelism, and plan the layout first",
        "",
        "usage: fivefold COMMAND [ARGS]    (`fivefold COMMAND --help`: its usage and options)",
        "       fivefold --version",
        "",
        "commands:",
        *(f"  {name:<{width}}  {summary}" for name, (summary, _) in COMMANDS.items()),
        "",
        _config_note()])


def _config_note(where: str = "`fivefold train --help` lists them") -> str:
    return textwrap.fill(f"CONFIG is a TOML file or the name of a shipped config "
                         f"({', '.join(shipped_configs.names())}); any config key is also an option, "
                         f"--section.key VALUE ({where}).", 100)


def command_help(command: str, options: str = "") -> str:
    """A command's usage and options (`options`: its argparse help, when it has a parser); train's
    lists every config key too."""
    summary, usage = COMMANDS[command]
    text = options.rstrip() or f"usage:\n{usage}\n\n{summary}"
    if command in ("config", "layout"):
        text += "\n\n" + _config_note()
    if command == "train":
        text += "\n\n" + _config_note("all of them below") + "\n\n" + config_keys_help()
    return text


def config_keys_help() -> str:
    """Every config key, by section: `--section.key DEFAULT   help`."""
    sections = config_sections()
    # A very long default (train.param_groups) runs into its help rather than widening every row.
    width = max(n for _, _, rows in sections for key, default, _ in rows
                if (n := len(f"--{key} {default}")) <= 44) + 4
    columns = max(100, shutil.get_terminal_size().columns)
    lines = ["config keys (defaults shown; a model.preset fills the [model] keys, explicit keys override it):"]
    for section, doc, rows in sections:
        lines += ["", f"[{section}]" + (f"  {doc.splitlines()[0]}" if doc else "")]
        for key, default, help in rows:  # the help wrapped under its own column
            lines.append(textwrap.fill(help, columns, initial_indent=f"  {f'--{key} {default}':<{width - 4}}  ",
                                       subsequent_indent=" " * width) if help else f"  --{key} {default}")
    return "\n".join(lines)
