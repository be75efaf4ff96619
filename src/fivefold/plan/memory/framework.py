"""What a framework's own memory recipe changes from fivefold's: the dtype of its gradient buffer,
the dtype of its optimizer state, and the fixed bytes every rank pays before holding a tensor of
the model.

The precision recipe (plan/workload.py PRECISIONS) says what fivefold's trainer keeps. Another
framework running the same layout may keep less: Megatron-core's performance recipes reduce and
accumulate gradients in bf16 (grad_reduce_in_fp32 = False), 2 bytes per weight where fivefold's
bf16 recipe keeps an fp32 buffer (4). A run may also keep its optimizer state in bf16: NeMo's
Apex DistributedFusedAdam with optim.dtype = bf16 (NVIDIA's Nemotron-4 340B benchmark config,
dgxc-benchmarking nemotron4-340b-synth.yaml) keeps both Adam moments in bf16, 2 bytes each where
fp32 moments take 4, and no master copy: NeMo's setup_optimization sets store_params = False
when the optimizer's dtype is the model's, so the bf16 weights are updated in place. 4 bytes per
weight over dp instead of 12 (Runtime.optimizer_state_bytes; `fivefold plan
--optimizer-state-dtype bf16`).
The fixed costs are the device's (CUDA context), the
communication library's (NCCL's buffers per communicator) and the framework's (workspaces and
allocator fragmentation, Runtime.fixed_bytes).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from fivefold.plan.hardware import Hardware, Runtime
from fivefold.plan.layout import Layout, replaced
from fivefold.plan.workload import Precision, Workload


@lru_cache(maxsize=64)
def framework_precision(precision: Precision, grad_buffer_bytes: float,
                        optimizer_state_bytes: float = 0.0) -> Precision:
    """The recipe with the framework's gradient buffer: that dtype, no second fp32 accumulator, and
    reduced in it (the buffer is what the data-parallel collective sends); and with its optimizer
    state's dtype: each Adam moment at that many bytes, and the master copy of the weights (where
    the recipe keeps one) too, unless that is the weights' own dtype."""
    if grad_buffer_bytes and precision.grad_bytes + precision.accum_bytes != grad_buffer_bytes:
        precision = dataclasses.replace(precision, grad_bytes=int(grad_buffer_bytes), accum_bytes=0,
                                        reduce_bytes=min(precision.reduce_bytes, int(grad_buffer_bytes)))
    state = int(optimizer_state_bytes)
    if state and precision.moment_bytes != state:
        # Adam's two moments at `state` bytes. A master copy in the weights' own dtype would be the
        # weights again: NeMo then keeps none (store_params = False when optim.dtype is the model's
        # dtype), updating the bf16 weights in place. (bf16_fp32_accum counts its master inside
        # optim_bytes, the other recipes apart.)
        master = state if state != precision.param_bytes else 0
        inline_master = precision.optim_bytes > 2 * precision.moment_bytes
        precision = dataclasses.replace(precision, optim_bytes=2 * state + (master if inline_master else 0),
                                        moment_bytes=state, master_bytes=master if precision.master_bytes else 0)
    return precision


def as_run_by(workload: Workload, runtime: Runtime) -> Workload:
    """The workload with the precision recipe as `runtime`'s framework holds it."""
    pr = framework_precision(workload.precision, runtime.grad_buffer_bytes, runtime.optimizer_state_bytes)
    return workload if pr is workload.precision else dataclasses.replace(workload, precision=pr)


def as_recomputed_by(layout: Layout, runtime: Runtime, hw: Hardware, stats) -> Layout:
    """The layout as the framework's recomputation runs it: Megatron's 'selective' recomputes only
    the core attention, whose s x s scores a fused kernel never keeps, so it keeps (and costs) what
    'none' does. (Its unfused A100-era core recomputes those scores in backward: plan/speed/attention.py
    counts that time whatever the setting.)"""
    if (layout.recompute == "selective" and runtime.selective_recompute == "attention_core"
            and hw.fuses_attention(stats)):
        return replaced(layout, recompute="none")
    return layout


def communicators(layout: Layout) -> int:
    """NCCL communicators a rank joins: one per parallel dimension of more than one rank (tp, the
    pipeline's peers, cp, the data-parallel gradient group over dp x cp, ep and, under ep, the
    experts' data-parallel group)."""
    return _communicators(layout.tp, layout.pp, layout.cp, layout.dp, layout.ep)


@lru_cache(maxsize=4096)
def _communicators(tp: int, pp: int, cp: int, dp: int, ep: int) -> int:
    groups = sum(n > 1 for n in (tp, pp, cp, dp * cp, ep))
    if ep > 1 and dp * cp * tp // ep > 1:
        groups += 1
    return groups


def process_bytes(layout: Layout, hw: Hardware) -> float:
    """What the process holds outside PyTorch's allocator: the CUDA context and NCCL's buffers per
    communicator (torch.cuda's peak-memory counters do not see them; the device's capacity does)."""
    return hw.context_bytes + hw.comm_buffer_bytes * communicators(layout)


def fixed_bytes(layout: Layout, hw: Hardware, runtime: Runtime) -> float:
    """Bytes a rank holds that no tensor of the model owns: the process's (process_bytes) and the
    framework's workspaces and fragmentation (Runtime.fixed_bytes)."""
    return process_bytes(layout, hw) + runtime.fixed_bytes
