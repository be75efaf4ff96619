"""The private PyTorch internals fivefold relies on, all reached through this module.

PyTorch promises nothing about names with a leading underscore, the attributes its classes set in
`__init__`, or `torch.testing._internal`. Every such use is here, with what fivefold does with it,
and `missing()` (tests/test_torch_internals.py) names in one sentence each what the installed torch
lacks, instead of a failure deep inside a step. Imports nothing of fivefold (any layer may use it)
and, at import time, nothing `import torch` has not loaded.
"""

from __future__ import annotations

import importlib

import torch

SUPPORT = "pin torch to a release fivefold supports or update fivefold/torch_internals/"


class _Absent:
    """Stands for a name whose import failed: missing() names it, and calling or subclassing it
    raises that sentence rather than a NameError somewhere else."""

    what = ""

    def __new__(cls, *args, **kwargs):
        raise ImportError(f"torch {torch.__version__} has no {cls.what}; {SUPPORT}")


def _absent(what: str) -> type:
    def refuse(cls, **kwargs):
        raise ImportError(f"torch {torch.__version__} has no {what}; {SUPPORT}")

    return type("Absent", (_Absent,), {"what": what, "__init_subclass__": refuse})


def _optional(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # missing() names it
        return _absent(f"{module}.{name}")


# Base class of the modes that see every operator: the activation probes and the communication ledger.
TorchDispatchMode = _optional("torch.utils._python_dispatch", "TorchDispatchMode")
# Whether a tensor (DTensor, an async collective's result) keeps its data in inner tensors, which the probes count.
is_traceable_wrapper_subclass = _optional("torch.utils._python_dispatch", "is_traceable_wrapper_subclass")
# The tensors inside an operator's nested arguments and outputs, for the activation probes.
tree_leaves = _optional("torch.utils._pytree", "tree_leaves")
# The operators a compiled graph calls around its subgraphs (recomputation's run_and_save_rng_state):
# the communication ledger lets them through.
HigherOrderOperator = _optional("torch._ops", "HigherOrderOperator")


def storage_use_count(storage: torch.UntypedStorage) -> int:
    # References to a storage: the activation probes hold one, so more means something keeps it for backward.
    return torch._C._storage_Use_Count(storage._cdata)


def is_view(tensor: torch.Tensor) -> bool:
    # The pipeline's memory release leaves a view's storage alone: its base may be held elsewhere.
    return tensor._is_view()


def op_schema_name(op) -> str:
    # "namespace::name" of an operator overload: how the communication ledger recognises collectives.
    return op._schema.name


def module_buffers(module: torch.nn.Module) -> dict:
    # A module's own buffers (name -> tensor or None): parallel/pieces.py saves the persistent ones.
    return module._buffers


def non_persistent_buffer_names(module: torch.nn.Module) -> set:
    # Names of the module's buffers that state_dict leaves out (RoPE tables): parallel/pieces.py skips them.
    return module._non_persistent_buffers_set


def current_graph_task_id() -> int:
    # -1 outside backward: MoE statistics skip the forwards recomputation repeats in backward (models/moe/layer.py).
    return torch._C._current_graph_task_id()


def compile_seconds() -> float:
    # Seconds torch.compile has spent in this process so far (Dynamo frames and the lazily compiled
    # backward graphs), for the compile time the trainer reports (train/trainer.py). Imports Dynamo.
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


def has_grouped_mm() -> bool:
    # Whether the experts can use the grouped matmul (else one matmul per expert, models/moe/layer.py).
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # All experts' matmuls in one kernel, rows grouped by `offs` (models/moe/layer.py).
    return torch._grouped_mm(a, b, offs=offs)


# Private aten operators fivefold calls or recognises by identity: name -> (what for, where).
_BLOCKS, _RECOMPUTE = "src/fivefold/models/attention/blocks.py", "src/fivefold/parallel/recompute.py"
ATEN_OPS = {
    "_scaled_dot_product_efficient_attention": ("blockwise attention's CUDA blocks call (and selective "
                                                "recomputation keeps)", f"{_BLOCKS}, {_RECOMPUTE}"),
    "_scaled_dot_product_efficient_attention_backward": ("blockwise attention's CUDA blocks call", _BLOCKS),
    "_scaled_dot_product_flash_attention_for_cpu": ("blockwise attention's CPU blocks call (and selective "
                                                    "recomputation keeps)", f"{_BLOCKS}, {_RECOMPUTE}"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("blockwise attention's CPU blocks call", _BLOCKS),
    "_scaled_dot_product_flash_attention": ("selective recomputation keeps (SDPA's CUDA kernel)", _RECOMPUTE),
    "_grouped_mm": ("selective recomputation keeps (the experts' matmuls)", _RECOMPUTE),
    "_to_copy": ("the activation probe recognises a weight's cast by", "src/fivefold/train/activation_probe.py"),
    "silu_backward": ("SwiGLU's backward runs autograd's own kernel", "src/fivefold/models/swiglu.py"),
}


def has_aten_op(name: str) -> bool:
    # Whether this torch has one of ATEN_OPS (blocks.py and recompute.py use some only where present).
    _known_aten(name)
    return hasattr(torch.ops.aten, name)


def aten_op(name: str):
    """torch.ops.aten.<name> (its overload packet) for a name of ATEN_OPS."""
    _known_aten(name)
    try:
        return getattr(torch.ops.aten, name)
    except AttributeError:
        raise AttributeError(_sentence(f"torch.ops.aten.{name}", *ATEN_OPS[name])) from None


def _known_aten(name: str) -> None:
    if name not in ATEN_OPS:
        raise ValueError(f"aten operator {name} is not in fivefold/torch_internals/__init__.py's ATEN_OPS; add it there")


# The functional collectives DTensor itself issues: tensor parallelism's (parallel/tensor/layers.py).
c10d_functional = torch.ops._c10d_functional
C10D_FUNCTIONAL_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce", "wait_tensor")


def dtensor_local_tensor(tensor) -> torch.Tensor:
    # A DTensor's own local tensor (not to_local()'s view): the pipeline's memory release empties it.
    return tensor._local_tensor


def local_shape_and_global_offset(global_shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Where this rank's piece of a DTensor lies in the whole tensor (parallel/pieces.py).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def resolve_process_group(name: str):
    # The process group a functional collective names: its size and ranks (parallel/comm_ledger.py).
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def process_groups() -> list:
    # Every process group this rank holds: what tests/layouts.py releases after each layout.
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def forget_dtensor_shardings() -> None:
    # DTensor caches each operator's output sharding by its inputs' specs, and a DeviceMesh equals any
    # mesh of the same shape: once a layout's groups are destroyed, the next layout's equal mesh would
    # be handed cached specs naming the destroyed groups. Torch's own DTensor tests clear it so.
    # Four more caches hold a mesh strongly (the redistribution planners, though keyed by a weak
    # reference; the transforms between two specs; the mesh topology; the tensor metadata of each op
    # schema): each layout's meshes, and their process groups with two gloo threads each per group,
    # would outlive it in every rank.
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    _gen_transform_infos.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()


def flight_recorder() -> tuple[list[dict], dict[str, list[int]]]:
    # The collectives this rank issued (TORCH_FR_BUFFER_SIZE) and each group's global ranks by the name
    # the entries give it: what train/hangs.py compares across ranks after a timeout.
    import json

    from torch.distributed.distributed_c10d import _world

    entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, True)).get("entries", [])
    return entries, {name: torch.distributed.get_process_group_ranks(pg) for pg, name in _world.pg_names.items()}


def record_cuda_memory_history(enabled: bool) -> None:
    # The CUDA allocator's history, each allocation with its stack (log.memory_snapshot: train/observe.py).
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100_000)


def dump_cuda_memory_snapshot(path: str) -> None:
    # The allocator's segments and the recorded history in one file, for pytorch.org/memory_viz.
    torch.cuda.memory._dump_snapshot(path)


def fake_store_class() -> type:
    # The "fake" backend's store: `fivefold rank-build` builds one rank with no peers (tools/rank_build.py).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


# PipelineStage methods the schedules call that fivefold overrides (parallel/pipeline/observed_stage.py:
# memory release, input selection, compute clock) or wraps for a measured step (train/pipeline_probe.py).
STAGE_METHODS = ("get_fwd_send_ops", "backward_one_chunk", "backward_weight_one_chunk", "set_local_fwd_input",
                 "forward_one_chunk")


def wrap_stage_method(stage, name: str, make_wrapper, missing_ok: bool = False):
    """Replace stage.<name> (a name of STAGE_METHODS) on this stage object with
    make_wrapper(current method); returns the method replaced (None, doing nothing, if missing_ok and absent)."""
    if name not in STAGE_METHODS:
        raise ValueError(f"{name} is not in fivefold/torch_internals/__init__.py's STAGE_METHODS; add it there")
    current = getattr(stage, name, None) if missing_ok else getattr(stage, name)
    if current is not None:
        setattr(stage, name, make_wrapper(current))
    return current


def stage_fwd_cache(stage) -> dict:
    # micro-batch -> (outputs, flat inputs) till its backward: memory release drops outputs, the probe counts inputs.
    return stage.fwd_cache


def stage_args_recv_info(stage) -> dict:
    # micro-batch -> its inputs' receive infos: the memory release empties their buffers after its backward.
    return stage.args_recv_info


def recv_info_buffer(info):
    # The buffer a receive info's input lands in (None for a root argument).
    return info.buffer


def stage_backward_state(stage) -> dict:
    # micro-batch -> (flat inputs, ...) of a split backward awaiting its weight pass: the probe counts the inputs.
    return stage.backward_state


def schedule_loss_fn(schedule):
    # The loss the schedule calls on the last stage: the pipeline activation probe swaps in a measured one.
    return schedule._loss_fn


def set_schedule_loss_fn(schedule, loss_fn) -> None:
    # The other half of schedule_loss_fn (train/pipeline_probe.py).
    schedule._loss_fn = loss_fn


def _sentence(what: str, use: str, where: str) -> str:
    return f"torch {torch.__version__} has no {what}, which {use} ({where}); {SUPPORT}"


def missing() -> list[str]:
    """One sentence per internal fivefold relies on that this torch lacks or has changed; empty when
    all are as expected (the checks: torch_internals/checks.py)."""
    from fivefold.torch_internals.checks import missing as check_all

    return check_all()
