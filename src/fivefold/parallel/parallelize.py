"""The one place that turns a freshly built single-device model into this rank's part of a layout.

Order (DESIGN.md): tensor/sequence parallel -> expert -> context -> activation recomputation ->
compile -> data parallel (ZeRO / FSDP). The result, `Parallelized`, is all the trainer sees: it
never asks which dimensions are active.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.config import Config, TrainConfig
from fivefold.mesh import ParallelDims
from fivefold.parallel.comm_ledger import CommLedger
from fivefold.parallel.data import DataParallel, build_data_parallel
from fivefold.parallel.recompute import apply_recompute


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (fp32 for a stable log-softmax)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Parallelized:
    def __init__(self, model: nn.Module, dims: ParallelDims, mesh, data_parallel: DataParallel,
                 n_params: int, loss_parallel: bool):
        self.model, self.dims, self.mesh = model, dims, mesh
        self.data_parallel = data_parallel
        self.n_params = n_params  # of the whole model, for FLOPs
        self._loss_parallel = loss_parallel
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self._dp_cp_group = mesh["dp_cp"].get_group() if mesh is not None else None
        self.ledger = CommLedger(group_dimensions(mesh)) if mesh is not None else None

    def _loss_context(self):
        if self._loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._loss_context():
            return lm_loss(logits, labels)

    def backward(self, loss: torch.Tensor) -> None:
        with self._loss_context():
            loss.backward()

    @staticmethod
    def loss_value(loss: torch.Tensor) -> torch.Tensor:
        """The detached loss as a plain tensor (a vocab-parallel loss is a replicated DTensor)."""
        from torch.distributed.tensor import DTensor

        loss = loss.detach()
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def grad_sync(self, is_last: bool):
        return self.data_parallel.grad_sync(is_last)

    def split_sequence(self, windows: torch.Tensor):
        """(inputs, labels, RoPE positions or None) of this rank from windows of seq_len+1 tokens.
        Context parallelism keeps only this rank's part of each sequence here."""
        return windows[:, :-1], windows[:, 1:], None

    def forward_backward(self, batch: torch.Tensor, n_micro: int, autocast) -> torch.Tensor:
        """Forward, loss and backward of every micro-batch of a step on this rank's share of the
        global batch; returns the sum of the micro-batch losses (each already divided by n_micro)."""
        total = torch.zeros((), device=batch.device)
        for micro, chunk in enumerate(batch.chunk(n_micro)):
            inputs, labels, positions = self.split_sequence(chunk)
            with self.grad_sync(is_last=micro == n_micro - 1):
                with autocast():
                    loss = self.loss(self.model(inputs, positions), labels) / n_micro
                self.backward(loss)
            total += self.loss_value(loss)
        return total

    def finish_grads(self) -> None:
        self.data_parallel.finish_grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.data_parallel.clip_grad_norm(max_norm)

    def optimizer(self, cfg: TrainConfig) -> torch.optim.Optimizer:
        return self.data_parallel.build_optimizer(cfg)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.data_parallel.optimizer_step(optimizer)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.data_parallel.state_bytes(optimizer)

    def measure_comm(self):
        """Context around a step: the collectives inside it are entered in the ledger."""
        return self.ledger if self.ledger is not None else contextlib.nullcontext()

    def comm_bytes_last_step(self) -> dict[str, int]:
        return self.ledger.take() if self.ledger is not None else {}

    def mean_over_dp(self, value: float) -> float:
        """Average a per-rank scalar over the ranks that split the batch (dp and cp)."""
        if self._dp_cp_group is None or dist.get_world_size(self._dp_cp_group) == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, group=self._dp_cp_group)
        return tensor.item() / dist.get_world_size(self._dp_cp_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as one whole CPU tensor under its single-device name (a collective:
        every rank must call it; all get the same result)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, param in self.model.named_parameters():
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = whole.detach().cpu().clone()
        return out

    def describe(self) -> str:
        d = self.dims
        return (f"layout: dp={d.dp} (replicate {d.dp_replicate} x shard {d.dp_shard}) tp={d.tp} "
                f"pp={d.pp} cp={d.cp} ep={d.ep} | {self.n_params / 1e6:.2f}M parameters | "
                f"{self.data_parallel.name}")


def group_dimensions(mesh) -> dict[str, str]:
    """Process-group name -> the dimension its traffic belongs to, for the ledger."""
    dims = {}
    for view, label in (("dp_replicate", "dp"), ("dp_shard", "dp"), ("dp", "dp"), ("dp_cp", "dp"),
                        ("dp_shard_cp", "dp"), ("cp", "cp"), ("tp", "tp"), ("pp", "pp")):
        if mesh[view].size() > 1:
            dims[mesh[view].get_group().group_name] = label
    return dims


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config, device: torch.device) -> Parallelized:
    n_params = sum(p.numel() for p in model.parameters())
    mesh = dims.build_mesh(device.type) if dims.world_size > 1 else None
    if mesh is not None:
        dims.warn_if_tp_crosses_nodes(cfg.parallel.gpus_per_node)
    model.to(device)
    loss_parallel = False
    if dims.tp > 1:
        from fivefold.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=cfg.parallel.sp)
        loss_parallel = True
    apply_recompute(model.layers, cfg.train.recompute)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    data_parallel = build_data_parallel(model, dims, mesh, cfg)
    return Parallelized(data_parallel.model, dims, mesh, data_parallel, n_params, loss_parallel)
