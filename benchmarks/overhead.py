"""fivefold's single-process training step against a minimal hand-written PyTorch loop.

    python benchmarks/overhead.py [--rounds 5] [--steps 15]

Same model (built by fivefold, same seed), same batches (drawn by fivefold's sampler), same AdamW
and gradient clipping. The two run alternately, `--rounds` times each, in one process, so machine
noise hits both alike; each round's median step time is kept and the ratio of the medians over
rounds is printed (> 1 means fivefold is slower). The first steps of each round are warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fivefold.configure import load_config
from fivefold.models import build_model
from fivefold.data.batches import GlobalBatchSampler, load_splits
from fivefold.train.trainer import train

SHAPE = {"model": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 768},
         "train": {"seq_len": 256, "global_batch": 8, "warmup": 2, "eval_every": 0},
         "log": {"progress": False}}
WARMUP = 3


def fivefold_round(steps: int) -> float:
    cfg = load_config(None, {**SHAPE, "train": {**SHAPE["train"], "steps": steps}})
    times = [r["step_time_s"] for r in train(cfg).records]
    return statistics.median(times[WARMUP:])


def minimal_round(steps: int) -> float:
    """What a user would write by hand: model, AdamW, loop."""
    cfg = load_config(None, {**SHAPE, "train": {**SHAPE["train"], "steps": steps}})
    t = cfg.train
    model = build_model(cfg.model, t.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.weight_decay)
    split, _ = load_splits(cfg.data, t.seq_len, cfg.model.vocab_size)
    sampler = GlobalBatchSampler(split.num_windows, t.global_batch, t.seed)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        batch = split.windows(sampler.indices(step))
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # fivefold reads the loss every step too
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    ours, theirs = [], []
    for round_ in range(args.rounds):
        ours.append(fivefold_round(args.steps))
        theirs.append(minimal_round(args.steps))
        print(f"round {round_ + 1}: fivefold {ours[-1] * 1000:.1f} ms/step, minimal loop "
              f"{theirs[-1] * 1000:.1f} ms/step", flush=True)
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"median step time: fivefold {statistics.median(ours) * 1000:.1f} ms, minimal loop "
          f"{statistics.median(theirs) * 1000:.1f} ms, ratio {ratio:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
