"""The checks behind torch_internals.missing(): for each private PyTorch internal fivefold relies
on, whether the installed torch still has it as fivefold reads it."""

from __future__ import annotations

import inspect
import re

import torch

from fivefold.torch_internals import (ATEN_OPS, C10D_FUNCTIONAL_OPS, STAGE_METHODS, TorchDispatchMode, _Absent,
                                     _optional, _sentence, c10d_functional, current_graph_task_id, fake_store_class,
                                     flight_recorder, has_grouped_mm, is_traceable_wrapper_subclass, module_buffers,
                                     non_persistent_buffer_names, op_schema_name, process_groups, storage_use_count,
                                     tree_leaves)


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
    """Whether some __init__ of cls's MRO assigns self.<attribute> (a built stage needs a process group)."""
    return re.search(rf"\bself\.{attribute}\b[^=\n]*(?<![=!<>])=(?!=)", _sources(cls, "__init__")) is not None


def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage


def _schedules_call(method: str) -> bool:
    """Whether the schedules call stage.<method>( through the stage object (so a wrapper set on it runs)."""
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


def _compile_seconds_readable() -> bool:
    from torch._dynamo.utils import calculate_time_spent

    return "total_wall_time" in calculate_time_spent()


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
        ("torch._dynamo.utils.calculate_time_spent() with 'total_wall_time'", "fivefold reports the compile "
         "time of train.compile from", "src/fivefold/train/trainer.py", _compile_seconds_readable),
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
         "per expert)", "src/fivefold/models/moe/layer.py", has_grouped_mm),
        ("torch._C._current_graph_task_id returning -1 outside backward only", "fivefold's MoE router "
         "statistics use to skip recomputed forwards", "src/fivefold/models/moe/layer.py, src/fivefold/models/mtp.py",
         _graph_task_id_marks_backward),
        ("torch.ops._c10d_functional." + "/".join(C10D_FUNCTIONAL_OPS), "fivefold's tensor-parallel layers "
         "call as their collectives", "src/fivefold/parallel/tensor/layers.py",
         lambda: all(hasattr(c10d_functional, n) for n in C10D_FUNCTIONAL_OPS)),
    ]
    for name, (use, where) in ATEN_OPS.items():
        checks.append((f"torch.ops.aten.{name}", use, where, lambda name=name: hasattr(torch.ops.aten, name)))
    checks.append(("torch._C._distributed_c10d._dump_fr_trace_json, distributed_c10d._world", "fivefold's hang "
                   "diagnosis reads", "src/fivefold/train/hangs.py", lambda: isinstance(flight_recorder()[0], list)))
    checks.append(("distributed_c10d._world.pg_map and torch.distributed.tensor.debug._clear_sharding_prop_cache",
                   "the layout tests release each layout's process groups with", "tests/layouts.py",
                   lambda: isinstance(process_groups(), list) and _imported(
                       _optional("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"))))
    checks.append(("torch.cuda.memory._record_memory_history and _dump_snapshot", "log.memory_snapshot calls",
                   "src/fivefold/train/observe.py", lambda: all(hasattr(torch.cuda.memory, name) for name in
                                                              ("_record_memory_history", "_dump_snapshot"))))
    checks.append(("torch.testing._internal.distributed.fake_pg.FakeStore", "`fivefold rank-build` uses to "
                   "build one rank without its peers", "src/fivefold/tools/rank_build.py",
                   lambda: isinstance(fake_store_class(), type)))
    return checks


def missing() -> list[str]:
    """One sentence per internal above that this torch lacks or has changed; empty when all are as expected."""
    out = []
    for what, use, where, check in _checks():
        try:
            present = bool(check())
        except Exception:  # an import, a signature or a source that is not there any more
            present = False
        if not present:
            out.append(_sentence(what, use, where))
    return out
