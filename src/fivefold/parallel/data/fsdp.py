"""ZeRO-3 with PyTorch's FSDP2 `fully_shard`: parameters, gradients and optimizer state sharded.

Each transformer block is one FSDP unit (gathered just before it runs, freed right after forward,
gathered again for backward); the root unit holds the embedding, final norm and output layer.
Under the zero-bubble pipeline schedules blocks stay gathered from forward to backward
(`reshard_after_forward=False`): their backward is split into an input pass and a weight pass, and
PyTorch's pipeline stage collects the weights for the second from the module's parameters at the
start of the first — sharded ones would be missed, and their gradients silently lost.
With dp_replicate > 1 the mesh is 2-D and FSDP2 runs HSDP: shard inside, replicate across.
Under bf16 the shards are the fp32 master weights and FSDP2's MixedPrecisionPolicy does the rest
(torchtitan's recipe): weights all-gathered in bf16, gradients reduce-scattered in fp32.
Every micro-batch's gradients are reduce-scattered (FSDP2's default, under the backward that
follows) and the shards accumulate them. Holding them back until the step's last micro-batch would
keep each unit's whole gradient, upcast to fp32 under bf16, from the first backward to the step:
4 bytes per weight of the rank's model, more than ZeRO-3's sharded state saves.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fivefold.models.moe.layer import moe_layers
from fivefold.parallel.data.base import DataParallel


class FullyShardedDataParallel(DataParallel):
    def __init__(self, parts, dims, mesh, reshard_after_forward: bool = True, bf16: bool = False):
        hsdp = dims.dp_replicate > 1
        precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                     if bf16 else MixedPrecisionPolicy())
        shard = {"reshard_after_forward": reshard_after_forward, "mp_policy": precision}
        # cp ranks hold the same weights as their dp peers, so they shard them together.
        self.dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if hsdp else mesh["dp_shard_cp"]
        for part in parts:
            for block in part.layers.values():
                for moe in moe_layers(block) if dims.ep > 1 else []:
                    # Expert weights: sharded over the ranks holding the same experts, gradients summed
                    # there and divided by all dp·cp ranks (an expert saw its whole ep group's tokens).
                    experts = moe.experts
                    fully_shard(experts, mesh=mesh["edp"], **shard)
                    experts.set_gradient_divide_factor(float(dims.dp * dims.cp))
                    # Sum, then divide (gloo has no PREMUL_SUM); not on one rank, where FSDP divides
                    # without communicating and a forced sum would divide a second time.
                    experts.set_force_sum_reduction_for_comms(mesh["edp"].size() > 1)
                fully_shard(block, mesh=self.dp_mesh, **shard)
            fully_shard(part, mesh=self.dp_mesh, mp_policy=precision)
        super().__init__(parts, dims)  # parameters are DTensors from here on
        self.name = (f"zero 3 (FSDP2): parameters, gradients and optimizer state sharded over "
                     f"{dims.dp_shard * dims.cp} ranks" + (f", replicated x{dims.dp_replicate} (HSDP)" if hsdp else "")
                     + ("; fp32 shards, bf16 all-gathers, fp32 reduce-scatters" if bf16 else ""))
