"""Training state in a layout-independent form: whole tensors under single-device names.

A checkpoint holds, for every parameter name of the single-device model, the whole weight and
the whole AdamW state (exp_avg, exp_avg_sq, step). Any layout can write it (gather) and any layout
can read it (each rank cuts out its piece), so resharding needs no conversion step.

Trade-off: gathering means one whole copy of model + optimizer state passes through every rank's
host memory at save time. That is simple and exact for the models fivefold trains on a laptop or
a few nodes; a per-rank sharded format (torch.distributed.checkpoint from DTensor shards) would
scale further and is the next step if checkpoints of 10B+ models are needed.

Pieces per layout:
- tensor parallel / FSDP2 (zero 3): parameters and their AdamW state are DTensors of the same
  placements: `full_tensor()` gathers, `distribute_tensor(..., src_data_rank=None)` cuts locally.
- zero 1/2: the optimizer updates flat per-bucket chunks (parallel/zero.py); the chunks are
  all-gathered into the bucket layout and `Bucket.views` gives each parameter's slice back.
- expert parallel: each ep rank holds n_experts/ep experts along dim 0.
- pipeline: each rank holds some stages; stages are exchanged with all_gather_object over pp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import ConfigError
from fivefold.parallel.expert import gather_experts, is_expert_param
from fivefold.parallel.grad_norm import local_tensor

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
# torch 2.13 renamed the single-tensor all-gather; keep working on 2.11/2.12 (as parallel/zero.py).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def named_params(par) -> dict[str, nn.Parameter]:
    """Single-device name -> this rank's parameter (each part's names are the model's names)."""
    return {name: p for part in par.parts for name, p in part.named_parameters()}


def persistent_buffers(par) -> dict[str, torch.Tensor]:
    """Buffers saved with the model (MoE bias-balancing state); RoPE tables are recomputed."""
    out = {}
    for part in par.parts:
        for mod_name, module in part.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out[f"{mod_name}.{name}" if mod_name else name] = buf
    return out


def _whole(par, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece (in the parameter's layout) -> the whole tensor (collective over tp/dp/ep)."""
    if isinstance(tensor, _dtensor_type()):
        tensor = tensor.full_tensor()
    return gather_experts(name, tensor, par._ep_mesh).detach().cpu().clone()


def _over_pipeline(par, out: dict) -> dict:
    if par.pipeline is None:
        return out
    stages = [None] * par.dims.pp
    dist.all_gather_object(stages, out, group=par.mesh["pp"].get_group())
    merged = {name: tensor for stage in stages for name, tensor in stage.items()}
    if par.pipeline.tied:
        merged = {k: v for k, v in merged.items() if k.rsplit("/", 1)[-1] != "output.weight"}
    return merged


def _optimizer_pieces(par, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {exp_avg, exp_avg_sq, step} in the parameter's own layout on this rank."""
    dp = par.data_parallel
    names = {id(p): n for n, p in named_params(par).items()}
    out: dict[str, dict] = {}
    if hasattr(dp, "chunks"):  # zero 1/2: flat chunks -> per-parameter slices
        DTensor = _dtensor_type()
        for bucket, chunk in zip(dp.buckets, dp.chunks):
            state = optimizer.state.get(chunk, {})
            flats = {}
            for key in ADAM_KEYS:
                piece = state[key] if key in state else torch.zeros_like(chunk)
                flat = torch.empty(bucket.padded, dtype=piece.dtype, device=piece.device)
                _all_gather(flat, piece.detach().contiguous(), group=bucket.group)
                flats[key] = flat
            step = state.get("step", torch.tensor(0.0))
            for key, flat in flats.items():
                for param, view in bucket.views(flat):
                    local = view.view_as(local_tensor(param))
                    if isinstance(param, DTensor):
                        local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
                    out.setdefault(names[id(param)], {})[key] = local
            for param in bucket.params:
                out[names[id(param)]]["step"] = step
        return out
    for param in dp.params:
        state = optimizer.state.get(param, {})
        entry = {key: state[key] if key in state else torch.zeros_like(param) for key in ADAM_KEYS}
        entry["step"] = state.get("step", torch.tensor(0.0))
        out[names[id(param)]] = entry
    return out


def full_training_state(par, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model, optimizer) as whole CPU tensors; optimizer keys are 'exp_avg/<name>' etc.
    A collective: every rank calls it, in the same order, and all get the same result."""
    model = {name: _whole(par, name, p) for name, p in named_params(par).items()}
    model.update({name: b.detach().cpu().clone() for name, b in persistent_buffers(par).items()})
    optim = {}
    for name, entry in _optimizer_pieces(par, optimizer).items():
        for key in ADAM_KEYS:
            optim[f"{key}/{name}"] = _whole(par, name, entry[key])
        optim[f"step/{name}"] = local_tensor(entry["step"]).detach().cpu().float().reshape(()).clone()
    return _over_pipeline(par, model), _over_pipeline(par, optim)


def _source(name: str, tensors: dict, tied: bool) -> str:
    # A pipeline's last stage holds its own copy of a tied embedding: it loads the embedding.
    if tied and name.endswith("output.weight") and name not in tensors:
        return name.replace("output.weight", "tok_embeddings.weight")
    return name


def _local_piece(par, name: str, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `whole` this rank holds for a tensor laid out like `like` (no communication)."""
    if par._ep_mesh is not None and is_expert_param(name):
        whole = whole.chunk(par._ep_mesh.size())[par._ep_mesh.get_local_rank()]
    if isinstance(like, _dtensor_type()):
        from torch.distributed.tensor import distribute_tensor

        whole = distribute_tensor(whole.to(like.device), like.device_mesh, like.placements,
                                  src_data_rank=None).to_local()
    return whole.to(local_tensor(like).device, local_tensor(like).dtype)


def _tied(par) -> bool:
    return par.pipeline is not None and par.pipeline.tied


def load_training_state(par, model_sd: dict, optim_sd: dict | None, optimizer) -> None:
    """Copy whole tensors (already shape-checked against the model) into this rank's pieces;
    rebuild zero 1/2 chunks and optimizer state. No collectives: every rank reads the same file."""
    tied = _tied(par)
    params = named_params(par)
    with torch.no_grad():
        for name, param in params.items():
            whole = model_sd[_source(name, model_sd, tied)]
            local_tensor(param).copy_(_local_piece(par, name, whole, param))
        for name, buf in persistent_buffers(par).items():
            buf.copy_(model_sd[name])
    dp = par.data_parallel
    if hasattr(dp, "chunks"):
        for bucket, chunk in zip(dp.buckets, dp.chunks):
            with torch.no_grad():
                chunk.copy_(bucket.pack_params().chunk(bucket.group_size)[bucket.group_rank])
    if optim_sd is None:
        return
    names = {id(p): n for n, p in params.items()}
    group = optimizer.param_groups[0]

    optim_names = {k.split("/", 1)[1] for k in optim_sd}
    on_device = group.get("fused") or group.get("capturable")  # where AdamW keeps its step count

    def whole(key, name):
        return optim_sd[f"{key}/{_source(name, optim_names, tied)}"]

    def step_tensor(name, device):
        return whole("step", name).clone().to(device if on_device else "cpu")

    optimizer.state.clear()
    if hasattr(dp, "chunks"):
        for bucket, chunk in zip(dp.buckets, dp.chunks):
            entry = {}
            for key in ADAM_KEYS:
                flat = torch.zeros(bucket.padded, dtype=chunk.dtype, device=chunk.device)
                for param, view in bucket.views(flat):
                    name = names[id(param)]
                    view.copy_(_local_piece(par, name, whole(key, name), param).reshape(-1))
                entry[key] = flat.chunk(bucket.group_size)[bucket.group_rank].clone()
            entry["step"] = step_tensor(names[id(bucket.params[0])], chunk.device)
            optimizer.state[chunk] = entry
        return
    for param in dp.params:
        name = names[id(param)]
        entry = {}
        for key in ADAM_KEYS:
            state = torch.zeros_like(param)
            local_tensor(state).copy_(_local_piece(par, name, whole(key, name), param))
            entry[key] = state
        entry["step"] = step_tensor(name, local_tensor(param).device)
        optimizer.state[param] = entry


def expected_shapes(model) -> dict[str, tuple]:
    """Whole-tensor shapes a checkpoint of this single-device model holds (meta model is fine)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (name == "output.weight" and model.cfg.tie_embeddings)}


def check_shapes(path, tensors: dict, expected: dict[str, tuple], what: str) -> None:
    """One sentence naming the first missing or mismatched tensor (every rank raises the same)."""
    for name, shape in expected.items():
        if name not in tensors:
            raise ConfigError(f"checkpoint {path} has no {what} tensor '{name}'; it is partial or was "
                              "written for another model")
        got = tuple(tensors[name].shape)
        if got != shape:
            raise ConfigError(f"checkpoint {path}: {what} tensor '{name}' has shape {list(got)} but this "
                              f"model expects {list(shape)}; the checkpoint was written for a model of "
                              "another shape (compare the [model] settings)")
