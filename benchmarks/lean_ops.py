"""The ops that keep less for backward against the compositions they replace, one at a time.

    OMP_NUM_THREADS=1 python benchmarks/lean_ops.py [--tokens 1024] [--dim 256] [--ffn 768]
        [--vocab 256] [--calls 60]

Forward and backward of each op (models/rms_norm.py, models/swiglu.py, models/loss/cross_entropy.py)
and of PyTorch's composite of the same math, called alternately `--calls` times each on the same
inputs; the median CPU time of each (one thread: the process's CPU time, so a busy machine's
waiting is not counted). tests/test_lean_ops.py and tests/test_chunked_loss.py check the math.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fivefold.models.loss.cross_entropy import chunked_cross_entropy
from fivefold.models.rms_norm import rms_norm
from fivefold.models.swiglu import swiglu


def _call(fn, inputs) -> float:
    leaves = [x.detach().requires_grad_() for x in inputs]
    start = time.process_time()
    out = fn(*leaves)
    (out.float().sum() if out.dim() else out).backward()
    return time.process_time() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.tokens} tokens")
    print("| op | dtype | fivefold ms | composite ms | ratio |\n|---|---|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        def rand(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        weight = (torch.rand(args.dim, generator=g) + 0.5).to(dtype)
        pairs = {
            "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (args.dim,), w, 1e-6),
                         (rand(args.tokens, args.dim), weight)),
            "swiglu": (swiglu, lambda a, b: F.silu(a) * b, (rand(args.tokens, args.ffn), rand(args.tokens, args.ffn))),
            "cross_entropy": (lambda x: chunked_cross_entropy(x, labels), lambda x: F.cross_entropy(x.float(), labels),
                              (rand(args.tokens, args.vocab),)),
        }
        for name, (ours, composite, inputs) in pairs.items():
            mine, theirs = [], []
            for _ in range(args.calls):
                mine.append(_call(ours, inputs))
                theirs.append(_call(composite, inputs))
            a, b = statistics.median(mine) * 1e3, statistics.median(theirs) * 1e3
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {a:.3f} | {b:.3f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
