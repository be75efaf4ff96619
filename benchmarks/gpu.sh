#!/usr/bin/env bash
# One GPU, < 9 minutes: MFU and tokens/s of llama3-1b at sequence 4096 (bf16), eager / compiled,
# with and without full recomputation, FP8 (torchao tensorwise) against bf16 compiled and eager,
# compile seconds, and the transformers LlamaForCausalLM + AdamW loop on the same shape. Writes
# benchmarks/gpu_results.md (+ .json).
#
#   bash benchmarks/gpu.sh                 # on a CUDA machine
#   bash benchmarks/gpu.sh --dry-run       # the same code path, tiny shape, CPU, seconds
#   bash benchmarks/gpu.sh --variants eager,transformers --steps 8
#
# Without a CUDA device it falls back to the dry run by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # works without `pip install -e .`
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$py" benchmarks/gpu_bench.py "$@"
