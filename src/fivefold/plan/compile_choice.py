"""`train.compile = auto`: compile the blocks when the run is expected to win back the compile time.

Compiling is a bet: Inductor spends seconds to minutes per distinct block graph before the first
step (less when its caches hold the graphs: `TORCHINDUCTOR_CACHE_DIR`, on by default), and saves
a share of every step after it. `auto` takes the bet when

    steps x (eager step - compiled step) > block kinds x cold compile time

with the step times predicted for the run's layout and device: on CUDA by the planner's eager and
compiled runtime profiles (plan/speed/frameworks.py) on `cluster.gpu`; on a CPU from the model's FLOPs at
the rate and the compiled gain measured in benchmarks/RESULTS.md ("Compiled blocks on this CPU").
A block kind is one compiled graph: identical blocks share it, while dense and MoE layers, or
sliding and full attention layers, make one each. The cold compile times are the measured ones,
never the cached ones, so `auto` errs towards eager.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.models.attention.layout import attention_window
from fivefold.models.moe.layout import is_moe_layer

# Seconds to compile one block kind's forward and backward with an empty cache.
# cpu: measured 17.3 s, dim 256, one thread, Inductor's C++ (benchmarks/vs_transformers.py --compile).
# cuda: not measured on this project's machines yet; torchtitan-sized blocks take tens of seconds
# (Triton kernels, autotuning off). benchmarks/gpu.sh measures it where a GPU is lent.
COLD_COMPILE_S = {"cpu": 20.0, "cuda": 60.0}
# CPU: the eager loop's achieved fp32 model FLOP/s on one core (99.7 GFLOP/s GEMM roofline x 71.8%
# CPU MFU) and the compiled blocks' step-time gain over eager (1.11x), both measured in one run of
# benchmarks/vs_transformers.py --compile (RESULTS.md, "Compiled blocks on this CPU").
CPU_EAGER_FLOPS_PER_CORE = 72e9
CPU_COMPILED_GAIN = 1.11


@dataclass(frozen=True)
class CompileChoice:
    compile: bool
    reason: str  # "" unless train.compile = auto: then why, in one sentence


def block_kinds(model) -> int:
    """Distinct compiled graphs among the blocks: one per (dense or MoE, window) combination."""
    return len({(is_moe_layer(model, i), attention_window(model, i)) for i in range(model.n_layers)})


def predicted_step_seconds(cfg, device_type: str, threads: int = 1) -> tuple[float, float]:
    """(eager, compiled) step seconds of this run on `device_type`."""
    if device_type == "cuda":
        from fivefold.plan.estimate import estimate
        from fivefold.plan.hardware import hardware_from_cluster
        from fivefold.plan.speed.frameworks import FIVEFOLD_COMPILED, FIVEFOLD_EAGER
        from fivefold.plan.layout import layout_from_config
        from fivefold.plan.workload import workload_from_config

        hw = hardware_from_cluster(cfg.cluster)
        workload, layout = workload_from_config(cfg), layout_from_config(cfg)
        return tuple(estimate(workload, layout, hw, runtime).step_time_s
                     for runtime in (FIVEFOLD_EAGER, FIVEFOLD_COMPILED))
    from fivefold.plan.model_stats import model_stats

    t = cfg.train
    world = (cfg.parallel.dp or 1) * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    flops = model_stats(cfg.model).flops_per_token(t.seq_len) * t.global_batch * t.seq_len / world
    eager = flops / (CPU_EAGER_FLOPS_PER_CORE * threads)
    return eager, eager / CPU_COMPILED_GAIN


def choose_compile(cfg, device_type: str, threads: int = 1) -> CompileChoice:
    """Whether this run compiles its blocks, and for `auto` the sentence saying why."""
    setting = cfg.train.compile
    if setting != "auto":
        return CompileChoice(setting == "true", "")
    device_type = "cuda" if device_type == "cuda" else "cpu"
    eager, compiled = predicted_step_seconds(cfg, device_type, threads)
    kinds = block_kinds(cfg.model)
    cost = kinds * COLD_COMPILE_S[device_type]
    saved = cfg.train.steps * (eager - compiled)
    pays = saved > cost
    return CompileChoice(pays, (
        f"train.compile=auto: {'compiling the blocks' if pays else 'eager'}: {cfg.train.steps} steps x "
        f"{(eager - compiled) * 1e3:.1f} ms predicted saving on {device_type} = {saved:.0f} s "
        f"{'>' if pays else '<='} {cost:.0f} s to compile {kinds} block kind{'s' if kinds > 1 else ''} cold"))


def planned_compile(cfg) -> bool:
    """Whether the planner predicts this config compiled: on its cluster's GPUs, `auto` decided there."""
    return choose_compile(cfg, "cuda").compile
