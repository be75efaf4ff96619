"""Communication of one rank: bytes per step for each parallel dimension, and the time each
collective takes given where its group sits (parallel.order, GPUs per node).

Volumes: ring all-reduce moves 2(N-1)/N of the buffer per rank, reduce-scatter and all-gather
(N-1)/N each; tensor parallelism (with or without sequence parallelism) moves 8 b s h (t-1)/t
elements per layer per micro-batch (Korthikanti et al. 2022); a pipeline boundary carries b s h
each way per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fivefold.config import ConfigError
from fivefold.mesh import ParallelDims
from fivefold.plan.hardware import Hardware
from fivefold.plan.layout import Layout


@dataclass(frozen=True)
class Link:
    """Where a process group sits: how many members, how many of them share a node."""
    size: int
    per_node: int

    @property
    def intra_node(self) -> bool:
        return self.per_node >= self.size


def placement(layout: Layout, order: tuple[str, ...], dims: tuple[str, ...], gpus_per_node: int) -> Link:
    """The group formed by mesh dimensions `dims` (adjacent in `order`), ranks numbered with the
    last dimension of `order` innermost."""
    degree = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
    inner = order[max(order.index(d) for d in dims) + 1:]
    stride = math.prod(degree[d] for d in inner)
    size = math.prod(degree[d] for d in dims)
    if size * stride <= gpus_per_node:
        return Link(size, size)
    if stride >= gpus_per_node:
        return Link(size, 1)
    return Link(size, max(1, gpus_per_node // stride))


def group_link(groups: list[list[int]], gpus_per_node: int) -> Link:
    """The Link of the worst of these equal-sized groups of global ranks (ranks numbered node by
    node): per_node is the fewest members any node holds of one group, since a member there has
    the largest share of its all-to-all off the node and a ring through there the fewest NICs."""
    nodes = np.asarray(groups) // gpus_per_node
    n_nodes = int(nodes.max()) + 1
    rows = np.arange(len(nodes))[:, None]
    counts = np.bincount((rows * n_nodes + nodes).ravel(), minlength=len(nodes) * n_nodes)
    return Link(nodes.shape[1], int(counts[counts > 0].min()))


def expert_links(layout: Layout, order: tuple[str, ...], gpus_per_node: int) -> tuple[Link, Link]:
    """(ep group, expert-data-parallel group) as the trainer builds them (mesh.py `expert_groups`,
    the same arithmetic): ep takes a pipeline stage's dp·cp ranks first and its tp ranks only
    beyond them. An ep group larger than dp·cp is then all of the stage's dp·cp ranks at
    ep/(dp·cp) tp positions (ep8 over dp2·cp2·tp2 with tp innermost: a stage's 8 consecutive
    ranks, one node), not ranks tp apart; the edp group (dp·cp·tp/ep ranks holding the same
    experts) spans tp ranks too. parallel.order moves both."""
    if layout.ep == 1:
        return Link(1, 1), Link(1, 1)
    if (layout.dp * layout.cp * layout.tp) % layout.ep:
        raise ConfigError(f"layout ep={layout.ep} must divide dp*cp*tp = "
                          f"{layout.dp * layout.cp * layout.tp} (ep borrows its ranks from them)")
    shard = layout.dp_shard or layout.dp
    return _expert_links(layout.dp // shard, shard, layout.tp, layout.pp, layout.cp, layout.ep,
                         tuple(order), gpus_per_node)


@lru_cache(maxsize=4096)  # a search plans many layouts over the same degrees
def _expert_links(dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, ep: int,
                  order: tuple[str, ...], gpus_per_node: int) -> tuple[Link, Link]:
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
    ep_groups, edp_groups = dims.expert_groups()
    return group_link(ep_groups, gpus_per_node), group_link(edp_groups, gpus_per_node)


def data_parallel_links(layout: Layout, order: tuple[str, ...], gpus_per_node: int) -> tuple[Link, Link, Link]:
    """(the dp·cp group, the group a dense tensor's ZeRO shards span, the group an expert
    tensor's span) as the trainer builds them: dp and cp form one group where they are adjacent in
    parallel.order; dense shards span dp_shard·cp ranks (all of dp without HSDP); experts under ep
    the expert-data-parallel group (expert_links), without ep the dense shard group."""
    dims = ("dp", "cp") if abs(order.index("dp") - order.index("cp")) == 1 else ("dp",)
    group = placement(layout, order, dims, gpus_per_node)
    dense = Link(layout.shard_degree, min(group.per_node, layout.shard_degree))
    experts = expert_links(layout, order, gpus_per_node)[1] if layout.ep > 1 else dense
    return group, dense, experts


def nodes_spanned(link: Link) -> int:
    return 1 if link.intra_node else math.ceil(link.size / max(1, link.per_node))


def fabric_falloff(link: Link, hw: Hardware) -> float:
    """How much slower than its NICs' rate a group spanning several nodes runs because of the
    fabric: 1 on a full-bisection fat tree (every NIC reaches any node at full rate), and
    1 + (nodes - 1) / fabric_nodes on a tapered one (Hardware.fabric)."""
    if hw.fabric != "tapered" or link.intra_node:
        return 1.0
    return 1 + (nodes_spanned(link) - 1) / hw.fabric_nodes


def _bandwidth(link: Link, hw: Hardware) -> tuple[float, float]:
    """(bus bandwidth per rank, latency per ring step) of a collective on this group: NVLink
    inside a node; across nodes the NICs of the members sharing a node (slower on a tapered
    fabric, fabric_falloff)."""
    if link.intra_node:
        return hw.intra_bw, hw.intra_latency_s
    return min(hw.intra_bw, link.per_node * hw.nic_bw) / fabric_falloff(link, hw), hw.inter_latency_s


def all_reduce_time(nbytes: float, link: Link, hw: Hardware, efficiency: float = 1.0) -> float:
    """Large gradient buffers: NCCL pipelines them, so the ring's n-1 step latencies are paid
    about once per reduce-scatter and once per all-gather half."""
    if link.size <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _bandwidth(link, hw)
    return 2 * (link.size - 1) / link.size * nbytes / (bw * efficiency) + 2 * (link.size - 1) * lat


def gather_time(nbytes: float, link: Link, hw: Hardware, efficiency: float = 1.0) -> float:
    """All-gather or reduce-scatter (ring, n-1 steps) whose full (unsharded) buffer is nbytes."""
    if link.size <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _bandwidth(link, hw)
    return (link.size - 1) / link.size * nbytes / (bw * efficiency) + (link.size - 1) * lat


def all_to_all_time(sent_bytes: float, link: Link, hw: Hardware) -> float:
    """An all-to-all in which each rank sends sent_bytes, spread evenly over the other members;
    across nodes the off-node share goes through the rank's own NIC while the share for the
    per_node - 1 members on its node crosses NVLink at the same time."""
    if link.size <= 1 or sent_bytes <= 0:
        return 0.0
    if link.intra_node:
        return sent_bytes / hw.intra_bw + hw.intra_latency_s
    falloff = fabric_falloff(link, hw)
    off_node = sent_bytes * (link.size - link.per_node) / (link.size - 1)
    return max(off_node * falloff / hw.nic_bw, (sent_bytes - off_node) / hw.intra_bw) + hw.inter_latency_s


def collective_bytes_time(sent_bytes: float, link: Link, hw: Hardware) -> float:
    """Bandwidth time of sent_bytes over the group's links (context-parallel passes)."""
    if link.size <= 1 or sent_bytes <= 0:
        return 0.0
    return sent_bytes / _bandwidth(link, hw)[0]


def p2p_time(nbytes: float, link: Link, hw: Hardware) -> float:
    if link.size <= 1 or nbytes <= 0:
        return 0.0
    if link.intra_node:
        return nbytes / hw.intra_bw + hw.intra_latency_s
    return nbytes / hw.nic_bw + hw.inter_latency_s


# ------------------------------------------------------------------------ per-dimension volumes

def tp_bytes_per_collective(layout: Layout, tokens: float, dim: int, nbytes: int) -> float:
    """Bytes one rank sends in one all-gather or reduce-scatter of a micro-batch's hidden states
    (a layer has 8 of them, forward + backward)."""
    t = layout.tp
    return 0.0 if t == 1 else tokens * dim * (t - 1) / t * nbytes


def cp_bytes_per_layer(layout: Layout, tokens_local: float, q_dim: int, k_dim: int, v_dim: int,
                       o_dim: int, act_bytes: int) -> float:
    """Bytes one rank sends for one attention of one micro-batch (forward + backward).
    ring: K,V go round the ring in forward (c-1 hops); in backward K,V again (c-1) and dK,dV,
    which must also come home to their owner (c hops): 3c-2 hops of the local K,V.
    allgather: gather K,V in forward, again in backward, reduce-scatter dK,dV.
    ulysses: all-to-all of q, k, v and the output, forward and backward.
    Widths are heads x head dim, which need not be the model's dim; V and the output have the value
    head dim (latent attention's differs from q/k's)."""
    c, t = layout.cp, layout.tp
    if c == 1:
        return 0.0
    kv_local = tokens_local * (k_dim + v_dim) / t * act_bytes
    if layout.cp_method == "ring":
        return (3 * c - 2) * kv_local
    if layout.cp_method == "allgather":
        return 3 * (c - 1) * kv_local
    qkvo_local = tokens_local * (q_dim + k_dim + v_dim + o_dim) / t * act_bytes
    return 2 * (c - 1) / c * qkvo_local


def ep_bytes_per_moe_layer(layout: Layout, tokens_local: float, dim: int, top_k: int,
                           act_bytes: int) -> float:
    """Dispatch and combine, forward and backward: four all-to-alls of top_k copies of each
    token the rank routes (tokens_local: its 1/tp slice of the micro-batch's tokens under tp,
    parallel/tensor/apply.py), of which the (ep-1)/ep meant for the other members leave the rank;
    whether ep borrows tp ranks does not change that."""
    e = layout.ep
    return 0.0 if e == 1 else 4 * tokens_local * top_k * dim * act_bytes * (e - 1) / e


def pp_bytes_per_microbatch(layout: Layout, tokens_local: float, dim: int, act_bytes: int,
                            chunks: int, scatter_gather: bool = False) -> float:
    """Activation out and its gradient back, for each chunk boundary this rank owns. Each tp rank
    sends its 1/tp of the sequence under sequence parallelism, and also without it where the
    framework scatters the replicated activation over the tp ranks and all-gathers it over NVLink
    on arrival (Megatron's scatter/gather optimisation, Narayanan et al. 2021 s4.1)."""
    if layout.pp == 1:
        return 0.0
    seq_split = layout.tp if (layout.tp > 1 and (layout.sp or scatter_gather)) else 1
    return 2 * chunks * tokens_local * dim / seq_split * act_bytes
