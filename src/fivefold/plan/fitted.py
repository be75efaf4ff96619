"""Constants fitted on published runs, each with where it came from: what each is as a physical
quantity is said beside the profile field it sets (plan/hardware.py). Written by two scripts, each
its own block (do not edit by hand: rerun the script); each script declares its fit set and the
rows it holds out, and prints its out-of-sample table (benchmarks/RESULTS.md):
  benchmarks/calibrate_time.py — the torch stacks' terms (H100's GEMM efficiency, the inter-node
    latency and the tapered fabric's falloff, the nanotron profile's host and stall terms, the
    fivefold profiles' elementwise passes, torchao's FP8 speed-up) on the Playbook's and
    torchtitan's runs; the nanotron and fivefold bands, leave-one-model-out;
  benchmarks/calibrate_stacks.py — Transformer Engine's GEMM rate and FP8 speed-up (the
    `megatron` profile) on NVIDIA's NeMo runs; its band, leave-one-model-out.
"""

# --- written by benchmarks/calibrate_time.py
H100_MATMUL_EFFICIENCY = 0.55
INTER_NODE_LATENCY_S = 5.7e-05
TAPERED_FABRIC_NODES = 28.5
NANOTRON_LAUNCH_S = 8.1e-06
NANOTRON_COLLECTIVE_HOST_S = 0.000425
NANOTRON_PP_WAIT_PER_TP_PEER_S = 0.000286
NANOTRON_SLOT_STALL_S = 0.9
NANOTRON_DP_BW_EFFICIENCY = 0.92
NANOTRON_ELEMENTWISE_PASSES = 5.07
EAGER_ELEMENTWISE_PASSES = 6.1
COMPILED_ELEMENTWISE_PASSES = 4.284
FLOAT8_LINEAR_SPEEDUP = 1.4
NANOTRON_BAND = (0.124, 2.285)
FIVEFOLD_BAND = (0.190, 0.367)
TIME_LEAVE_ONE_MODEL_OUT = {'1B': {'H100_MATMUL_EFFICIENCY': 0.55, 'INTER_NODE_LATENCY_S': 5.130000000000001e-05, 'TAPERED_FABRIC_NODES': 22.8, 'NANOTRON_LAUNCH_S': 8.1e-06, 'NANOTRON_COLLECTIVE_HOST_S': 0.000425, 'NANOTRON_PP_WAIT_PER_TP_PEER_S': 0.000286, 'NANOTRON_SLOT_STALL_S': 0.9, 'NANOTRON_DP_BW_EFFICIENCY': 1.0120000000000002, 'NANOTRON_ELEMENTWISE_PASSES': 6.971250000000001, 'EAGER_ELEMENTWISE_PASSES': 6.1, 'COMPILED_ELEMENTWISE_PASSES': 4.284, 'FLOAT8_LINEAR_SPEEDUP': 1.4}, '3B': {'H100_MATMUL_EFFICIENCY': 0.55, 'INTER_NODE_LATENCY_S': 6.27e-05, 'TAPERED_FABRIC_NODES': 35.625, 'NANOTRON_LAUNCH_S': 5.346e-06, 'NANOTRON_COLLECTIVE_HOST_S': 0.000425, 'NANOTRON_PP_WAIT_PER_TP_PEER_S': 0.000286, 'NANOTRON_SLOT_STALL_S': 0.9, 'NANOTRON_DP_BW_EFFICIENCY': 0.7360000000000001, 'NANOTRON_ELEMENTWISE_PASSES': 4.563000000000001, 'EAGER_ELEMENTWISE_PASSES': 6.1, 'COMPILED_ELEMENTWISE_PASSES': 4.284, 'FLOAT8_LINEAR_SPEEDUP': 1.4}, '8B': {'H100_MATMUL_EFFICIENCY': 0.55, 'INTER_NODE_LATENCY_S': 5.7e-05, 'TAPERED_FABRIC_NODES': 28.215000000000003, 'NANOTRON_LAUNCH_S': 7.2900000000000005e-06, 'NANOTRON_COLLECTIVE_HOST_S': 0.000425, 'NANOTRON_PP_WAIT_PER_TP_PEER_S': 0.0002574, 'NANOTRON_SLOT_STALL_S': 0.9, 'NANOTRON_DP_BW_EFFICIENCY': 1.0120000000000002, 'NANOTRON_ELEMENTWISE_PASSES': 6.971250000000001, 'EAGER_ELEMENTWISE_PASSES': 6.1, 'COMPILED_ELEMENTWISE_PASSES': 4.284, 'FLOAT8_LINEAR_SPEEDUP': 1.4}, 'llama3.1-8b': {'H100_MATMUL_EFFICIENCY': 0.49500000000000005, 'INTER_NODE_LATENCY_S': 5.7e-05, 'TAPERED_FABRIC_NODES': 28.215000000000003, 'NANOTRON_LAUNCH_S': 7.2900000000000005e-06, 'NANOTRON_COLLECTIVE_HOST_S': 0.000425, 'NANOTRON_PP_WAIT_PER_TP_PEER_S': 0.000286, 'NANOTRON_SLOT_STALL_S': 0.9, 'NANOTRON_DP_BW_EFFICIENCY': 0.92, 'NANOTRON_ELEMENTWISE_PASSES': 3.0420000000000003, 'EAGER_ELEMENTWISE_PASSES': 6.1, 'COMPILED_ELEMENTWISE_PASSES': 1.0281599999999997, 'FLOAT8_LINEAR_SPEEDUP': 2.464}, 'llama3.1-70b': {'H100_MATMUL_EFFICIENCY': 0.55, 'INTER_NODE_LATENCY_S': 5.7e-05, 'TAPERED_FABRIC_NODES': 28.5, 'NANOTRON_LAUNCH_S': 8.1e-06, 'NANOTRON_COLLECTIVE_HOST_S': 0.000425, 'NANOTRON_PP_WAIT_PER_TP_PEER_S': 0.000286, 'NANOTRON_SLOT_STALL_S': 0.9, 'NANOTRON_DP_BW_EFFICIENCY': 0.92, 'NANOTRON_ELEMENTWISE_PASSES': 5.07, 'EAGER_ELEMENTWISE_PASSES': 6.1, 'COMPILED_ELEMENTWISE_PASSES': 4.284, 'FLOAT8_LINEAR_SPEEDUP': 1.4}, 'llama3.1-405b': {'H100_MATMUL_EFFICIENCY': 0.55, 'INTER_NODE_LATENCY_S': 5.7e-05, 'TAPERED_FABRIC_NODES': 28.5, 'NANOTRON_LAUNCH_S': 8.1e-06, 'NANOTRON_COLLECTIVE_HOST_S': 0.000425, 'NANOTRON_PP_WAIT_PER_TP_PEER_S': 0.000286, 'NANOTRON_SLOT_STALL_S': 0.9, 'NANOTRON_DP_BW_EFFICIENCY': 0.92, 'NANOTRON_ELEMENTWISE_PASSES': 5.07, 'EAGER_ELEMENTWISE_PASSES': 19.52, 'COMPILED_ELEMENTWISE_PASSES': 8.568, 'FLOAT8_LINEAR_SPEEDUP': 2.40625}}
TIME_FIT_SETS = {
    'H100_MATMUL_EFFICIENCY': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'INTER_NODE_LATENCY_S': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'TAPERED_FABRIC_NODES': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'NANOTRON_LAUNCH_S': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'NANOTRON_COLLECTIVE_HOST_S': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'NANOTRON_PP_WAIT_PER_TP_PEER_S': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'NANOTRON_SLOT_STALL_S': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'NANOTRON_DP_BW_EFFICIENCY': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'NANOTRON_ELEMENTWISE_PASSES': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'EAGER_ELEMENTWISE_PASSES': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'COMPILED_ELEMENTWISE_PASSES': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'FLOAT8_LINEAR_SPEEDUP': "benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran (playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook median 0.113, torchtitan even rows 0.073; odd rows held out: median 0.093",
    'NANOTRON_BAND': "leave-one-model-out over the Playbook's 1B, 3B and 8B runs (each predicted by the constants fitted without its model): median 0.124, p90 2.285",
    'FIVEFOLD_BAND': "leave-one-model-out over torchtitan's 18 rows (Llama 3.1 8B, 70B, 405B): median 0.190, p90 0.367",
    'TIME_LEAVE_ONE_MODEL_OUT': "benchmarks/calibrate_time.py: each fold's constants (the fit without that model)",
}
# --- end of benchmarks/calibrate_time.py

# --- written by benchmarks/calibrate_stacks.py
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
# --- end of benchmarks/calibrate_stacks.py
