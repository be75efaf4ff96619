"""ParallelDims: the parallel degrees, the one DeviceMesh built from them, and named views of it.

Mesh dimensions, outermost first, follow `parallel.order` (default pp, dp, cp, tp): tp innermost
puts a tensor-parallel group on consecutive ranks (one node), pp and dp outermost put their
traffic, the rarest, on the slow links. dp itself is two dimensions, dp_replicate × dp_shard, so
HSDP (shard inside a group, replicate across groups) needs no other mesh.

Everything except `build_mesh` is pure arithmetic on rank numbers, usable before (and without)
any process group: validation, dry runs and the rank map use it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from fivefold.config import ConfigError, ParallelConfig


def crosses_nodes(group: list[int], ranks_per_node: int) -> bool:
    """Whether a group of global ranks spans more than one node of `ranks_per_node` ranks."""
    return len({r // ranks_per_node for r in group}) > 1


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    order: tuple[str, ...]  # of "pp", "dp", "cp", "tp", outermost first

    @classmethod
    def from_config(cls, p: ParallelConfig) -> "ParallelDims":
        if not p.dp:  # validate(cfg, world_size) resolves it at launch
            raise ConfigError("parallel.dp=0 takes dp from the world size, which is not known here; "
                              "validate the config with the job's world size first (fivefold.configure.validate)")
        shard = p.dp_shard or p.dp
        return cls(dp_replicate=p.dp // shard, dp_shard=shard, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                   order=tuple(d.strip() for d in p.order.split(",")))

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of every mesh dimension, outermost first; dp expanded into its two parts."""
        sizes = {"pp": self.pp, "cp": self.cp, "tp": self.tp}
        dims: list[tuple[str, int]] = []
        for name in self.order:
            if name == "dp":
                dims += [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)]
            else:
                dims.append((name, sizes[name]))
        return tuple(dims)

    def rank_grid(self) -> np.ndarray:
        """Global rank at every mesh coordinate (an array shaped like the mesh)."""
        return np.arange(self.world_size).reshape([size for _, size in self.mesh_dims])

    def groups(self, *names: str) -> list[list[int]]:
        """The rank groups that vary along the named mesh dimensions (e.g. "tp", or "dp_replicate",
        "dp_shard" for all of dp); each rank is in exactly one group."""
        dim_names = [n for n, _ in self.mesh_dims]
        grid = self.rank_grid()
        axes = [dim_names.index(n) for n in names]
        rest = [i for i in range(grid.ndim) if i not in axes]
        moved = np.transpose(grid, rest + axes).reshape(-1, int(np.prod([grid.shape[a] for a in axes])))
        return [row.tolist() for row in moved]

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(ep groups, expert-data-parallel groups).

        ep borrows ranks from dp·cp, and from tp (Megatron's expert-parallel folding): the MoE
        layers route a different slice of the tokens on each tp rank (parallel/tensor/apply.py), so at
        an MoE layer the dp·cp·tp ranks of a pipeline stage all hold different tokens. Their row
        (tp outermost, then dp·cp in mesh order) is cut into consecutive blocks of ep ranks, which
        split the experts among them: ep takes dp·cp ranks first, as without tp, and tp ranks only
        once ep exceeds dp·cp. The ranks at the same place of every block hold the same experts
        and reduce or shard their gradients together (the expert-data-parallel group,
        dp·cp·tp/ep ranks: tp ranks holding the same experts add their tokens' partial gradients
        there)."""
        ep_groups, edp_groups = [], []
        for blocks in self._expert_blocks():
            ep_groups += blocks
            # Ascending too (tp outermost interleaves them, e.g. [0, 4, 1, 5]): FSDP2 picks a rank's
            # shard by its process-group rank, DTensor by its place in the mesh; they must agree.
            edp_groups += [sorted(block[j] for block in blocks) for j in range(self.ep)]
        return ep_groups, edp_groups

    def _expert_blocks(self) -> list[list[list[int]]]:
        """Per row of `expert_groups`, its ep blocks, each in ascending rank order: a process
        group numbers its ranks so, and a rank's place in its block says which experts it holds."""
        rows = self.groups(*self.expert_token_dims)
        return [[sorted(row[i:i + self.ep]) for i in range(0, len(row), self.ep)] for row in rows]

    @property
    def token_dims(self) -> list[str]:
        """Mesh dimensions whose ranks hold different tokens of a step (and the same weights)."""
        return [n for n, _ in self.mesh_dims if n in ("dp_replicate", "dp_shard", "cp")]

    @property
    def expert_token_dims(self) -> list[str]:
        """The same at an MoE layer, tp outermost (see `expert_groups`)."""
        return ["tp", *self.token_dims]

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same experts (1 without expert parallelism: no expert group)."""
        return self.dp * self.cp * self.tp // self.ep if self.ep > 1 else 1

    def coordinates(self, rank: int) -> dict[str, int]:
        where = np.argwhere(self.rank_grid() == rank)[0]
        return {name: int(i) for (name, _), i in zip(self.mesh_dims, where)}

    def warn_if_tp_crosses_nodes(self, ranks_per_node: int) -> None:
        crossing = [g for g in self.groups("tp") if crosses_nodes(g, ranks_per_node)]
        if self.tp > 1 and crossing:
            warnings.warn(f"tensor-parallel group {crossing[0]} spans nodes of {ranks_per_node} ranks: "
                          "its all-reduces will cross the slow network; put tp last in parallel.order "
                          "or lower parallel.tp", stacklevel=2)

    def build_mesh(self, device_type: str) -> "Meshes":
        """The DeviceMesh over all ranks, with flattened views: "dp" (all data-parallel ranks),
        "dp_cp" (the ranks that reduce gradients and average the loss together) and "dp_shard_cp"
        (the ranks that shard parameters / optimizer state: cp ranks hold the same weights as
        their dp peers, so they share the shards)."""
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(n for n, _ in self.mesh_dims)
        root = init_device_mesh(device_type, tuple(s for _, s in self.mesh_dims), mesh_dim_names=names)
        flattened = {"dp": root["dp_replicate", "dp_shard"]._flatten("dp"),
                     "dp_cp": root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
                     "dp_shard_cp": root["dp_shard", "cp"]._flatten("dp_shard_cp")}
        if self.ep > 1:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            import torch.distributed as dist

            # A second mesh over the same ranks: one row per expert-data-parallel group.
            ep_groups, edp_groups = self.expert_groups()
            experts = DeviceMesh(device_type, torch.tensor(edp_groups), mesh_dim_names=("edp_rest", "edp"))
            # The ep group gets a process group of its own even when it spans the world (a mesh would
            # reuse the world group), so the ledger can tell all-to-all traffic from dp traffic.
            mine, _ = dist.new_subgroups_by_enumeration(ep_groups)
            my_ranks = next(g for g in ep_groups if dist.get_rank() in g)
            ep_mesh = DeviceMesh.from_group(mine, device_type, mesh=my_ranks, mesh_dim_names=("ep",))
            flattened.update(ep=ep_mesh, edp=experts["edp"])
        return Meshes(root, flattened)


class Meshes:
    """`meshes["tp"]`, `meshes["dp_replicate", "dp_shard"]`, `meshes["dp_cp"]`: sub-meshes by name.

    Flattened views are kept here rather than sliced from the root again (PyTorch asks callers to
    hold on to them)."""

    def __init__(self, root, flattened: dict):
        self.root, self._flattened = root, flattened

    def __getitem__(self, names):
        if isinstance(names, str) and names in self._flattened:
            return self._flattened[names]
        return self.root[names]
