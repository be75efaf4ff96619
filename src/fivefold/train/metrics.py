"""What a step reports: console progress, `metrics.jsonl`, TensorBoard; FLOPs and MFU.

Only rank 0 writes. Each metrics.jsonl line is one optimizer step (DESIGN.md "Run directory").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from fivefold.config import ModelConfig

# Dense bf16 tensor-core peaks (FLOP/s) by the name CUDA reports; fp32 uses TF32 peaks.
PEAK_FLOPS = {  # name fragment: (bf16, fp32)
    "A100": (312e12, 156e12),
    "H100": (989e12, 494e12),
    "H200": (989e12, 494e12),
    "H800": (989e12, 494e12),
    "B200": (2250e12, 1100e12),
    "L40S": (362e12, 183e12),
}


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s of one device, or None where MFU means nothing (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (bf16, fp32) in PEAK_FLOPS.items():
        if fragment in name:
            return bf16 if dtype == "bf16" else fp32
    return None


def cuda_memory(device: torch.device) -> dict[str, int]:
    """The CUDA allocator's figures for a step's record (none on CPU): bytes allocated now, bytes its
    cache holds (what other processes cannot use), and the peak allocated since the run began."""
    if device.type != "cuda":
        return {}
    return {"cuda_mem_allocated_bytes": torch.cuda.memory_allocated(device),
            "cuda_mem_reserved_bytes": torch.cuda.memory_reserved(device),
            "cuda_mem_peak_bytes": torch.cuda.max_memory_allocated(device)}


def matmul_params(cfg: ModelConfig, total_params: int) -> int:
    """Parameters that take part in a matmul per token: all but an untied input embedding table."""
    embedding = cfg.vocab_size * cfg.dim
    return total_params if cfg.tie_embeddings else total_params - embedding


def flops_per_token(cfg: ModelConfig, total_params: int, seq_len: int) -> float:
    """Model FLOPs for forward+backward of one token: 6N + 12·L·d·s (attention scores and values)."""
    return 6 * matmul_params(cfg, total_params) + 12 * cfg.n_layers * cfg.dim * seq_len


class MetricsWriter:
    def __init__(self, run_dir: str, enabled: bool, every: int, total_steps: int, tensorboard: bool,
                 progress: bool = True):
        self.enabled, self.every, self.total_steps = enabled, max(1, every), total_steps
        self.progress = progress
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        if run_dir:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    print("log.tensorboard=true needs the tensorboard package: pip install 'fivefold[tensorboard]'",
                          file=sys.stderr)
                else:
                    self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self._start = time.perf_counter()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
        step = record["step"]
        if self.progress and (step % self.every == 0 or step == self.total_steps or step == 1):
            self.print_line(record)

    def print_line(self, r: dict) -> None:
        elapsed = time.perf_counter() - self._start
        parts = [f"step {r['step']:>5}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        if "val_loss" in r:
            parts.append(f"val {r['val_loss']:.4f}")
        parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}",
                  f"{r['tokens_per_sec']:,.0f} tok/s", f"{r['step_time_s'] * 1000:.0f} ms/step"]
        if r.get("mfu") is not None:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        parts.append(f"{elapsed:.0f}s")
        print(" | ".join(parts), flush=True)

    def note(self, text: str) -> None:
        if self.enabled and self.progress:
            print(text, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
