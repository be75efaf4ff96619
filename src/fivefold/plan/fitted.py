"""Constants fitted on published runs, each with where it came from. Written by
benchmarks/calibrate_stacks.py (do not edit by hand: rerun the script); the fit set and the rows
held out are declared there and in FIT_SETS below, and its out-of-sample table is in
benchmarks/RESULTS.md.

(The constants fitted before issue 53 — H100's matmul efficiency, the nanotron profile's terms,
the fivefold profiles' elementwise passes, the FP8 speed-up — are still in plan/hardware.py,
fitted by benchmarks/calibrate_time.py.)
"""

# Megatron-core / Transformer Engine's large-GEMM rate over the torch stacks' on the same GPU
# (Runtime.matmul_rate of the `megatron` profile): the share of H100's fitted matmul_efficiency
# that TE's cuBLASLt GEMMs (tuned algorithms, fused epilogues, no framework dispatch between them)
# reach more in a NeMo step.
MEGATRON_MATMUL_RATE = 1.155
# The profile's band: median and 90th percentile of |tokens/s error| leave-one-model-out.
MEGATRON_BAND = (0.047, 0.061)
# Transformer Engine's FP8 GEMM rate over its bf16 one, large GEMMs, casts fused (1 byte
# per operand element: Runtime.float8_cast_bytes_per_element).
MEGATRON_FP8_SPEEDUP = 1.80

FIT_SETS = {
    "MEGATRON_MATMUL_RATE": "benchmarks/calibrate_stacks.py: fitted on dgxc-llama3.1-8b-8gpu, dgxc-llama3.1-70b-64gpu, dgxc-llama3.1-405b-576gpu, dgxc-gpt3-175b-128gpu, dgxc-nemotron4-340b-128gpu, dgxc-nemotron4-15b-16gpu (../shared/data/published_runs_h100_b200.csv); held out dgxc-llama3.1-8b-128gpu, dgxc-llama3.1-70b-2048gpu, dgxc-llama3.1-405b-2304gpu, dgxc-gpt3-175b-2048gpu, dgxc-nemotron4-340b-2048gpu, dgxc-nemotron4-15b-2048gpu: median 0.031",
    "MEGATRON_BAND": "leave-one-model-out over the 12 NeMo dense bf16 rows: median 0.047, p90 0.061",
    "MEGATRON_FP8_SPEEDUP": "benchmarks/calibrate_stacks.py: fitted on dgxc-llama3.1-8b-8gpu-fp8, dgxc-llama3.1-70b-64gpu-fp8, dgxc-llama3.1-405b-576gpu-fp8, dgxc-gpt3-175b-128gpu-fp8, dgxc-nemotron4-340b-128gpu-fp8 (with MEGATRON_MATMUL_RATE) at the grid's bound, cuBLAS's FP8/bf16 ratio (a mechanism is missing); leave-one-out median 0.099",
}
