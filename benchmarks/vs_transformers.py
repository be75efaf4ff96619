"""fivefold against the Hugging Face transformers loop a user would otherwise write.

    OMP_NUM_THREADS=1 python benchmarks/vs_transformers.py [--rounds 5] [--steps 8] [--warmup 2]
        [--dim 256 --n-layers 4 ...] [--preset llama3-1b] [--seq-len 128 --batch 8]
        [--dtype fp32|bf16] [--clock cpu|wall] [--json]

CUDA is used when present (bf16 by default there), else CPU (fp32).

The same Llama shape is trained two ways in one process, alternating, `--rounds` times each:
- fivefold: `fivefold.train.trainer.train(cfg)` (single process; device chosen automatically);
- transformers: `LlamaForCausalLM` (SDPA attention) + `torch.optim.AdamW` + gradient clipping, the
  loop from the transformers docs, under `torch.autocast` for bf16 exactly as fivefold does
  (fp32 master weights), on the same batches (fivefold's sampler), same sequence length, batch,
  learning rate, betas, weight decay and clip norm.
Each round's median step time (after `--warmup` steps; CPU time of the process with one thread on
CPU, `--clock`, else the wall clock with CUDA synchronized) is kept; the medians over rounds give
tokens/s for each and the ratio (> 1: fivefold is faster). Machine noise hits both alike because
they alternate. The first round of each is a warm-up of the allocator/threads and is included.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fivefold.train.trainer as trainer_module

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: cpu_roofline

from fivefold.config import Config, load_config
from fivefold.train.data import GlobalBatchSampler, load_splits
from fivefold.train.trainer import train

# A shape where the matmuls dominate on a CPU but a round still takes seconds.
CPU_SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=256,
                 tie_embeddings=True, rope_theta=10000.0, rope_scaling=0.0, max_seq_len=1024)


def make_config(model: dict, seq_len: int, batch: int, steps: int, dtype: str = "fp32",
                compile: bool = False, recompute: str = "none", preset: str | None = None) -> Config:
    model = dict(model)
    if preset:
        model["preset"] = preset
    return load_config(None, {
        "model": model,
        "train": {"seq_len": seq_len, "global_batch": batch, "micro_batch": batch, "steps": steps,
                  "warmup": 2, "eval_every": 0, "dtype": dtype, "compile": compile,
                  "recompute": recompute, "schedule": "constant"},
        "log": {"progress": False, "every": 10**9},
    })


# On a machine shared with other jobs the wall clock mostly measures preemption. With one thread per
# process, the process's CPU time is the work done; `--clock cpu` times both loops with it (CPU only).
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fivefold_round(cfg: Config, warmup: int) -> float:
    """Median seconds per step of a fivefold run (the trainer's own step_time_s, taken with `clock`)."""
    saved = trainer_module.time
    trainer_module.time = _Clock()  # the trainer times its steps with time.perf_counter()
    try:
        records = train(cfg).records
    finally:
        trainer_module.time = saved
    times = [r["step_time_s"] for r in records][warmup:]
    del records
    gc.collect()
    return statistics.median(times)


class _Clock:
    def perf_counter(self) -> float:
        return clock()


def hf_model(cfg: Config, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    hf_cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                         num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                         num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
                         rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                         tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        return LlamaForCausalLM(hf_cfg)


def transformers_round(cfg: Config, warmup: int, device: torch.device) -> float:
    """What a user writes with transformers: model, AdamW, autocast, clip, loop."""
    t = cfg.train
    model = hf_model(cfg, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.weight_decay)
    split, _ = load_splits(cfg.data, t.seq_len, cfg.model.vocab_size)
    sampler = GlobalBatchSampler(split.num_windows, t.global_batch, t.seed)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if t.dtype == "bf16"
           else contextlib.nullcontext())
    times = []
    for step in range(t.steps):
        sync(device)
        start = clock()
        batch = split.windows(sampler.indices(step)).to(device, non_blocking=True)
        with amp:
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a user logs the loss; fivefold reads it every step too
        times.append(clock() - start)
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[warmup:])


def compare(cfg: Config, rounds: int, warmup: int, device: torch.device, log=print) -> dict:
    """Alternate the two `rounds` times; tokens/s from the median of the per-round medians."""
    tokens = cfg.train.global_batch * cfg.train.seq_len
    ours, theirs = [], []
    for r in range(rounds):
        ours.append(fivefold_round(cfg, warmup))
        theirs.append(transformers_round(cfg, warmup, device))
        log(f"  round {r + 1}: fivefold {ours[-1] * 1e3:.1f} ms/step, transformers "
            f"{theirs[-1] * 1e3:.1f} ms/step")
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    return {"fivefold_tokens_per_sec": tokens / ours_s, "transformers_tokens_per_sec": tokens / theirs_s,
            "ratio": theirs_s / ours_s,
            # the same-round pairs share the machine's load: their median ratio is the robust figure
            "paired_ratio": statistics.median(t / o for o, t in zip(ours, theirs)),
            "fivefold_step_s": ours_s, "transformers_step_s": theirs_s,
            "rounds_fivefold_s": ours, "rounds_transformers_s": theirs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="steps per round, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default=None, help="fp32 (CPU default) or bf16 (CUDA default)")
    p.add_argument("--preset", default=None, help="a fivefold model preset instead of the CPU shape")
    p.add_argument("--json", action="store_true")
    p.add_argument("--clock", choices=CLOCK, default=None,
                   help="step timer: cpu = process CPU time (default on CPU with 1 thread), wall")
    for key, value in CPU_SHAPE.items():
        if isinstance(value, int) and not isinstance(value, bool):
            p.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    global clock
    clock_name = args.clock or ("cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall")
    if clock_name == "cpu" and device.type == "cuda":
        p.error("--clock cpu measures CPU work; on CUDA use --clock wall")
    clock = CLOCK[clock_name]
    model = {} if args.preset else {k: getattr(args, k, v) for k, v in CPU_SHAPE.items()}
    cfg = make_config(model, args.seq_len, args.batch, args.steps, dtype, preset=args.preset)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, clock {clock_name}, dtype {dtype}, "
          f"model {json.dumps(model or args.preset)}, seq {args.seq_len}, batch {args.batch}", flush=True)
    result = compare(cfg, args.rounds, args.warmup, device, log=lambda s: print(s, flush=True))
    if device.type == "cpu":  # the share of this core's own GEMM rate each loop reaches (cpu_roofline.py)
        from cpu_roofline import DTYPES, cpu_mfu, roofline

        peak, _ = roofline(cfg.model, args.batch * args.seq_len, DTYPES[dtype])
        result["roofline_flops_per_s"] = peak
        result["fivefold_cpu_mfu"] = cpu_mfu(cfg, result["fivefold_step_s"], peak)
        result["transformers_cpu_mfu"] = cpu_mfu(cfg, result["transformers_step_s"], peak)
        print(f"roofline {peak / 1e9:.1f} GFLOP/s (this core's fp32 GEMM rate at the model's matmuls); CPU MFU "
              f"fivefold {result['fivefold_cpu_mfu']:.1%}, transformers {result['transformers_cpu_mfu']:.1%}")
    if args.json:
        print(json.dumps(result))
    print(f"fivefold {result['fivefold_tokens_per_sec']:.0f} tok/s, transformers "
          f"{result['transformers_tokens_per_sec']:.0f} tok/s, ratio {result['ratio']:.3f}, median of "
          f"same-round ratios {result['paired_ratio']:.3f} "
          f"(fivefold/transformers tokens/s; goal >= 1.0 on CPU, >= 1.3 on GPU)")


if __name__ == "__main__":
    sys.exit(main())
