"""`fivefold train | config show | plan | prepare | ...`: parse, call, print. No logic lives here."""

from __future__ import annotations

import argparse
import json
import os
import sys

from fivefold.cli import help_text as cli_help
from fivefold.config import ConfigError, to_toml
from fivefold.config.validate_data import check_data_is_set
from fivefold.configure import load_config, validate


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one sentence (printed by main), not a usage dump."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}; see `{self.prog} --help`")


def _parser(command: str, prog: str = "") -> _Parser:
    summary, usage = cli_help.COMMANDS[command]
    return _Parser(prog=prog or f"fivefold {command}", usage="\n" + usage, description=summary,
                   add_help=False)


def _train_parser() -> _Parser:
    parser = _parser("train")
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="local ranks to start (default 1: this process)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart failed ranks up to K times, resuming from the latest checkpoint")
    # More than one machine: one launcher per node, meeting at node 0's HOST:PORT (torch's c10d rendezvous).
    parser.add_argument("--nnodes", type=int, default=1, metavar="M", help="launchers (nodes) in the job, one per node")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="this launcher's node, 0 to nnodes-1")
    parser.add_argument("--rdzv", default="", metavar="HOST:PORT", help="node 0's address, where the launchers meet")
    parser.add_argument("--rdzv-id", default="fivefold", metavar="ID", help="the job's rendezvous id")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the rank map only")
    parser.add_argument("--sweep", type=int, default=0, metavar="K",
                        help="with --parallel.auto: train the planner's top K layouts a few steps each "
                             "and keep the fastest measured")
    return parser


def _layout_parser() -> _Parser:
    parser = _parser("layout")
    parser.add_argument("--nproc", type=int, default=0, metavar="N", help="ranks to check the layout for (default: dp*tp*pp*cp)")
    parser.add_argument("--all", action="store_true", help="list every group and rank, not only the first few")
    parser.add_argument("--build", action="store_true", help="build one rank's real shard here and report it")
    parser.add_argument("--rank", type=int, default=0, metavar="R", help="the rank --build builds")
    parser.add_argument("--json", action="store_true", help="--build's report as JSON")
    return parser


def _prepare_parser() -> _Parser:
    parser = _parser("prepare")
    parser.add_argument("sources", nargs="*", metavar="SRC", help="files, folders or globs of text/jsonl/parquet/Arrow")
    parser.add_argument("--tokenizer", default="byte", metavar="TOKENIZER", help="byte, or a Hugging Face tokenizer.json")
    parser.add_argument("--out", default="", metavar="DIR", help="the prepared folder to write (use it as data.source)")
    parser.add_argument("--workers", type=int, default=0, metavar="N", help="tokenizing processes (default: one per core)")
    parser.add_argument("--text-field", default="text", metavar="FIELD", help="the jsonl/parquet column holding the text")
    parser.add_argument("--chat", action="store_true",
                        help="conversations (messages or prompt/completion records) packed into --seq-len "
                             "bins with a loss mask on the trained turns")
    parser.add_argument("--seq-len", type=int, default=0, metavar="L", help="--chat: tokens per packed bin (train.seq_len)")
    parser.add_argument("--chat-template", default="", metavar="FILE",
                        help="--chat: a Jinja chat template (default: the chat_template of tokenizer_config.json)")
    parser.add_argument("--train-roles", default="assistant", metavar="ROLES",
                        help="--chat: comma-separated roles whose turns are trained (default assistant)")
    return parser


def _generate_parser() -> _Parser:
    parser = _parser("generate")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a step_N folder, a checkpoint root, or a Hugging Face folder")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--tokens", type=int, default=200, metavar="N", help="new tokens to sample (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T", help="softmax temperature; 0 = greedy (default 0.8)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the sampling (default 0)")
    parser.add_argument("--tokenizer", default="", metavar="TOKENIZER", help="byte or a tokenizer.json (default: the run's data.tokenizer)")
    parser.add_argument("--base", default="", metavar="FOLDER",
                        help="the base model of LoRA adapters, when it is not where the checkpoint says")
    parser.add_argument("--chat", action="store_true", help="the prompt is a user message, rendered with the chat template; print the reply")
    parser.add_argument("--system", default="", metavar="TEXT", help="--chat: a system message before the user's")
    parser.add_argument("--chat-template", default="", metavar="FILE",
                        help="--chat: a Jinja chat template (default: the chat_template of tokenizer_config.json)")
    return parser


def _viz_parser() -> _Parser:
    parser = _parser("viz", "fivefold viz schedule")
    parser.add_argument("what", choices=["schedule"])
    parser.add_argument("--schedule", default="1f1b", metavar="NAME", help="gpipe | 1f1b | interleaved_1f1b | zb | zbv | dualpipev")
    parser.add_argument("--pp", type=int, default=4, metavar="N", help="pipeline ranks")
    parser.add_argument("--virtual", type=int, default=1, metavar="V", help="stages per rank")
    parser.add_argument("--micro-batches", type=int, default=8, metavar="N")
    parser.add_argument("--out", required=True, metavar="FILE", help="the picture to write (.png)")
    return parser


# The options each command's --help lists (plan prints its own).
PARSERS = {"train": _train_parser, "layout": _layout_parser, "prepare": _prepare_parser,
           "generate": _generate_parser, "viz": _viz_parser}


def _split_config(args: list[str]) -> tuple[str | None, list[str]]:
    """The optional CONFIG path comes first; everything after it is --section.key overrides."""
    if args and not args[0].startswith("--"):
        return args[0], args[1:]
    return None, args


def _auto_layout(own, args: list[str], config_path: str | None, overrides: list[str],
                 free: frozenset[str], torchrun: bool) -> list[str]:
    """--parallel.auto / KEY auto: the planner's choice for this job, printed, as overrides."""
    import os

    from fivefold.plan import auto
    from fivefold.plan.compile_choice import planned_compile
    from fivefold.plan.speed.frameworks import runtime_for
    from fivefold.configure.machine import check_machine

    if own.sweep < 0 or (own.sweep and (torchrun or own.nnodes > 1 or own.dry_run)):
        raise ConfigError(f"--sweep {own.sweep}: give a count >= 1, and use it only on one machine's "
                          "local ranks (not under torchrun, --nnodes > 1 or --dry-run)")
    cfg = load_config(config_path, overrides)
    if torchrun:  # every rank plans the same (a pure function of the config and world); rank 0 prints
        world, per_node = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    elif own.dry_run and not any(a.startswith("--nproc") for a in args):
        raise ConfigError("--dry-run with --parallel.auto needs --nproc N: the planner chooses for a world size")
    else:
        world, per_node = own.nproc * own.nnodes, own.nproc
    if world < 1:
        raise ConfigError(f"--nproc must be >= 1, got {own.nproc}")
    import torch

    # This rank's own GPU (under torchrun), so that no rank touches another's device.
    device = (torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
              if torch.cuda.is_available() else None)
    hw, why = auto.job_hardware(cfg, per_node, device)
    choice = auto.choose(cfg, world, hw, runtime_for(planned_compile(cfg)), free, check=check_machine, keep=own.sweep)
    best = choice.best
    speaks = int(os.environ.get("RANK", 0)) == 0 and own.node_rank == 0
    if speaks:
        print(auto.describe(choice, why), flush=True)
    if own.sweep:
        from fivefold.plan.sweep import measure

        top = choice.valid[:own.sweep]
        print(f"measuring the top {len(top)} layouts a few steps each on this machine ...", flush=True)
        measured = [(est, measure(auto.sweep_config(cfg), est.layout)) for est in top]
        best, table = auto.keep_fastest(measured)
        print(table, flush=True)
    return [*overrides, *auto.as_overrides(best.layout, choice.free)]


def cmd_train(args: list[str]) -> int:
    parser = _train_parser()
    own, rest = parser.parse_known_args(args)
    config_path, overrides = _split_config(rest)
    from fivefold.plan.auto import split_auto
    from fivefold.train.launch import launch_local, launched_by_torchrun, worker

    # The auto values are not config values: the planner turns them into ordinary overrides.
    overrides, free = split_auto(overrides)
    if own.sweep and not free:
        raise ConfigError(f"--sweep {own.sweep} measures the planner's top layouts: add --parallel.auto true "
                          "(or give a layout key the value auto, e.g. --parallel.pp auto)")

    if own.nnodes > 1:
        if not own.rdzv:
            raise ConfigError("--nnodes > 1 needs --rdzv HOST:PORT, the address of node 0 where the "
                              "launchers meet")
        if not 0 <= own.node_rank < own.nnodes:
            raise ConfigError(f"--node-rank must be between 0 and --nnodes-1={own.nnodes - 1}, got {own.node_rank}")
        # Each launcher is one node: the rank map and the tp-crossing warning count nodes by it.
        overrides = [*overrides, "--parallel.gpus_per_node", str(own.nproc)]
    if free:
        overrides = _auto_layout(own, args, config_path, overrides, free, launched_by_torchrun())
    cfg = load_config(config_path, overrides)  # once: every branch below reads it
    if own.dry_run:
        given = any(a.startswith("--nproc") for a in args)
        validate(cfg, own.nproc * own.nnodes if given else _config_world(cfg), on_this_machine=True)  # as a launch
        check_data_is_set(cfg)  # what the launch would refuse
        from fivefold.tools.rank_map import format_rank_map

        print(format_rank_map(cfg))
        return 0
    if cfg.ft.replicas and not cfg.ft.lighthouse:  # in-place healing on this machine: a lighthouse and the groups
        return _replica_groups(own, config_path, overrides, cfg)
    if launched_by_torchrun() or (own.nproc == 1 and own.nnodes == 1):
        from fivefold.runtime import runtime_from_env

        validate(cfg, runtime_from_env().world_size)
        check_data_is_set(cfg)
        worker(config_path, overrides)
        return 0
    if own.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {own.nproc}")
    validate(cfg, own.nproc * own.nnodes, on_this_machine=True)  # before any process starts
    check_data_is_set(cfg)
    from fivefold.tools.rank_map import format_rank_map

    if own.node_rank == 0:
        print(format_rank_map(cfg), flush=True)  # which rank holds what, before the first step
    return launch_local(config_path, overrides, own.nproc, own.max_restarts, own.nnodes, own.node_rank,
                        own.rdzv, own.rdzv_id)


def _replica_groups(own, config_path, overrides, cfg) -> int:
    """`--ft.replicas R` without ft.lighthouse: R replica groups of --nproc ranks here (ft/supervise.py)."""
    from fivefold.ft.supervise import run_replica_groups

    validate(cfg, own.nproc, on_this_machine=True)  # before any process starts
    check_data_is_set(cfg)
    return run_replica_groups(config_path, overrides, own.nproc, cfg, own.max_restarts, own.nnodes)


def _config_world(cfg) -> int:
    """The world size a config's own degrees make (what `fivefold layout` checks without --nproc)."""
    p = cfg.parallel
    if not p.dp:
        raise ConfigError("parallel.dp=0 takes dp from the world size: give --nproc N (the ranks to lay out)")
    return p.dp * p.tp * p.pp * p.cp


def cmd_layout(args: list[str]) -> int:
    """The rank map of a config, checked as a launch of --nproc ranks would be, without training."""
    parser = _layout_parser()
    own, rest = parser.parse_known_args(args)
    config_path, overrides = _split_config(rest)
    cfg = load_config(config_path, overrides)
    world = own.nproc or _config_world(cfg)
    validate(cfg, world, on_this_machine=own.build)  # --build builds the rank here
    if own.build:
        if not 0 <= own.rank < world:
            raise ConfigError(f"--rank {own.rank} is not a rank of this layout: use 0 to {world - 1}")
        from fivefold.tools.rank_build import build_rank, format_report

        report = build_rank(cfg, own.rank)
        print(json.dumps(report) if own.json else format_report(report))
        return 0
    from fivefold.tools.rank_map import format_rank_map

    print(format_rank_map(cfg, own.all))
    return 0


def cmd_config(args: list[str]) -> int:
    if not args or args[0] != "show":
        raise ConfigError("usage: fivefold config show [CONFIG] [--section.key VALUE ...]")
    config_path, overrides = _split_config(args[1:])
    cfg = validate(load_config(config_path, overrides))
    print(to_toml(cfg))
    return 0


def cmd_plan(args: list[str]) -> int:
    from fivefold.plan.cli import run_plan

    return run_plan(args)


def cmd_viz(args: list[str]) -> int:
    parser = _viz_parser()
    a = parser.parse_args(args)
    # The same checks as a training config with this pipeline (one sentence on a bad combination).
    cfg = load_config(None, {"model": {"n_layers": max(a.pp * a.virtual, 1)},
                             "parallel": {"pp": a.pp, "pp_virtual": a.virtual, "pp_schedule": a.schedule},
                             "train": {"global_batch": a.micro_batches, "micro_batch": 1}})
    validate(cfg)
    from fivefold.config.file_errors import guarded, need_output_file
    from fivefold.tools.schedule_plot import draw_schedule

    need_output_file(a.out, "--out", "give the path of a .png file to write")
    with guarded(a.out, "write", "or give --out another path"):
        bubble = draw_schedule(a.schedule, a.pp, a.virtual, a.micro_batches, a.out)
    print(f"wrote {a.out}: {a.schedule}, pp={a.pp}, {a.virtual} stage(s)/rank, {a.micro_batches} "
          f"micro-batches, bubble {100 * bubble:.1f}%")
    return 0


def cmd_convert(args: list[str]) -> int:
    """fivefold checkpoint (any layout) -> Hugging Face folder, or the reverse; direction from SRC.
    A LoRA checkpoint -> PEFT adapter folder, or with --merge the merged model's folder."""
    merge = "--merge" in args
    args = [a for a in args if a != "--merge"]
    base = ""
    if "--base" in args:
        at = args.index("--base")
        base = args[at + 1] if at + 1 < len(args) else ""
        args = args[:at] + args[at + 2:]
    if len(args) != 2 or any(a.startswith("-") for a in args) or (base == "" and "--base" in args) or base.startswith("-"):
        raise ConfigError("usage: fivefold convert [--merge] [--base FOLDER] SRC DST (a fivefold checkpoint and a "
                          "Hugging Face folder, either way round; --merge: a LoRA checkpoint's adapters merged into "
                          "its base; --base: that base's folder, when it is not where the checkpoint says)")
    from fivefold.tools.convert import convert

    print(convert(*args, merge=merge, base=base))
    return 0


def cmd_prepare(args: list[str]) -> int:
    """Tokenize text/jsonl/parquet/Arrow files, folders or globs into a prepared folder (data.source)."""
    parser = _prepare_parser()
    own, unknown = parser.parse_known_args(args)
    if unknown or not own.out or not own.sources:
        raise ConfigError("usage: fivefold prepare SRC... --tokenizer byte|TOKENIZER.json --out DIR "
                          "[--workers N] [--text-field text] [--chat --seq-len L [--chat-template FILE] "
                          "[--train-roles assistant]]" + (f" (unknown: {' '.join(unknown)})" if unknown else ""))
    import time

    from fivefold.data.prepare import prepare, summary

    chat = None
    if own.chat:
        from fivefold.data.prepare_chat import chat_settings

        chat = chat_settings(own.tokenizer, own.seq_len, own.chat_template, own.train_roles)
    elif own.seq_len or own.chat_template or own.train_roles != "assistant":
        raise ConfigError("--seq-len, --chat-template and --train-roles describe chat data; add --chat")
    start = time.perf_counter()
    manifest = prepare(own.sources, own.tokenizer, own.out, own.workers or None, own.text_field, chat=chat)
    print(summary(manifest, own.out, time.perf_counter() - start))
    return 0


def cmd_generate(args: list[str]) -> int:
    """A sample from a trained checkpoint: the prompt and its continuation."""
    a = _generate_parser().parse_args(args)
    if a.tokenizer not in ("", "byte") and os.path.isfile(a.tokenizer):
        # A damaged --tokenizer is said before torch and the model load (minutes, for a large model).
        from fivefold.config.tokenizer_file import read_tokenizer

        read_tokenizer(a.tokenizer, "--tokenizer")
    from fivefold.tools.generate import generate

    text, _ = generate(a.checkpoint, a.prompt, a.tokens, a.temperature, a.seed, a.tokenizer, a.chat, a.system,
                       a.chat_template, a.base)
    print(text)
    return 0


def cmd_report(args: list[str]) -> int:
    """A run's metrics drawn as pictures in RUN_DIR/report/."""
    if len(args) != 1 or args[0].startswith("-"):
        raise ConfigError("usage: fivefold report RUN_DIR (the log.dir of a run)")
    from fivefold.tools.report import draw_report

    drawn = draw_report(args[0])
    print(f"wrote {len(drawn)} pictures to {args[0].rstrip('/')}/report: "
          + "; ".join(f"{name} ({', '.join(titles)})" for name, titles in drawn.items()))
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "layout": cmd_layout, "config": cmd_config, "plan": cmd_plan, "viz": cmd_viz,
            "convert": cmd_convert, "generate": cmd_generate, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print(f"fivefold {cli_help.version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(cli_help.main_help())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command '{argv[0]}'; the commands are {', '.join(cli_help.COMMANDS)} "
              "(see `fivefold --help`)", file=sys.stderr)
        return 2
    if argv[0] != "plan" and {"-h", "--help"} & set(argv[1:]):  # the planner prints its own
        parser = PARSERS.get(argv[0])
        print(cli_help.command_help(argv[0], parser().format_help() if parser else ""))
        return 0
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file no guarded read or write expected to fail: still one sentence
        if not err.filename:
            raise
        from fivefold.config.file_errors import os_problem

        print(f"error: {os_problem(err.filename, err, 'use')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
