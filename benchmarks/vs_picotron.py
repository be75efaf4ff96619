"""fivefold's multi-rank step against picotron's on the same model, batch and ranks (CPU, gloo).

    git clone https://github.com/huggingface/picotron /tmp/picotron   # any machine with the registry
    OMP_NUM_THREADS=1 python benchmarks/vs_picotron.py --picotron /tmp/picotron \
        [--layouts single,dp2,tp2,pp2,dp2tp2] [--settings identical,default] [--rounds 5] [--steps 6]
        [--warmup 2] [--json out.json]

Each layout is one spawn of its ranks (one thread each, one gloo group). Inside it the two
frameworks alternate, `--rounds` times each, so the machine's load hits both alike:
- fivefold: `fivefold.train.trainer.train(cfg)`; a step's time is the trainer's `step_time_s`.
- picotron: its own modules from the clone: `Llama`, `apply_tensor_parallel`, `PipelineParallel`,
  `DataParallelBucket`, and the step of its `train.py` (`train_step`, or `train_step_pipeline_1f1b`
  under pp), `average_loss_across_dp_cp_ranks`, AdamW, `model.reset()`; timed as train.py times it.
A round's time is rank 0's median step after `--warmup` steps (wall clock: ranks wait for each
other, and that waiting is part of the step); the ratio is picotron's time over fivefold's per
round, and its median over rounds is reported (> 1: fivefold is faster).

Settings:
- `identical`: what picotron does, fivefold set to match: tensor parallelism without sequence
  parallelism (picotron's tp all-reduces), no gradient clipping, the same micro-batches, 1F1B.
- `default`: each as it ships: fivefold's defaults (sequence parallelism on, clipping at 1.0),
  picotron's (the same as above: it has no other).
- `compiled` (not in the default list): `identical` with `train.compile = true` (Inductor blocks;
  the compile time falls in the warm-up steps, which are not timed).
Both: fp32, dim 256, 4 layers, 8 heads (4 KV), FFN 768, vocab 256, untied output, seq 256, global
batch 8 (micro-batches of 2 under pp: 4 per step), the same random token batches.

To run picotron on a CPU the benchmark (not picotron) stands in for what it needs of CUDA: its
model file imports flash-attn at the top (empty modules here; `FLASH_ATTEN=0` takes its SDPA and
PyTorch RMSNorm path, the one its CPU mode uses) and its pipeline calls `torch.cuda.synchronize()`
after every send and receive (a no-op here: gloo's waits already completed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: spawn

from spawn import run_on_ranks

SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=256, tie_embeddings=False,
             rope_theta=10000.0, rope_scaling=0.0, max_seq_len=1024)
SEQ, BATCH, PP_MICRO = 256, 8, 2
LAYOUTS = {"single": {}, "dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2tp2": {"dp": 2, "tp": 2}}


def world(layout: dict) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)


def micro_batch(layout: dict) -> int:
    return PP_MICRO if layout.get("pp", 1) > 1 else BATCH // layout.get("dp", 1)


def fivefold_config(layout: dict, settings: str, steps: int):
    from fivefold.configure import load_config

    parallel = {"dp": layout.get("dp", 1), "tp": layout.get("tp", 1), "pp": layout.get("pp", 1)}
    train = {"seq_len": SEQ, "global_batch": BATCH, "micro_batch": micro_batch(layout), "steps": steps,
             "warmup": 2, "eval_every": 0, "schedule": "constant", "lr": 3e-4}
    if settings in ("identical", "compiled"):
        parallel["sp"] = False
        train["grad_clip"] = 0.0
    if settings == "compiled":
        train["compile"] = "true"
    return load_config(None, {"model": dict(SHAPE), "parallel": parallel, "train": train,
                              "log": {"progress": False, "every": 10**9}})


def fivefold_round(layout: dict, settings: str, steps: int, warmup: int) -> float:
    from fivefold.train.trainer import train

    records = train(fivefold_config(layout, settings, steps)).records
    return statistics.median(r["step_time_s"] for r in records[warmup:])


def _stand_in_for_cuda() -> None:
    """What picotron needs of CUDA and flash-attn on a CPU (module docstring)."""
    import torch

    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.layers", "flash_attn.layers.rotary",
                 "flash_attn.ops", "flash_attn.ops.triton", "flash_attn.ops.triton.layer_norm"):
        module = sys.modules.setdefault(name, types.ModuleType(name))
        for attr in ("flash_attn_func", "apply_rotary_emb", "layer_norm_fn"):
            setattr(module, attr, None)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    os.environ.update(FLASH_ATTEN="0", DEVICE="cpu", DTYPE="float32", CONTEXT_PARALLEL="0")


class _Batches:
    """The part of picotron's MicroBatchDataLoader its train steps use: grad_acc_steps and next()."""

    def __init__(self, micro: int, grad_acc_steps: int, rank_seed: int):
        import torch

        self.micro, self.grad_acc_steps = micro, grad_acc_steps
        self.generator = torch.Generator().manual_seed(rank_seed)

    def __next__(self) -> dict:
        import torch

        tokens = torch.randint(0, SHAPE["vocab_size"], (self.micro, SEQ + 1), generator=self.generator)
        return {"input_ids": tokens[:, :-1], "target_ids": tokens[:, 1:],
                "position_ids": torch.arange(SEQ).expand(self.micro, SEQ)}


class Picotron:
    """picotron's model, layout and optimizer for `layout`, built once per spawn (its process
    groups are made once, as its train.py makes them)."""

    def __init__(self, clone: str, layout: dict):
        import torch

        _stand_in_for_cuda()
        sys.path.insert(0, clone)
        import picotron.process_group_manager as pgm
        from picotron.data_parallel.data_parallel import DataParallelBucket
        from picotron.model import Llama
        from picotron.pipeline_parallel.pipeline_parallel import PipelineParallel
        from picotron.tensor_parallel.tensor_parallel import apply_tensor_parallel

        import train as picotron_train  # the clone's train.py: its step functions

        self.pgm, self.train_module = pgm, picotron_train
        pgm.setup_process_group_manager(tp_size=layout.get("tp", 1), cp_size=1, pp_size=layout.get("pp", 1),
                                        dp_size=layout.get("dp", 1))
        # The attributes picotron reads of a transformers LlamaConfig (transformers 5 moved rope_theta).
        self.config = types.SimpleNamespace(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["dim"],
                                            intermediate_size=SHAPE["ffn_dim"], num_hidden_layers=SHAPE["n_layers"],
                                            num_attention_heads=SHAPE["n_heads"],
                                            num_key_value_heads=SHAPE["n_kv_heads"], max_position_embeddings=SEQ,
                                            rms_norm_eps=1e-5, rope_theta=SHAPE["rope_theta"])
        torch.manual_seed(0)
        model = Llama(config=self.config)
        manager = pgm.process_group_manager
        if manager.tp_world_size > 1:
            model = apply_tensor_parallel(model)
        if manager.pp_world_size > 1:
            model = PipelineParallel(model, self.config)
        if manager.dp_world_size > 1:
            model = DataParallelBucket(model)
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        self.micro = micro_batch(layout)
        grad_acc = BATCH // layout.get("dp", 1) // self.micro
        self.batches = _Batches(self.micro, grad_acc, rank_seed=manager.dp_rank)

    def round(self, steps: int, warmup: int) -> float:
        import torch

        manager, device = self.pgm.process_group_manager, torch.device("cpu")
        times = []
        for _ in range(steps):  # train.py's loop body, without its logging and checkpoints
            start = time.perf_counter()
            self.optimizer.zero_grad()
            if manager.pp_world_size > 1:
                shapes = (self.micro, SEQ, self.config.hidden_size)
                loss = self.train_module.train_step_pipeline_1f1b(self.model, self.batches, shapes, device,
                                                                  torch.float32)
            else:
                loss = self.train_module.train_step(self.model, self.batches, device)
            loss = self.train_module.average_loss_across_dp_cp_ranks(loss, device)
            self.optimizer.step()
            if hasattr(self.model, "reset"):
                self.model.reset()
            times.append(time.perf_counter() - start)
        return statistics.median(times[warmup:])


def compare_on_rank(clone: str, layout: dict, settings: list[str], rounds: int, steps: int, warmup: int) -> dict:
    """One spawn: picotron built once, then rounds alternating fivefold (each setting) and picotron."""
    picotron = Picotron(clone, layout)
    out = {"picotron": [], **{f"fivefold {s}": [] for s in settings}}
    for _ in range(rounds):
        for s in settings:
            out[f"fivefold {s}"].append(fivefold_round(layout, s, steps, warmup))
        out["picotron"].append(picotron.round(steps, warmup))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--picotron", required=True, help="a clone of github.com/huggingface/picotron")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--settings", default="identical,default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.picotron, "picotron", "model.py")):
        sys.exit(f"--picotron {args.picotron} is not a picotron clone (no picotron/model.py); "
                 "clone github.com/huggingface/picotron and pass its folder")
    settings = args.settings.split(",")
    report = {}
    tokens = BATCH * SEQ
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        rank0 = run_on_ranks(world(layout), compare_on_rank, args.picotron, layout, settings, args.rounds,
                             args.steps, args.warmup)[0]
        theirs = rank0["picotron"]
        row = {"picotron_tokens_per_sec": tokens / statistics.median(theirs), "rounds": rank0}
        for s in settings:
            ours = rank0[f"fivefold {s}"]
            row[f"fivefold_{s}_tokens_per_sec"] = tokens / statistics.median(ours)
            row[f"ratio_{s}"] = statistics.median(t / o for o, t in zip(ours, theirs))
        report[name] = row
        print(f"{name:7s} ranks {world(layout)}: picotron {theirs and statistics.median(theirs) * 1e3:.0f} ms/step; "
              + "; ".join(f"fivefold {s} {statistics.median(rank0[f'fivefold {s}']) * 1e3:.0f} ms/step, "
                          f"{row[f'ratio_{s}']:.3f}x" for s in settings), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
