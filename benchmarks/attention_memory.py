"""Peak memory and CPU step time of tiny-gpt-oss with sliding windows and attention sinks, against
the same model without them, and against the quadratic attention they replaced (issue 40, item 3).

    OMP_NUM_THREADS=1 python benchmarks/attention_memory.py             # ~1 minute on 2 CPU cores
    python benchmarks/attention_memory.py --seq 4096 --repeats 3

Variants, each the preset's model (fp32, seed 0) on one sequence of random tokens:
- plain: model.attention_sinks=false, model.sliding_window=0 (full causal attention everywhere,
  PyTorch's fused SDPA): "the same model without them";
- blockwise: the preset (16-token window in layers 0 and 2, sinks in every layer), attention by
  models/attention/masked.py as it runs now;
- quadratic: the preset with the attention it replaced (fivefold 7c23664: fp32 (heads, seq, seq)
  scores with sinks, a (seq, seq) boolean mask without), patched in for comparison;
- blockwise+documents, quadratic+documents: the same two with the sequence packed from 4
  documents (document masks).

Memory: each variant runs in a fresh subprocess: one warm-up forward + backward (so that the
gradients' buffers and lazy state exist), then the peak resident set size is reset
(`/proc/self/clear_refs` ← 5, Linux's "reset VmHWM") and one more forward + backward is measured:
peak = VmHWM after it − VmRSS before it. Why this and not ru_maxrss: ru_maxrss is the process's
high-water mark since it started, so model building or a warm-up step can hide the step's own peak;
resetting VmHWM measures exactly this step. glibc's mmap threshold is pinned at 64 KiB
(MALLOC_MMAP_THRESHOLD_) so that every tensor of some size is its own mapping, returned on free:
resident memory then follows live tensors instead of the heap's caching. The subprocess also
reports the bytes autograd saves for backward (saved_tensors_hooks, each storage once, parameters
excluded): exact, the part of the peak that lives across the step.

Time: all variants alternate in one process (OMP threads as set), `--repeats` rounds of
`--steps` timed forward + backward each after a warm-up; the median per variant and the ratios are
printed: blockwise / quadratic is "after / before", blockwise / plain the price of the window and
sinks. Timed at `--time-seqs` (the tests' short sequences and the memory run's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "blockwise", "quadratic", "blockwise+documents", "quadratic+documents")


def _model(variant: str):
    import torch

    from fivefold.configure import load_config
    from fivefold.models import build_model

    overrides = {"preset": "tiny-gpt-oss"}
    if variant == "plain":
        overrides.update(attention_sinks=False, sliding_window=0, full_attention_every=0)
    cfg = load_config(None, {"model": overrides}).model
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # sinks as a trained model has them (initialised to zero otherwise)
        for name, p in model.named_parameters():
            if name.endswith("sinks.weight"):
                p.copy_(torch.linspace(-2, 2, p.numel()))
    if variant.startswith("quadratic"):
        import fivefold.models.decoder as decoder

        decoder.masked_attention = quadratic_attention
    return model, cfg


def quadratic_attention(q, k, v, window=0, documents=None, sinks=None):
    """models/attention/masked.py as of 7c23664 (SDPA with a (seq, seq) mask; fp32 scores with sinks)."""
    import torch.nn.functional as F

    from fivefold.models.attention.masked import allowed_keys, sink_attention

    mask = allowed_keys(q.shape[2], q.device, window, documents)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return sink_attention(q, k, v, mask, sinks)


def _batch(variant: str, cfg, batch: int, seq: int):
    import torch

    from fivefold.models.attention.documents import document_positions

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    documents = positions = None
    if variant.endswith("+documents"):
        documents = (torch.arange(seq)[None, :] >= torch.tensor([[seq // 5], [seq // 2], [seq - 100]])).sum(0)
        documents = documents.expand(batch, seq).contiguous()
        positions = document_positions(documents)
    return tokens[:, :-1], tokens[:, 1:], documents, positions


def _step(model, inputs, targets, documents, positions):
    import torch.nn.functional as F

    logits = model(inputs, positions=positions, documents=documents)
    F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def child(variant: str, seq: int) -> dict:
    """One variant's memory, measured in this (fresh) process."""
    import gc

    import torch

    model, cfg = _model(variant)
    inputs, targets, documents, positions = _batch(variant, cfg, 1, seq)
    _step(model, inputs, targets, documents, positions)  # warm-up: gradients exist from here on
    saved = {"bytes": 0, "seen": set()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in saved["seen"] and key not in params:
            saved["seen"].add(key)
            saved["bytes"] += t.untyped_storage().nbytes()
        return t

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size to the current one
    before = _status_kib("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(model, inputs, targets, documents, positions)
    peak = _status_kib("VmHWM")
    return {"variant": variant, "seq": seq, "peak_mib": (peak - before) / 1024,
            "saved_mib": saved["bytes"] / 2 ** 20}


def measure_memory(seq: int) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    rows = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--seq", str(seq)], env=env,
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def measure_time(seq: int, batch: int, steps: int, repeats: int) -> dict[str, float]:
    """Median seconds per forward + backward of each variant, alternating in this process."""
    import fivefold.models.decoder as decoder
    from fivefold.models.attention.masked import masked_attention

    runs = {}
    for variant in VARIANTS:
        model, cfg = _model(variant)
        decoder.masked_attention = masked_attention  # each variant patches on its own run only
        runs[variant] = (model, _batch(variant, cfg, batch, seq))
    times = {variant: [] for variant in VARIANTS}
    for _ in range(repeats):
        for variant, (model, batch_) in runs.items():
            decoder.masked_attention = quadratic_attention if variant.startswith("quadratic") else masked_attention
            _step(model, *batch_[:2], *batch_[2:])  # warm-up
            start = time.perf_counter()
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                _step(model, *batch_[:2], *batch_[2:])
            times[variant].append((time.perf_counter() - start) / steps)
    decoder.masked_attention = masked_attention
    return {variant: statistics.median(ts) for variant, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--time-seqs", default="64x8,1024x1", help="SEQxBATCH,... to time")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seq)))
        return
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    rows = measure_memory(args.seq)
    plain = next(r for r in rows if r["variant"] == "plain")
    print(f"\nPeak memory of one forward + backward, tiny-gpt-oss, batch 1, seq {args.seq} (MiB):")
    print(f"{'variant':<22}{'peak':>10}{'x plain':>10}{'saved':>10}{'x plain':>10}")
    for r in rows:
        print(f"{r['variant']:<22}{r['peak_mib']:>10.1f}{r['peak_mib'] / plain['peak_mib']:>10.2f}"
              f"{r['saved_mib']:>10.1f}{r['saved_mib'] / plain['saved_mib']:>10.2f}")
    for spec in args.time_seqs.split(","):
        seq, batch = (int(x) for x in spec.split("x"))
        t = measure_time(seq, batch, args.steps, args.repeats)
        print(f"\nForward + backward time, seq {seq} batch {batch} (median of {args.repeats} x {args.steps} steps):")
        for variant, s in t.items():
            print(f"{variant:<22}{s * 1e3:>9.1f} ms")
        print(f"blockwise / quadratic = {t['blockwise'] / t['quadratic']:.2f}, "
              f"blockwise / plain = {t['blockwise'] / t['plain']:.2f}, "
              f"with documents: blockwise / quadratic = {t['blockwise+documents'] / t['quadratic+documents']:.2f}")


if __name__ == "__main__":
    main()
