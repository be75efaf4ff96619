"""One line about the machine a test run is on, printed first by .ci/run: the CPU model, the code
path torch dispatches its kernels to (ATEN_CPU_CAPABILITY overrides it), the BLAS torch was built
with, and cores, so that a numerical failure can be read against the machine that produced it."""

from __future__ import annotations

import os
import platform
import re


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    import torch

    found = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    blas = found.group(1) if found else "unknown"
    if blas == "mkl":  # MKL's own code path follows the CPU too (MKL_ENABLE_INSTRUCTIONS caps it)
        blas += " " + re.sub(r"-Product.*", "", next((line.split("Library Version ")[1] for line in
                                                      torch.__config__.parallel_info().splitlines()
                                                      if "Library Version" in line), "")).strip()
    forced = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")
              if k in os.environ}
    return (f"machine: {cpu_model()}; {os.cpu_count()} cores; torch {torch.__version__} dispatches "
            f"{torch.backends.cpu.get_cpu_capability()}; BLAS {blas}"
            + ("; " + ", ".join(f"{k}={v}" for k, v in forced.items()) if forced else ""))


if __name__ == "__main__":
    print(describe(), flush=True)
