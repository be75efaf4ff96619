"""Peak host memory of the language-model loss at a 32K vocabulary: plain F.cross_entropy on fp32
logits, the chunked loss of logits (models/loss/cross_entropy.py), and the output layer fused with its
loss (models/loss/linear_cross_entropy.py, what training runs), which never makes the logits.

Each measurement runs in a fresh subprocess (`--one plain|chunked`), so no allocator state carries
over. It holds the hidden states h (tokens, dim) and the output weight W (vocab, dim), resets the
process's peak resident set (Linux: writing 5 to /proc/self/clear_refs resets VmHWM to the current
VmRSS), then runs what a training step runs from there: logits = h Wᵀ in the compute dtype and the loss
(plain, chunked), or the fused loss of h and W, and backward to h and W (its wall time is printed
too: one step, noisy on a shared CPU). Two figures, both against the whole fp32 logits
(tokens · vocab · 4 bytes):

    beyond inputs = VmHWM - VmRSS at the reset        (what the step adds to h and W, logits included)
    extra         = beyond inputs - the compute-dtype logits the loss was handed (none when fused)

"extra" is the loss's own memory given that logits exist; "beyond inputs" is what the fused layer
removes too: the logits themselves. It includes the
gradients of h and W where they are alive at the peak (small at dim 64: 9 MiB at vocab 32768), and
resident memory counts whole pages and any memory the allocator keeps after a free, so it can only
overstate the loss's own extra. The measuring process runs with glibc's MALLOC_MMAP_THRESHOLD_
fixed at 64 KiB (the script re-executes itself with it): every tensor buffer is then its own
mapping, returned to the system when freed, so resident memory follows the live tensors and memory
kept by the allocator from the warm-up step cannot hide in the baseline. Where clear_refs cannot be written the fresh
process's ru_maxrss (getrusage) is used instead, the baseline being its value before the step.

    OMP_NUM_THREADS=1 python benchmarks/loss_memory.py                 # the three losses, fp32 and bf16
    python benchmarks/loss_memory.py --one chunked --dtype bf16 --json # one measurement (the test's)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

KIB = 1024
MMAP_THRESHOLD = str(64 * KIB)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> tuple[int, str]:
    """(resident bytes now, how the peak is read)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS"), "VmHWM"
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB, "ru_maxrss"


def _peak(how: str) -> int:
    return _status("VmHWM") if how == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB


def measure(which: str, dtype_name: str, tokens: int, vocab: int, dim: int) -> dict:
    import torch
    import torch.nn.functional as F

    from fivefold.models.loss.linear_cross_entropy import linear_cross_entropy
    from fivefold.parallel.loss import LMLoss

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    h = torch.randn(1, tokens, dim, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, dim, dtype=dtype) * dim ** -0.5).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    loss_fn = LMLoss()

    def step():
        if which == "fused":
            loss = linear_cross_entropy(h, w, labels) / labels.numel()
            loss.backward()
            return loss.detach()
        logits = F.linear(h, w)
        if which == "plain":
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        else:
            loss = loss_fn(logits, labels)
        del logits
        loss.backward()
        return loss.detach()

    step()  # once to warm up the allocator and lazily created state
    h.grad = w.grad = None
    base, how = _reset_peak()
    start = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - start
    peak = _peak(how)
    element = torch.empty((), dtype=dtype).element_size()
    logits_bytes = 0 if which == "fused" else tokens * vocab * element
    fp32_logits = tokens * vocab * 4
    beyond = peak - base
    extra = beyond - logits_bytes
    return {"loss": which, "dtype": dtype_name, "tokens": tokens, "vocab": vocab, "dim": dim,
            "peak_read": how, "value": float(loss), "fp32_logits_MiB": fp32_logits / 2 ** 20,
            "extra_MiB": extra / 2 ** 20, "extra_over_fp32_logits": extra / fp32_logits,
            "beyond_inputs_MiB": beyond / 2 ** 20, "beyond_inputs_over_fp32_logits": beyond / fp32_logits,
            "step_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=["plain", "chunked", "fused"], help="measure one loss in this process")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.one:
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:  # see the module doc
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD_="0")
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
        result = measure(args.one, args.dtype, args.tokens, args.vocab, args.dim)
        print(json.dumps(result) if args.json else result)
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"tokens {args.tokens}, vocab {args.vocab}, dim {args.dim}: whole fp32 logits "
          f"{args.tokens * args.vocab * 4 / 2 ** 20:.0f} MiB")
    print(f"{'dtype':6} {'loss':8} {'beyond inputs MiB':>18} {'x fp32 logits':>14} {'extra MiB':>10} "
          f"{'x fp32 logits':>14} {'loss value':>12} {'step s':>7}")
    for dtype in ("fp32", "bf16"):
        for which in ("plain", "chunked", "fused"):
            out = subprocess.run([sys.executable, __file__, "--one", which, "--dtype", dtype, "--tokens",
                                  str(args.tokens), "--vocab", str(args.vocab), "--dim", str(args.dim), "--json"],
                                 capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{dtype:6} {which:8} {r['beyond_inputs_MiB']:18.1f} {r['beyond_inputs_over_fp32_logits']:14.3f} "
                  f"{r['extra_MiB']:10.1f} {r['extra_over_fp32_logits']:14.3f} {r['value']:12.6f} "
                  f"{r['step_s']:7.3f}   (peak read from {r['peak_read']})")


if __name__ == "__main__":
    main()
