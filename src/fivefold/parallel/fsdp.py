"""ZeRO-3 with PyTorch's FSDP2 `fully_shard`: parameters, gradients and optimizer state sharded.

Each transformer block is one FSDP unit (gathered just before it runs, freed right after forward,
gathered again for backward); the root unit holds the embedding, final norm and output layer.
With dp_replicate > 1 the mesh is 2-D and FSDP2 runs HSDP: shard inside, replicate across.
"""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from fivefold.parallel.data import DataParallel


class FullyShardedDataParallel(DataParallel):
    def __init__(self, model, dims, mesh):
        hsdp = dims.dp_replicate > 1
        # cp ranks hold the same weights as their dp peers, so they shard them together.
        self.dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if hsdp else mesh["dp_shard_cp"]
        self.units = []
        for block in model.layers.values():
            fully_shard(block, mesh=self.dp_mesh, reshard_after_forward=True)
            self.units.append(block)
        fully_shard(model, mesh=self.dp_mesh)
        super().__init__(model, dims)  # parameters are DTensors from here on
        self.name = (f"zero 3 (FSDP2): parameters, gradients and optimizer state sharded over "
                     f"{dims.dp_shard * dims.cp} ranks" + (f", replicated x{dims.dp_replicate} (HSDP)" if hsdp else ""))

    def begin_micro_batch(self, is_last: bool) -> None:
        # Accumulate unreduced gradients until the last micro-batch, then reduce-scatter once.
        self.model.set_requires_gradient_sync(is_last)
