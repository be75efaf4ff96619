"""The rank map: which global ranks form each group and what each rank holds, without training.

Pure arithmetic on the config (ParallelDims for groups and coordinates, pipeline_split for stages
and layers): no process group, no model, so `fivefold layout CONFIG` answers in milliseconds for a
16-rank laptop run or a 1024-GPU job alike. It is the same arithmetic the trainer uses to build its
meshes and split its model, so what it prints is what a run does.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import Config
from fivefold.mesh import ParallelDims, crosses_nodes
from fivefold.plan.pipeline.stage_split import layers_per_stage, stages_of_rank

# Long listings are cut (a 1024-rank job has 512 tp groups); `--all` prints everything.
MAX_GROUPS = 8
MAX_RANKS = 32


@dataclass
class RankInfo:
    rank: int
    node: int
    coords: dict[str, int]  # pp, dp, cp, tp, ep (position inside its group)
    stages: list[int]
    layers: list[int]
    embedding: bool  # holds the token embedding (first stage)
    output: bool  # holds the output layer and the loss (last stage)
    heads: tuple[int, int]  # [first, last) query heads of its tensor-parallel slice
    experts: tuple[int, int] | None  # [first, last) experts of its MoE layers; None when dense


def rank_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Every kind of group, by name, each a list of global-rank lists."""
    groups = {"tp": dims.groups("tp"), "cp": dims.groups("cp"), "pp": dims.groups("pp"),
              "dp": dims.groups("dp_replicate", "dp_shard")}
    if dims.ep > 1:
        groups["ep"], groups["edp"] = dims.expert_groups()
    return groups


def rank_infos(cfg: Config, dims: ParallelDims) -> list[RankInfo]:
    p, m = cfg.parallel, cfg.model
    n_stages = p.pp * p.pp_virtual
    stage_layers = (layers_per_stage(m, n_stages, p.pp_layers, cfg.train.seq_len) if p.pp > 1
                    else [list(range(m.n_layers))])
    ep_position = {}
    if dims.ep > 1:
        for group in dims.expert_groups()[0]:
            ep_position.update({r: i for i, r in enumerate(group)})
    heads_per_tp = m.n_heads // p.tp
    per_ep = m.moe.n_experts // max(dims.ep, 1)
    infos = []
    for rank in range(dims.world_size):
        c = dims.coordinates(rank)
        coords = {"pp": c["pp"], "dp": c["dp_replicate"] * dims.dp_shard + c["dp_shard"], "cp": c["cp"],
                  "tp": c["tp"], "ep": ep_position.get(rank, 0)}
        stages = stages_of_rank(c["pp"], p.pp, p.pp_virtual, p.pp_schedule) if p.pp > 1 else [0]
        layers = sorted(i for s in stages for i in stage_layers[s])
        e = coords["ep"]
        infos.append(RankInfo(rank=rank, node=rank // p.gpus_per_node, coords=coords, stages=stages,
                              layers=layers, embedding=0 in stages, output=len(stage_layers) - 1 in stages,
                              heads=(c["tp"] * heads_per_tp, (c["tp"] + 1) * heads_per_tp),
                              experts=(e * per_ep, (e + 1) * per_ep) if m.moe.n_experts else None))
    return infos


def _span(items: list[int]) -> str:
    """[0,1,2,5,6] -> '0-2,5-6'."""
    out, start = [], None
    for i, x in enumerate(items):
        if start is None:
            start = x
        if i + 1 == len(items) or items[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out) or "-"


def _moe_layers(cfg: Config, layers: list[int]) -> list[int]:
    from fivefold.models.moe.layout import is_moe_layer

    return [i for i in layers if is_moe_layer(cfg.model, i)]


def _header(cfg: Config, dims: ParallelDims) -> list[str]:
    p = cfg.parallel
    nodes = -(-dims.world_size // p.gpus_per_node)
    parts = [f"dp={p.dp} (zero {p.zero}" + (f", HSDP shard {dims.dp_shard}" if dims.dp_replicate > 1 else "")
             + ")", f"tp={p.tp}" + (" +sp" if p.tp > 1 and p.sp else ""),
             f"pp={p.pp}" + (f" ({p.pp_schedule}, {p.pp * p.pp_virtual} stages)" if p.pp > 1 else ""),
             f"cp={p.cp}" + (f" ({p.cp_method})" if p.cp > 1 else ""), f"ep={p.ep}"]
    return [f"layout: {' x '.join(parts)} = {dims.world_size} ranks",
            f"mesh order (outermost first): {p.order}; {p.gpus_per_node} ranks per node -> {nodes} node(s)"]


def format_rank_map(cfg: Config, show_all: bool = False) -> str:
    """The whole map as text (the `fivefold layout` output, and the demo's opening lines)."""
    dims = ParallelDims.from_config(cfg.parallel)
    gpn = cfg.parallel.gpus_per_node
    lines = _header(cfg, dims)
    lines.append("groups (global ranks; '*' marks a group that crosses a node boundary):")
    for name, groups in rank_groups(dims).items():
        if len(groups[0]) == 1:
            continue  # degree 1: every rank alone, nothing to say
        crossing = sum(crosses_nodes(g, gpn) for g in groups)
        shown = groups if show_all else groups[:MAX_GROUPS]
        text = " ".join(("*" if crosses_nodes(g, gpn) else "") + "[" + ",".join(map(str, g)) + "]" for g in shown)
        more = f" ... ({len(groups)} groups)" if len(shown) < len(groups) else ""
        where = f"{crossing} of {len(groups)} cross nodes" if crossing else "all inside one node"
        lines.append(f"  {name:<4}{len(groups[0]):>3} ranks, {where}: {text}{more}")
    lines.append("ranks (position in each group; what the rank holds):")
    infos = rank_infos(cfg, dims)
    for info in infos if show_all else infos[:MAX_RANKS]:
        c = info.coords
        held = f"layers {_span(info.layers)}"
        if info.embedding or info.output:
            held += " +" + "+".join(n for n, on in (("embedding", info.embedding), ("output", info.output)) if on)
        if cfg.parallel.tp > 1:
            held += f"; heads {info.heads[0]}-{info.heads[1] - 1} of {cfg.model.n_heads}"
        if info.experts is not None:
            moe = _moe_layers(cfg, info.layers)
            if moe:
                first, last = info.experts
                which = f"expert {first}" if last - first == 1 else f"experts {first}-{last - 1}"
                held += f"; {which} of {cfg.model.moe.n_experts} in layers {_span(moe)}"
        lines.append(f"  rank {info.rank:>3} node {info.node}: pp{c['pp']} dp{c['dp']} cp{c['cp']} tp{c['tp']} "
                     f"ep{c['ep']} | {held}")
    if len(infos) > MAX_RANKS and not show_all:
        lines.append(f"  ... ({len(infos)} ranks; --all prints every one)")
    return "\n".join(lines)
