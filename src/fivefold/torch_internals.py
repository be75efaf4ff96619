"""The private PyTorch internals fivefold relies on, all reached through this module.

PyTorch promises nothing about names with a leading underscore, the attributes its classes set in
`__init__`, or `torch.testing._internal`. Every such use is here, with what fivefold does with it,
and `missing()` (tests/test_torch_internals.py) names in one sentence each what the installed torch
lacks, instead of a failure deep inside a step. Imports nothing of fivefold (any layer may use it)
and, at import time, nothing `import torch` has not loaded.
"""

from __future__ import annotations

import importlib
import inspect
import re

import torch

SUPPORT = "pin torch to a release fivefold supports or update fivefold/torch_internals.py"


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
    # -1 outside backward: MoE statistics skip the forwards recomputation repeats in backward (models/moe.py).
    return torch._C._current_graph_task_id()


def has_grouped_mm() -> bool:
    # Whether the experts can use the grouped matmul (else one matmul per expert, models/moe.py).
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # All experts' matmuls in one kernel, rows grouped by `offs` (models/moe.py).
    return torch._grouped_mm(a, b, offs=offs)


# Private aten operators fivefold calls or recognises by identity: name -> (what for, where).
_BLOCKS, _RECOMPUTE = "src/fivefold/parallel/context/blocks.py", "src/fivefold/parallel/recompute.py"
ATEN_OPS = {
    "_scaled_dot_product_efficient_attention": ("context parallelism's CUDA blocks call (and selective "
                                                "recomputation keeps)", f"{_BLOCKS}, {_RECOMPUTE}"),
    "_scaled_dot_product_efficient_attention_backward": ("context parallelism's CUDA blocks call", _BLOCKS),
    "_scaled_dot_product_flash_attention_for_cpu": ("context parallelism's CPU blocks call (and selective "
                                                    "recomputation keeps)", f"{_BLOCKS}, {_RECOMPUTE}"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("context parallelism's CPU blocks call", _BLOCKS),
    "_scaled_dot_product_flash_attention": ("selective recomputation keeps (SDPA's CUDA kernel)", _RECOMPUTE),
    "_grouped_mm": ("selective recomputation keeps (the experts' matmuls)", _RECOMPUTE),
    "_to_copy": ("the activation probe recognises a weight's cast by", "src/fivefold/train/activation_probe.py"),
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
        raise ValueError(f"aten operator {name} is not in fivefold/torch_internals.py's ATEN_OPS; add it there")


# The functional collectives DTensor itself issues: tensor parallelism's (parallel/tensor/layers.py).
c10d_functional = torch.ops._c10d_functional
C10D_FUNCTIONAL_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce",
                       "wait_tensor")


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


def fake_store_class() -> type:
    # The "fake" backend's store: `fivefold rank-build` builds one rank with no peers (tools/rank_build.py).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


# PipelineStage methods fivefold wraps on each stage: memory release, compute clock, activation probe.
STAGE_METHODS = ("get_fwd_send_ops", "backward_one_chunk", "backward_weight_one_chunk", "set_local_fwd_input",
                 "forward_one_chunk")


def wrap_stage_method(stage, name: str, make_wrapper, missing_ok: bool = False):
    """Replace stage.<name> (a name of STAGE_METHODS) on this stage object with
    make_wrapper(current method); returns the method replaced (None, and nothing done, when
    missing_ok and the stage has none)."""
    if name not in STAGE_METHODS:
        raise ValueError(f"{name} is not in fivefold/torch_internals.py's STAGE_METHODS; add it there")
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


def _sources(cls, member: str) -> str:
    """The source of `member` on each class of cls's MRO that defines it in Python."""
    out = []
    for klass in cls.__mro__:
        if member in vars(klass):
            try:
                out.append(inspect.getsource(vars(klass)[member]))
            except (OSError, TypeError):
                pass
    return "\n".join(out)


def _assigned_in_init(cls, attribute: str) -> bool:
    """Whether some __init__ of cls's MRO assigns self.<attribute> (instance attributes exist only
    on built objects, and building a PipelineStage needs a process group)."""
    return re.search(rf"\bself\.{attribute}\b[^=\n]*(?<![=!<>])=(?!=)", _sources(cls, "__init__")) is not None


def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage


def _schedules_call(method: str) -> bool:
    """Whether the schedules call stage.<method>( through the stage object (so that a wrapper set
    on the object runs)."""
    import torch.distributed.pipelining.schedules as schedules

    return re.search(rf"\.{method}\(", inspect.getsource(schedules)) is not None


def _recv_info_has_buffer() -> bool:
    from torch.distributed.pipelining.stage import _RecvInfo

    return _assigned_in_init(_RecvInfo, "buffer")


def _backward_signature() -> bool:
    # stages.py reads full_backward as the third argument (after bwd_chunk_id and loss) when passed positionally.
    names = list(inspect.signature(_stage_class().backward_one_chunk).parameters)
    return names[:4] == ["self", "bwd_chunk_id", "loss", "full_backward"]


def _loss_fn_reached() -> bool:
    import torch.distributed.pipelining.schedules as schedules

    names = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
             "ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # those parallel/pipeline/stages.py builds
    return ("self._loss_fn(" in inspect.getsource(schedules)
            and all(_assigned_in_init(getattr(schedules, name), "_loss_fn") for name in names))


def _storage_counts_references() -> bool:
    tensor = torch.empty(4)
    storage = tensor.untyped_storage()
    held = storage_use_count(storage)
    del tensor
    return held == storage_use_count(storage) + 1


class _TaskProbe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(current_graph_task_id())
        return grad, None


def _graph_task_id_marks_backward() -> bool:
    seen: list[int] = []
    x = torch.zeros(1, requires_grad=True)
    _TaskProbe.apply(x, seen).sum().backward()
    return current_graph_task_id() == -1 and len(seen) == 1 and seen[0] != -1


def _dtensor_has_local_tensor() -> bool:
    from torch.distributed.tensor import DTensor

    return ("_local_tensor" in getattr(DTensor, "__slots__", ())
            and "_local_tensor" in _sources(DTensor, "__tensor_flatten__"))


def _offset_signature() -> bool:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return list(inspect.signature(compute_local_shape_and_global_offset).parameters)[:3] == [
        "global_shape", "mesh", "placements"]


def _imported(obj) -> bool:
    return not (isinstance(obj, type) and issubclass(obj, _Absent))


def _module_buffers() -> bool:
    module = torch.nn.Module()
    return isinstance(module_buffers(module), dict) and isinstance(non_persistent_buffer_names(module), set)


_PIPELINE = "src/fivefold/parallel/pipeline/stages.py"
_PROBE = "src/fivefold/train/pipeline_probe.py"
_ACTIVATIONS = "src/fivefold/train/activation_probe.py"


def _checks() -> list[tuple[str, str, str, object]]:
    """(what, what fivefold does with it, where, check returning True when present)."""
    stage = _stage_class
    checks = [
        ("PipelineStage.fwd_cache", "fivefold's pipeline memory release trims and its pipeline activation "
         "probe reads", f"{_PIPELINE}, {_PROBE}", lambda: _assigned_in_init(stage(), "fwd_cache")),
        ("PipelineStage.args_recv_info", "fivefold's pipeline memory release reads for the receive buffers",
         _PIPELINE, lambda: _assigned_in_init(stage(), "args_recv_info")),
        ("_RecvInfo.buffer (the receive buffer of a PipelineStage input)", "fivefold's pipeline memory "
         "release empties", _PIPELINE, _recv_info_has_buffer),
        ("PipelineStage.backward_state", "fivefold's pipeline activation probe reads", _PROBE,
         lambda: _assigned_in_init(stage(), "backward_state")),
        ("PipelineStage.backward_one_chunk(bwd_chunk_id, loss, full_backward, ...)", "fivefold's pipeline "
         "wrappers read full_backward from", _PIPELINE, _backward_signature),
        ("pipeline schedules' _loss_fn, set in __init__ and called as self._loss_fn(...)", "fivefold's "
         "pipeline activation probe swaps for a measured loss", _PROBE, _loss_fn_reached),
    ]
    for name in STAGE_METHODS:
        checks.append((f"PipelineStage.{name} called by the schedules through the stage", "fivefold wraps on "
                       "each stage (memory release, compute clock, activation probe)", f"{_PIPELINE}, {_PROBE}",
                       lambda name=name: hasattr(stage(), name) and _schedules_call(name)))
    checks += [
        ("DTensor._local_tensor", "fivefold's pipeline memory release empties", _PIPELINE,
         _dtensor_has_local_tensor),
        ("torch.distributed.tensor._utils.compute_local_shape_and_global_offset(global_shape, mesh, "
         "placements)", "fivefold uses to place each rank's piece of a checkpointed tensor",
         "src/fivefold/parallel/pieces.py", _offset_signature),
        ("nn.Module._buffers and _non_persistent_buffers_set", "fivefold reads for the buffers a checkpoint "
         "holds", "src/fivefold/parallel/pieces.py", _module_buffers),
        ("torch.distributed.distributed_c10d._resolve_process_group", "fivefold's communication ledger uses "
         "to size a functional collective's group", "src/fivefold/parallel/comm_ledger.py",
         lambda: _imported(_optional("torch.distributed.distributed_c10d", "_resolve_process_group"))),
        ("OpOverload._schema", "fivefold's communication ledger reads an operator's name from",
         "src/fivefold/parallel/comm_ledger.py", lambda: isinstance(op_schema_name(torch.ops.aten.mm.default), str)),
        ("torch.utils._python_dispatch.TorchDispatchMode", "fivefold's activation probes and communication "
         "ledger subclass", f"{_ACTIVATIONS}, {_PROBE}, src/fivefold/parallel/comm_ledger.py",
         lambda: _imported(TorchDispatchMode)),
        ("torch.utils._python_dispatch.is_traceable_wrapper_subclass", "fivefold's activation probes use to "
         "reach a DTensor's local data", f"{_ACTIVATIONS}, {_PROBE}", lambda: _imported(is_traceable_wrapper_subclass)),
        ("torch.utils._pytree.tree_leaves", "fivefold's activation probes use to find an operator's tensors",
         f"{_ACTIVATIONS}, {_PROBE}", lambda: _imported(tree_leaves)),
        ("torch._C._storage_Use_Count counting a storage's references", "fivefold's activation probes use to "
         "tell what autograd keeps", f"{_ACTIVATIONS}, {_PROBE}", _storage_counts_references),
        ("Tensor._is_view", "fivefold's pipeline memory release uses to leave views alone", _PIPELINE,
         lambda: callable(getattr(torch.Tensor, "_is_view", None))),
        ("torch._grouped_mm", "fivefold's MoE experts use for one kernel over all experts (else one matmul "
         "per expert)", "src/fivefold/models/moe.py", has_grouped_mm),
        ("torch._C._current_graph_task_id returning -1 outside backward only", "fivefold's MoE router "
         "statistics use to skip recomputed forwards", "src/fivefold/models/moe.py, src/fivefold/models/mtp.py",
         _graph_task_id_marks_backward),
        ("torch.ops._c10d_functional." + "/".join(C10D_FUNCTIONAL_OPS), "fivefold's tensor-parallel layers "
         "call as their collectives", "src/fivefold/parallel/tensor/layers.py",
         lambda: all(hasattr(c10d_functional, n) for n in C10D_FUNCTIONAL_OPS)),
    ]
    for name, (use, where) in ATEN_OPS.items():
        checks.append((f"torch.ops.aten.{name}", use, where, lambda name=name: hasattr(torch.ops.aten, name)))
    checks.append(("torch.testing._internal.distributed.fake_pg.FakeStore", "`fivefold rank-build` uses to "
                   "build one rank without its peers", "src/fivefold/tools/rank_build.py",
                   lambda: isinstance(fake_store_class(), type)))
    return checks


def missing() -> list[str]:
    """One sentence per internal above that this torch lacks (or has changed past what fivefold
    reads); empty when all are as fivefold expects."""
    out = []
    for what, use, where, check in _checks():
        try:
            present = bool(check())
        except Exception:  # an import, a signature or a source that is not there any more
            present = False
        if not present:
            out.append(_sentence(what, use, where))
    return out
