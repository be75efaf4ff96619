"""Expert parallelism (ours): each rank of an ep group keeps n_experts/ep of every MoE layer's
experts, and tokens travel to their expert and back by all-to-all.

The single-device MoE (models/moe/layer.py) routes, applies capacity and sorts its assignments by expert
on the rank that holds the tokens; only `MoE.run_experts` is replaced here. A call:
1. exchange counts: how many rows this rank sends to each expert (an even all-to-all of E ints);
2. dispatch: all-to-all of the rows, uneven sizes (rank r gets the rows for its experts);
3. compute: rows arrive grouped by source rank, then expert; regroup by expert for the grouped
   matmul, and back;
4. combine: the reverse all-to-all returns the outputs in the order the rows were sent.
Both all-to-alls are one autograd function whose backward is the reverse all-to-all, so gradients
take the same routes back. Expert gradients are then reduced over the expert-data-parallel group
(parallel/data/: replicate.py, zero.py, fsdp.py), dense ones over dp·cp.

Also here: the per-step router bookkeeping (load reduced over dp·cp, and over tp where the tp ranks
route different slices of the tokens; bias balancing, metrics), which every layout shares.
Under tensor parallelism each tp rank routes its own slice of the tokens (parallel/tensor/apply.py), and
the ep group may borrow tp ranks (mesh.py `expert_groups`): a tp rank is then one more rank
sending its tokens to the experts, and the dispatch below does not change.

With `parallel.ep_replicas`, a rank also computes, in replica slots, some rows of experts other
ranks own (parallel/expert/replicas.py): each destination rank's columns are then its own experts
and its slots, and the rows are laid out by column before the dispatch and put back after it.

Expert tensors are found through the shared MoE block (models/moe/layer.py), whatever the family: every
parameter of an `MoE.experts` module is stacked (experts, ...) along dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fivefold.models.moe.layer import MoE, is_expert_param, moe_layers
from torch.distributed.tensor import DTensor

from fivefold.parallel.collectives import all_reduce_scalars
from fivefold.parallel.expert.replicas import ReplicaSlots, rank_loads
from fivefold.parallel.step_hooks import StepHook


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class ExpertParallelDispatch:
    """Stands in for `MoE.run_experts` on a rank holding experts [first, first + n_local)."""

    def __init__(self, moe: MoE, group, n_local: int, n_slots: int = 0):
        self.moe, self.group, self.n_local = moe, group, n_local
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0  # forward dispatch rows leaving this rank, for benchmarks/moe.py
        self.replicas = ReplicaSlots(moe.experts, group, n_local, n_slots) if n_slots else None

    def rank_loads(self, load: list[float]) -> list[float]:
        """Rows of a step's `load` (per expert) each ep rank computes, replicas where they run."""
        if self.replicas is not None:
            return self.replicas.rank_loads(load)
        return rank_loads(load, self.ep, self.n_local, None)

    def __call__(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep = self.ep
        # Columns: the experts (and replica slots) of each destination rank, `width` per rank.
        columns, layout = self.replicas.split(counts) if self.replicas is not None else (counts, None)
        if layout is not None:
            routed = routed[layout.to(routed.device)]
        width = len(columns) // ep
        sent = torch.tensor(columns, dtype=torch.long, device=routed.device)
        received = _all_to_all(sent, [width] * ep, [width] * ep, self.group)
        from_rank = received.view(ep, width).tolist()  # [source rank][local column] rows
        send_splits = [sum(columns[r * width:(r + 1) * width]) for r in range(ep)]
        recv_splits = [sum(row) for row in from_rank]
        rows = AllToAll.apply(routed, recv_splits, send_splits, self.group)
        self.bytes_sent += (sum(send_splits) - send_splits[self.rank]) * routed.shape[-1] * routed.element_size()

        order = expert_major_order(from_rank, rows.device)
        local_counts = [sum(row[e] for row in from_rank) for e in range(width)]
        out = self._compute(rows[order], local_counts)
        back = out[torch.argsort(order)]  # undo the regrouping
        out = AllToAll.apply(back, send_splits, recv_splits, self.group)
        return out if layout is None else out[torch.argsort(layout.to(out.device))]

    def _compute(self, rows: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
        """Own experts' rows first, then the replica slots' (when there are slots in the plan)."""
        if len(local_counts) == self.n_local:
            return self.moe.experts(rows, local_counts)
        own = sum(local_counts[:self.n_local])
        return torch.cat([self.moe.experts(rows[:own], local_counts[:self.n_local]),
                          self.replicas.run(rows[own:], local_counts[self.n_local:])])


def expert_major_order(from_rank: list[list[int]], device) -> torch.Tensor:
    """Row indices that turn rows grouped [source rank][expert] into [expert][source rank]."""
    starts, offset = [], 0
    for row in from_rank:
        starts.append([])
        for n in row:
            starts[-1].append(offset)
            offset += n
    pieces = [torch.arange(starts[r][e], starts[r][e] + from_rank[r][e]) for e in range(len(from_rank[0]))
              for r in range(len(from_rank))]
    return torch.cat(pieces).to(device) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def apply_expert_parallel(part: nn.Module, ep_mesh, replicas: int = 0) -> None:
    """Keep this rank's slice of every MoE layer's experts and route through all-to-all
    (`replicas`: replica slots per rank and layer, parallel.ep_replicas)."""
    ep, rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    for moe in moe_layers(part):
        n_local = moe.cfg.n_experts // ep
        first = rank * n_local
        for name, whole in list(moe.experts.named_parameters(recurse=False)):
            # Replicated over tp (parallel/tensor/apply.py): the local tensor. Its gradient, partial over the tp
            # ranks, is then summed by the expert-data-parallel group, which spans them.
            whole = whole.to_local() if isinstance(whole, DTensor) else whole
            setattr(moe.experts, name, nn.Parameter(whole.detach()[first:first + n_local].clone()))
        moe.run_experts = ExpertParallelDispatch(moe, group, n_local, replicas)


def gather_experts(name: str, tensor: torch.Tensor, ep_mesh) -> torch.Tensor:
    """The whole (n_experts, ...) tensor from each ep rank's slice (a collective over ep)."""
    if ep_mesh is None or not is_expert_param(name):
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(ep_mesh.size())]
    dist.all_gather(pieces, tensor.contiguous(), group=ep_mesh.get_group())
    return torch.cat(pieces)


def finish_router_step(parts: list[nn.Module], slice_group, dp_cp_group, n_micro: int, device: torch.device) -> dict:
    """After a step: the load each MoE layer saw over the whole global batch (its `n_micro`
    micro-batches here, summed over dp·cp), the bias update of bias balancing from it, and the
    router metrics: totals over the layers (`moe_tokens_per_expert`, `moe_imbalance` = the worst
    layer's max/mean, `moe_dropped_tokens`, `aux_loss`) and `moe_layers`, the same per layer by
    its index in the model (with the choice bias under bias balancing). Under expert parallelism
    also `moe_rank_imbalance`: the worst layer's max/mean over the ep ranks of the rows each
    computes (chosen assignments, before capacity drops; a replicated expert's shared by its
    copies), and the load feeds the replica plan (parallel/expert/replicas.py). Same in every layout;
    under pipeline parallelism a rank reports the layers of its own stages."""
    named = [(index, moe) for part in parts for index, block in part.layers.items() for moe in moe_layers(block)]
    if not named:
        return {}
    layers = [moe for _, moe in named]
    stats = [m.take_stats(last=n_micro) for m in layers]
    n_experts = layers[0].cfg.n_experts
    loads = [s.load.double().cpu() if s.load is not None else torch.zeros(n_experts, dtype=torch.float64)
             for s in stats]
    aux = [s.aux_loss / s.forwards if s.forwards else 0.0 for s in stats]
    packed = torch.cat([torch.stack(loads).flatten(), torch.tensor([float(s.dropped) for s in stats]),
                        torch.tensor(aux, dtype=torch.float64)])
    ranks = 1
    if slice_group is not None:  # tp ranks routing slices of the same tokens
        ranks = dist.get_world_size(slice_group)
        packed = all_reduce_scalars(packed, slice_group, device)
    if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1:
        ranks *= dist.get_world_size(dp_cp_group)
        packed = all_reduce_scalars(packed, dp_cp_group, device)
    n = len(layers)
    load = packed[:n * n_experts].view(n, n_experts)
    dropped, aux_sum = packed[n * n_experts: n * n_experts + n], packed[n * n_experts + n:]
    imbalance = load.max(1).values / load.mean(1).clamp(min=1e-9)
    per_layer, rank_imbalance = {}, []
    for (index, layer), layer_load, layer_imbalance, layer_dropped in zip(named, load, imbalance, dropped):
        per_layer[index] = {"tokens_per_expert": [int(x) for x in layer_load.tolist()],
                            "imbalance": layer_imbalance.item(), "dropped_tokens": int(layer_dropped.item())}
        dispatch = layer.run_experts
        if isinstance(dispatch, ExpertParallelDispatch):
            per_rank = dispatch.rank_loads(layer_load.tolist())  # under the plan this step ran with
            rank_imbalance.append(max(per_rank) / max(sum(per_rank) / len(per_rank), 1e-9))
            per_layer[index]["rank_imbalance"] = rank_imbalance[-1]
            if dispatch.replicas is not None:
                dispatch.replicas.observe(layer_load)
        if layer.cfg.balance == "bias":
            layer.update_bias(layer_load)
            per_layer[index]["expert_bias"] = layer.router.expert_bias.tolist()  # after this step's update
    metrics = {"moe_tokens_per_expert": [int(x) for x in load.sum(0).tolist()],
               "moe_imbalance": imbalance.max().item(), "moe_dropped_tokens": int(dropped.sum().item()),
               "moe_layers": per_layer}
    if rank_imbalance:
        metrics["moe_rank_imbalance"] = max(rank_imbalance)
    if layers[0].cfg.balance == "aux_loss":
        metrics["aux_loss"] = aux_sum.sum().item() / ranks
    return metrics


class RouterStep(StepHook):
    """MoE layers in a step: after the optimizer step, the step's load over the global batch moves
    the balancing biases and gives the router metrics (finish_router_step). The aux loss weighs like
    each micro-batch's LM loss (models/loss/weight.py, stated by Parallelized.forward_backward).
    `slice_group`: the tp ranks that route slices of the same tokens (their MoE layers run whole
    on each, parallel/tensor/apply.py), or None."""

    def __init__(self, slice_group=None):
        self.slice_group = slice_group

    def after_optimizer_step(self, par, optimizer) -> dict:
        return finish_router_step(par.parts, self.slice_group, par.dp_cp_group, par.n_micro, par.device)
