"""What a step reports: console progress, `metrics.jsonl`, TensorBoard, W&B; the devices' peak for MFU.

Only rank 0 writes. Each metrics.jsonl line is one optimizer step (docs/design.md "Run directory").
MFU itself is the planner's formula (ModelStats.mfu: active parameters, so MoE counts the experts
a token visits), with the peak from the planner's table (plan/hardware.py).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import torch

from fivefold.config import ConfigError
from fivefold.config.file_errors import guarded
from fivefold.plan.peak_flops import device_peak_flops


def peak_flops(device: torch.device, dtype: str, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device, from the planner's table (plan/hardware.py), or None where MFU
    means nothing (CPU, unknown GPU). `override_tflops` (the config's cluster.peak_tflops) wins:
    the same override the planner takes for a GPU the table lacks."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    return device_peak_flops(torch.cuda.get_device_name(device), dtype)


def cuda_memory(device: torch.device) -> dict[str, int]:
    """The CUDA allocator's figures for a step's record (none on CPU): bytes allocated now, bytes its
    cache holds (what other processes cannot use), and the peak allocated since the run began."""
    if device.type != "cuda":
        return {}
    return {"cuda_mem_allocated_bytes": torch.cuda.memory_allocated(device),
            "cuda_mem_reserved_bytes": torch.cuda.memory_reserved(device),
            "cuda_mem_peak_bytes": torch.cuda.max_memory_allocated(device)}


FIX = "or set log.dir to another folder (the checkpoints saved so far are intact)"


class MetricsWriter:
    def __init__(self, run_dir: str, enabled: bool, every: int, total_steps: int, tensorboard: bool,
                 progress: bool = True, wandb_run=None):
        self.enabled, self.every, self.total_steps = enabled, max(1, every), total_steps
        self.progress = progress
        self._wandb = wandb_run  # log.wandb: the same scalars as TensorBoard, by step
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        if run_dir:
            self._path = Path(run_dir) / "metrics.jsonl"
            with guarded(self._path, "write", FIX):
                Path(run_dir).mkdir(parents=True, exist_ok=True)
                self._jsonl = open(self._path, "a", buffering=1)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    print("log.tensorboard=true needs the tensorboard package: pip install 'fivefold[tensorboard]'",
                          file=sys.stderr)
                else:
                    self._tb_dir = Path(run_dir) / "tensorboard"
                    with guarded(self._tb_dir, "write", FIX):
                        _quiet_event_writer_thread()
                        self._tb = SummaryWriter(log_dir=str(self._tb_dir))
        self._start = time.perf_counter()
        self._step_times: list[float] = []

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            with guarded(self._path, "write", FIX):
                self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            with guarded(self._tb_dir, "write", FIX):  # also the writer thread's error, raised again here
                for tag, value in tensorboard_scalars(record).items():
                    self._tb.add_scalar(tag, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(tensorboard_scalars(record), step=record["step"])
        step = record["step"]
        self._step_times.append(record["step_time_s"])
        if self.progress and (step % self.every == 0 or step == self.total_steps or step == 1):
            self.print_line(record)

    def print_line(self, r: dict) -> None:
        elapsed = time.perf_counter() - self._start
        parts = [f"step {r['step']:>5}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        if "val_loss" in r:
            parts.append(f"val {r['val_loss']:.4f}")
        parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}",
                  f"{r['tokens_per_sec']:,.0f} tok/s ({r['tokens_per_sec_per_gpu']:,.0f}/gpu)",
                  f"{r['step_time_s'] * 1000:.0f} ms/step"]
        if r.get("mfu") is not None:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        if r.get("peak_mem_bytes") is not None:
            parts.append(memory_text(r["peak_mem_bytes"], r.get("device_mem_bytes")))
        parts.append(f"{_clock(elapsed)} in, {_clock(self._time_left(r))} left")
        print(" | ".join(parts), flush=True)

    def _time_left(self, r: dict) -> float:
        """The steps left at the mean time of this run's steps after its first (which carries
        compilation and warm-up)."""
        recent = self._step_times[1:] or self._step_times
        return (self.total_steps - r["step"]) * sum(recent) / len(recent)

    def note(self, text: str) -> None:
        if self.enabled and self.progress:
            print(text, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with guarded(self._tb_dir, "write", FIX):
                tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _quiet_event_writer_thread() -> None:
    """TensorBoard writes events from a thread of its own, which keeps the OS's error (a full disk)
    and re-raises it, so Python would print that thread's traceback; the writer raises the same error
    again at its next call on the main thread, where it becomes one sentence. So that thread's
    OSError is not printed; any other thread's error still is."""
    previous = threading.excepthook
    if getattr(previous, "fivefold_quiet", False):
        return

    def hook(args):
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.fivefold_quiet = True
    threading.excepthook = hook


def tensorboard_scalars(record: dict) -> dict[str, float]:
    """A step record's TensorBoard scalars by tag: its top-level numbers, and the per-layer MoE
    figures as `moe/layer{L}/{imbalance|dropped_tokens}` and `moe/layer{L}/{tokens|bias}/expert{e}`
    (one chart per layer and figure, one line per expert)."""
    out = {key: value for key, value in record.items() if isinstance(value, (int, float)) and key != "step"}
    for layer, figures in record.get("moe_layers", {}).items():
        out[f"moe/layer{layer}/imbalance"] = figures["imbalance"]
        out[f"moe/layer{layer}/dropped_tokens"] = figures["dropped_tokens"]
        for name, key in (("tokens", "tokens_per_expert"), ("bias", "expert_bias")):
            for e, value in enumerate(figures.get(key, [])):
                out[f"moe/layer{layer}/{name}/expert{e}"] = value
    return out


class DeadExpertWatch:
    """Counts, per MoE layer and expert, the steps in a row in which the expert received no
    tokens (from the step records' `moe_layers`), and says so once per expert when the count
    reaches `steps` (log.dead_expert_steps; 0 = off): a collapsed router wastes the expert."""

    def __init__(self, steps: int):
        self.steps = steps
        self._idle: dict[tuple[str, int], int] = {}
        self._warned: set[tuple[str, int]] = set()

    def update(self, record: dict) -> list[str]:
        """The warnings this step's record raises (each expert at most once per run)."""
        if self.steps <= 0:
            return []
        lines = []
        for layer, figures in record.get("moe_layers", {}).items():
            for e, tokens in enumerate(figures["tokens_per_expert"]):
                key = (layer, e)
                self._idle[key] = self._idle.get(key, 0) + 1 if tokens == 0 else 0
                if self._idle[key] >= self.steps and key not in self._warned:
                    self._warned.add(key)
                    lines.append(f"MoE layer {layer}, expert {e} has received no tokens for {self._idle[key]} "
                                 f"steps in a row (step {record['step']}): its router ignores it "
                                 "(log.dead_expert_steps sets when this is said; 0 = never)")
        return lines


class NonFiniteSteps:
    """Steps in a row whose loss or gradient norm was not finite. The norm is the same number on
    every rank, so every rank skips such a step's update alike; each is warned, and
    train.max_bad_steps of them in a row stop the run with one sentence."""

    def __init__(self, limit: int, is_main: bool):
        self.limit, self.is_main, self.in_a_row = limit, is_main, 0

    def count(self, record: dict) -> bool:
        """Whether the step was finite; marks a skipped one in its record and warns."""
        if math.isfinite(record["grad_norm"]):
            self.in_a_row = 0
            return True
        record["skipped"] = True
        self.in_a_row += 1
        if self.is_main:
            print(f"warning: step {record['step']}: non-finite gradient norm (loss {record['loss']}); update "
                  f"skipped ({self.in_a_row} in a row)", file=sys.stderr, flush=True)
        return False

    def stop_if_too_many(self, step: int) -> None:
        if self.in_a_row >= self.limit:
            raise ConfigError(f"training stopped at step {step}: the loss or gradient norm was not finite for "
                              f"{self.in_a_row} steps in a row (train.max_bad_steps); lower train.lr, check the "
                              "data, or resume from an earlier checkpoint")


def memory_text(peak: int, device_total: int | None) -> str:
    """A step line's memory: the peak allocated and its share of the device (GiB = 2^30 bytes);
    on CPU the process's peak resident set."""
    if device_total:
        return f"mem {peak / 2**30:.1f} GiB ({100 * peak / device_total:.0f}%)"
    return f"rss {peak / 2**30:.2f} GiB"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
