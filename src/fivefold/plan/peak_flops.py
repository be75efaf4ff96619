"""The peak FLOP/s of the GPUs the trainer can meet, by the name CUDA reports: MFU's denominator in
`metrics.jsonl` (the planner's own GPU profiles are plan/hardware.py)."""

from __future__ import annotations

TB = 1e12

PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "a100": (312 * TB, 156 * TB),
    "h100": (989 * TB, 494 * TB),
    "h200": (989 * TB, 494 * TB),
    "h800": (989 * TB, 494 * TB),
    "b200": (2250 * TB, 1100 * TB),
    "l40s": (362 * TB, 183 * TB),
}


def device_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a GPU by the name CUDA reports ("NVIDIA H100 80GB HBM3") for a run's dtype
    (bf16 | fp32), or None for a device the table does not know."""
    name = device_name.lower()
    for key, (bf16, tf32) in PEAK_FLOPS.items():
        if key in name:
            return bf16 if dtype == "bf16" else tf32
    return None
