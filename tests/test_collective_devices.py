"""Every collective of a training step gets tensors its backend accepts on a CUDA machine.

On CUDA, parallel.backend=nccl takes GPU tensors only, and `auto` (cpu:gloo,cuda:nccl) sends host
tensors to gloo and GPU tensors to nccl. A CPU machine cannot tell GPU memory from host memory, so
the ranks here train with a pretend device, rt.device = `cpu:0`, and follow where each tensor would
live in a CUDA run:
- host: made from Python data (`torch.tensor(x)`) unless on rt.device, by another constructor given
  no device (`torch.zeros(n)`), by `.cpu()` or `.to("cpu", copy=True)`, or computed from host
  tensors only;
- device: everything else (made on or moved to rt.device, computed with a device tensor, made by
  PyTorch itself for a device tensor).
`tensor.device` answers `cpu:0` for a device tensor, as `cuda:0` would, so code that makes a tensor
"where x is" does so here too. Every collective reaching PyTorch's dispatcher on the training thread
(ours, DTensor's, FSDP2's, the pipeline's, the checkpoint's) is recorded with the kind of each of
its tensors; each is then checked against PyTorch's own device -> backend map of each
parallel.backend value a CUDA run can use.
Blind spots: `.to("cpu")` without copy and constructors given an explicit plain "cpu" count as
device (torch's own buffers are made that way from a CPU mesh), and a DTensor's `.device` is its
mesh's plain "cpu" (FSDP2 compares the two).
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch

from layouts import tiny_config
from ranks import run_on_ranks

from fivefold.config import ConfigError
from fivefold.runtime import resolve_backend
from fivefold.config.validate import check_backend
from fivefold.configure import validate

PRETEND = torch.device("cpu", 0)  # stands for cuda:0: distinct from host memory's plain `cpu`

MOE = {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}
STEPS = {"steps": 2, "micro_batch": 1, "eval_every": 2, "eval_batches": 1}
LAYOUTS = [  # four ranks; together every dimension, ZeRO stage and host-number collective
    {"parallel": {"dp": 2, "pp": 2, "zero": 1}, "checkpoint": {"every": 2}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 3}},
    {"parallel": {"dp": 2, "cp": 2, "zero": 0}},
    {"parallel": {"dp": 4, "ep": 2, "zero": 2}, "model": {"moe": MOE}},
]


class Lineage:
    """Which tensors a CUDA run would hold in host memory (all others: on the device)."""

    def __init__(self):
        from torch.utils.weak import WeakTensorKeyDictionary

        self._host = WeakTensorKeyDictionary()

    def is_host(self, tensor: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        return tensor in self._host

    def mark(self, tensors, host: bool) -> None:
        for t in tensors:
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _pretend_device_mode(lineage: Lineage):
    """Python-level calls: constructors, `.cpu()`, and `tensor.device` (see the module docstring)."""
    from torch.distributed.tensor import DTensor
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()
    device_get = torch.Tensor.device.__get__

    class PretendDevice(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func == device_get and not isinstance(args[0], DTensor):  # a DTensor's is its mesh's
                real = func(*args)
                return PRETEND if real.type == "cpu" and not lineage.is_host(args[0]) else real
            if func == torch.Tensor.cpu and type(args[0]) is torch.Tensor:
                return args[0].to("cpu", copy=True)  # a host copy, as on CUDA; the original stays
            out = func(*args, **kwargs)
            if func in constructors and not (args and isinstance(args[0], torch.Tensor)):
                device = kwargs.get("device")
                if device is None:
                    lineage.mark(_tensors(out), host=True)
                elif torch.device(device) == PRETEND:
                    lineage.mark(_tensors(out), host=False)
            return out

    return PretendDevice()


def _where() -> str:
    """The two innermost fivefold frames of the call stack: who issued the collective, and its caller."""
    frames = [f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
              if "/src/fivefold/" in f.filename and f.name != "__torch_dispatch__"]  # not the ledger
    return " < ".join(reversed(frames[-2:])) or "?"


def _recording_mode(lineage: Lineage, seen: collections.Counter, configs: set):
    """aten-level calls: propagate host/device to every result, and record every collective."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group, _world
    from torch.utils._python_dispatch import TorchDispatchMode

    lift = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}

    def group_of(func, args):
        if func.namespace == "c10d":
            boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            return dist.ProcessGroup.unbox(boxed) if boxed is not None else None
        name = next((a for a in reversed(args) if isinstance(a, str)), None)  # _c10d_functional
        return _resolve_process_group(name) if name is not None else None

    class RecordCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            inputs = _tensors((args, kwargs))
            if func.namespace in ("c10d", "_c10d_functional"):
                group = group_of(func, args)
                if group is not None:
                    kinds = tuple(sorted({"host" if lineage.is_host(t) else "device" for t in inputs}))
                    configs.add(_world.pg_backend_config[group])
                    seen[(func._schema.name.split("::")[-1], kinds, _where() if "host" in kinds else "")] += 1
            out = func(*args, **kwargs)
            if func in lift:  # torch.tensor(data): returns the tensor it made from Python data
                lineage.mark([out], host=True)  # (the Python-level mode unmarks it if made on rt.device)
                return out
            device = kwargs.get("device")
            if device is not None and torch.device(device) == PRETEND:
                host = False
            elif func is torch.ops.aten._to_copy.default and device is not None:
                host = True  # a copy to plain "cpu" (.cpu(), .to("cpu", copy=True)): host memory
            else:  # computed: host only from host inputs; made by PyTorch without inputs: device
                host = bool(inputs) and all(lineage.is_host(t) for t in inputs)
            lineage.mark([t for t in _tensors(out) if not any(t is i for i in inputs)], host)
            return out

    return RecordCollectives()


def _train_layouts(layouts: list[dict], root: str) -> list[dict]:
    from unittest import mock

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from fivefold.runtime import Runtime, runtime_from_env
    from fivefold.train.trainer import train

    env = runtime_from_env()
    rt = Runtime(env.rank, env.world_size, env.local_rank, PRETEND)
    out = []
    for index, layout in enumerate(layouts):
        layout = {**layout, "train": STEPS, "log": {"progress": False, "every": 1},
                  "checkpoint": {**layout.get("checkpoint", {}), "dir": f"{root}/{index}"}}
        lineage, seen, configs = Lineage(), collections.Counter(), set()
        # PyTorch's object collectives (checkpoint metadata) put their bytes where the group's
        # backends want them: with pure nccl on the current CUDA device, here the pretend one.
        with mock.patch.object(c10d, "_get_object_coll_device", lambda group=None: str(PRETEND)), \
                _pretend_device_mode(lineage), _recording_mode(lineage, seen, configs):
            train(tiny_config(layout), rt)
        out.append({"seen": seen, "configs": configs,
                    "default_config": c10d._world.pg_backend_config[dist.group.WORLD]})
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return run_on_ranks(4, _train_layouts, LAYOUTS, str(tmp_path_factory.mktemp("ckpt")))


def _accepted(backend: str) -> set[str]:
    """Kinds of tensor a group of `backend` takes on a CUDA machine (PyTorch's own map)."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    devices = BackendConfig(Backend(backend)).get_device_backend_map()
    return {kind for kind, device in (("host", "cpu"), ("device", "cuda")) if device in devices}


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
@pytest.mark.parametrize("backend", ["nccl", "auto", "cpu:gloo,cuda:nccl"])
def test_every_collective_fits_the_backend(recorded, index, backend):
    accepted = _accepted(resolve_backend(backend, cuda=True))
    refused = collections.Counter()
    for rank, runs in enumerate(recorded):
        run = runs[index]
        # Every group used inherits the default group's backends, which on CUDA are parallel.backend's.
        assert run["configs"] == {run["default_config"]}, f"rank {rank}: groups {run['configs']}"
        for (op, kinds, where), n in run["seen"].items():
            if not set(kinds) <= accepted:
                refused[f"{op} of {'+'.join(kinds)} tensors at {where}"] += n
    assert not refused, (f"{LAYOUTS[index]['parallel']} under parallel.backend={backend}: collectives "
                         f"whose tensors it refuses on CUDA: {dict(refused)}")


def test_every_kind_of_collective_was_seen(recorded):
    """The check above means something only if the steps ran each family of collective."""
    ops = {op for runs in recorded for run in runs for op, _, _ in run["seen"]}
    families = {"all-reduce": {"allreduce_", "all_reduce"},
                "all-gather": {"_allgather_base_", "allgather_", "all_gather_into_tensor",
                               "allgather_into_tensor_coalesced_"},
                "reduce-scatter / all-to-all": {"reduce_scatter_tensor", "_reduce_scatter_base_",
                                                "reduce_scatter_tensor_coalesced_", "alltoall_base_"},
                "point-to-point": {"send", "recv_"},
                "tensor-parallel functional": {"all_gather_into_tensor", "reduce_scatter_tensor"}}
    missing = [name for name, names in families.items() if not names & ops]
    assert not missing, f"no {missing} collective in {sorted(ops)}"


def test_auto_backend():
    assert resolve_backend("auto", cuda=True) == "cpu:gloo,cuda:nccl"
    assert resolve_backend("auto", cuda=False) == "gloo"
    assert resolve_backend("nccl", cuda=True) == "nccl"
    assert _accepted("nccl") == {"device"}
    assert _accepted("cpu:gloo,cuda:nccl") == {"host", "device"}


def test_init_process_group_passes_the_backend(monkeypatch):
    import torch.distributed as dist

    from fivefold import runtime

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append((backend, kw["device_id"])))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    gpu = runtime.Runtime(0, 2, 0, torch.device("cuda", 0))
    for backend in ("auto", "nccl", "cpu:gloo,cuda:nccl"):
        runtime.init_process_group(gpu, 60, backend)
    runtime.init_process_group(runtime.Runtime(0, 2, 0, torch.device("cpu")), 60, "auto")
    # The device is bound to the group under pure nccl only.
    assert calls == [("cpu:gloo,cuda:nccl", None), ("nccl", gpu.device), ("cpu:gloo,cuda:nccl", None),
                     ("gloo", None)]


def test_bad_backend_is_one_sentence():
    with pytest.raises(ConfigError, match=r"parallel.backend='mpi' is not one of auto, nccl, gloo"):
        validate(tiny_config({"parallel": {"backend": "mpi"}}))
    with pytest.raises(ConfigError, match=r"^parallel.backend=nccl needs CUDA GPUs; this machine has none: "
                                          r"use gloo or auto$"):
        check_backend("nccl", cuda=False)
    with pytest.raises(ConfigError, match=r"^parallel.backend=gloo cannot run the collectives of CUDA"):
        check_backend("gloo", cuda=True)
    for backend in ("auto", "nccl", "cpu:gloo,cuda:nccl"):
        check_backend(backend, cuda=True)
    check_backend("gloo", cuda=False)
