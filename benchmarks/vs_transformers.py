"""fivefold against the Hugging Face transformers loop a user would otherwise write.

    OMP_NUM_THREADS=1 python benchmarks/vs_transformers.py [--rounds 5] [--steps 8] [--warmup 2]
        [--dim 256 --n-layers 4 ...] [--preset llama3-1b] [--seq-len 128 --batch 8]
        [--dtype fp32|bf16] [--clock cpu|wall] [--compile] [--json]

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

`--compile` adds the compiled loops, all four alternating: fivefold with `train.compile = true`
(Inductor per block) and transformers with `torch.compile(model)`. Each has its own Inductor cache
(TORCHINDUCTOR_CACHE_DIR), empty before its first round: that compile time is the cold one; every
later round resets Dynamo first, so it compiles again with Inductor's caches warm (on disk, and
in this process), about what a second run of the same shape pays. Compile seconds are torch's own count (Dynamo frames and backward graphs).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import fivefold.train.trainer as trainer_module

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: cpu_roofline

from fivefold.config import Config
from fivefold.configure import load_config
from fivefold.data.batches import GlobalBatchSampler, load_splits
from fivefold.train.trainer import train

# A shape where the matmuls dominate on a CPU but a round still takes seconds.
CPU_SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=256,
                 tie_embeddings=True, rope_theta=10000.0, rope_scaling=0.0, max_seq_len=1024)


def make_config(model: dict, seq_len: int, batch: int, steps: int, dtype: str = "fp32",
                compile: bool = False, recompute: str = "none", preset: str | None = None,
                fp8: str = "") -> Config:
    model = dict(model)
    if preset:
        model["preset"] = preset
    return load_config(None, {
        "model": model,
        "train": {"seq_len": seq_len, "global_batch": batch, "micro_batch": batch, "steps": steps,
                  "warmup": 2, "eval_every": 0, "dtype": dtype, "compile": compile,
                  "recompute": recompute, "schedule": "constant", "fp8": fp8},
        "log": {"progress": False, "every": 10**9},
    })


# On a machine shared with other jobs the wall clock mostly measures preemption. With one thread per
# process, the process's CPU time is the work done; `--clock cpu` times both loops with it (CPU only).
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fivefold_round(cfg: Config, warmup: int) -> tuple[float, float]:
    """(median seconds per step, compile seconds) of a fivefold run (the trainer's own step_time_s,
    taken with `clock`, and its compile_s)."""
    saved = trainer_module.time
    trainer_module.time = _Clock()  # the trainer times its steps with time.perf_counter()
    try:
        records = train(cfg).records
    finally:
        trainer_module.time = saved
    times = [r["step_time_s"] for r in records][warmup:]
    compile_s = sum(r.get("compile_s", 0.0) for r in records)
    del records
    gc.collect()
    return statistics.median(times), compile_s


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


def transformers_round(cfg: Config, warmup: int, device: torch.device, compiled: bool = False) -> tuple[float, float]:
    """What a user writes with transformers: model, AdamW, autocast, clip, loop (`compiled`: with
    torch.compile(model), the one line the transformers docs suggest). (median step, compile s)."""
    from fivefold.torch_internals import compile_seconds

    t = cfg.train
    model = hf_model(cfg, device)
    model.train()
    compiled_before = compile_seconds()
    if compiled:
        model = torch.compile(model)
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
    compile_s = compile_seconds() - compiled_before
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[warmup:]), compile_s


def compare(cfg: Config, rounds: int, warmup: int, device: torch.device, log=print) -> dict:
    """Alternate the two `rounds` times; tokens/s from the median of the per-round medians."""
    tokens = cfg.train.global_batch * cfg.train.seq_len
    ours, theirs = [], []
    for r in range(rounds):
        ours.append(fivefold_round(cfg, warmup)[0])
        theirs.append(transformers_round(cfg, warmup, device)[0])
        log(f"  round {r + 1}: fivefold {ours[-1] * 1e3:.1f} ms/step, transformers "
            f"{theirs[-1] * 1e3:.1f} ms/step")
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    return {"fivefold_tokens_per_sec": tokens / ours_s, "transformers_tokens_per_sec": tokens / theirs_s,
            "ratio": theirs_s / ours_s,
            # the same-round pairs share the machine's load: their median ratio is the robust figure
            "paired_ratio": statistics.median(t / o for o, t in zip(ours, theirs)),
            "fivefold_step_s": ours_s, "transformers_step_s": theirs_s,
            "rounds_fivefold_s": ours, "rounds_transformers_s": theirs}


LOOPS = ("fivefold eager", "fivefold compiled", "transformers eager", "transformers compiled")


def compare_compiled(cfg: Config, rounds: int, warmup: int, device: torch.device, log=print) -> dict:
    """The four loops alternating `rounds` times: median step seconds, cold and cached compile
    seconds of the compiled ones, and the same-round ratios of each against the others."""
    import dataclasses

    compiled_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile="true"))
    runs = {
        "fivefold eager": lambda: fivefold_round(cfg, warmup),
        "fivefold compiled": lambda: fivefold_round(compiled_cfg, warmup),
        "transformers eager": lambda: transformers_round(cfg, warmup, device),
        "transformers compiled": lambda: transformers_round(cfg, warmup, device, compiled=True),
    }
    steps = {name: [] for name in LOOPS}
    compiles = {name: [] for name in LOOPS if "compiled" in name}
    caches = {name: tempfile.mkdtemp(prefix="inductor-cache-") for name in compiles}  # empty: round 1 is cold
    for r in range(rounds):
        for name in LOOPS:
            if name in caches:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = caches[name]
                torch._dynamo.reset()  # compile again, from the disk caches after round 1
            step_s, compile_s = runs[name]()
            steps[name].append(step_s)
            if name in compiles:
                compiles[name].append(compile_s)
        log(f"  round {r + 1}: " + ", ".join(f"{n} {steps[n][-1] * 1e3:.1f} ms" for n in LOOPS) + "; compile "
            + ", ".join(f"{n} {compiles[n][-1]:.1f} s" for n in compiles))
    tokens = cfg.train.global_batch * cfg.train.seq_len
    median = {n: statistics.median(v) for n, v in steps.items()}

    def paired(a: str, b: str) -> float:  # > 1: a is faster than b, the median of same-round ratios
        return statistics.median(y / x for x, y in zip(steps[a], steps[b]))

    return {"step_s": median, "tokens_per_sec": {n: tokens / v for n, v in median.items()},
            "rounds_s": steps,
            "compile_cold_s": {n: v[0] for n, v in compiles.items()},
            "compile_cached_s": {n: statistics.median(v[1:]) if len(v) > 1 else None for n, v in compiles.items()},
            "ratios": {f"{a} / {b}": paired(a, b) for a, b in (
                ("fivefold compiled", "transformers eager"), ("fivefold compiled", "transformers compiled"),
                ("fivefold eager", "transformers eager"), ("fivefold compiled", "fivefold eager"),
                ("transformers compiled", "transformers eager"))}}


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
    p.add_argument("--compile", action="store_true", help="also the compiled loops of both (four, alternating)")
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
    if args.compile:
        return report_compiled(cfg, args, device)
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


def report_compiled(cfg: Config, args, device: torch.device) -> None:
    result = compare_compiled(cfg, args.rounds, args.warmup, device, log=lambda s: print(s, flush=True))
    if device.type == "cpu":
        from cpu_roofline import DTYPES, cpu_mfu, roofline

        peak, _ = roofline(cfg.model, args.batch * args.seq_len, DTYPES[cfg.train.dtype])
        result["cpu_mfu"] = {n: cpu_mfu(cfg, s, peak) for n, s in result["step_s"].items()}
        print(f"roofline {peak / 1e9:.1f} GFLOP/s")
    print("| loop | ms/step | tokens/s |" + (" CPU MFU |" if "cpu_mfu" in result else "") + " compile cold / cached |")
    print("|---|---:|---:|" + ("---:|" if "cpu_mfu" in result else "") + "---|")
    for name in LOOPS:
        mfu = f" {result['cpu_mfu'][name]:.1%} |" if "cpu_mfu" in result else ""
        cold, cached = result["compile_cold_s"].get(name), result["compile_cached_s"].get(name)
        compile_text = f"{cold:.1f} s / {cached:.1f} s" if cold is not None and cached is not None else (
            f"{cold:.1f} s / -" if cold is not None else "-")
        print(f"| {name} | {result['step_s'][name] * 1e3:.1f} | {result['tokens_per_sec'][name]:.0f} |{mfu} "
              f"{compile_text} |")
    for pair, ratio in result["ratios"].items():
        print(f"{pair}: {ratio:.3f} (median of same-round ratios)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
