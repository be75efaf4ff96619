"""Issue 9's check of communication against our own runs: the planner's bytes per rank per step
for tp (with and without sequence parallelism, fp32 and bf16), cp (each method), pp (each
schedule kind) and ep equal what the ledger measures in training (the dp stages are checked in
test_data_parallel.py).

Small differences are real traffic the planner leaves out on purpose: scalar all-reduces of the
loss (8 bytes) and of the vocab-parallel softmax (a float per token and rank), and the token
counts an all-to-all exchanges before moving rows (4 bytes per expert)."""

import pytest

from layouts import tiny_config
from ranks import run_on_ranks

from fivefold.plan.layout import Layout

MOE = {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}
FOUR_LAYERS = {"n_layers": 4}
QWEN3 = {"preset": "tiny-qwen3"}  # its family and head_dim; the shape stays tiny_config's
# Multi-head Latent Attention: K and V of other head dims than Q's, a key per head.
DEEPSEEK_V3 = {"preset": "tiny-deepseek-v3", "n_kv_heads": 4}
TWO_RANKS = {
    "tp2": {"parallel": {"tp": 2}},
    "tp2 no-sp": {"parallel": {"tp": 2, "sp": False}},
    # bf16: the layers' collectives move bf16, the embedding's the fp32 residual stream
    "tp2 bf16": {"parallel": {"tp": 2}, "train": {"dtype": "bf16"}},
    "cp2 ring": {"parallel": {"cp": 2}},
    "cp2 allgather": {"parallel": {"cp": 2, "cp_method": "allgather"}},
    "cp2 ulysses": {"parallel": {"cp": 2, "cp_method": "ulysses"}},
    "pp2 1f1b": {"parallel": {"pp": 2}, "train": {"micro_batch": 2}},
    "pp2 interleaved": {"model": FOUR_LAYERS, "parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b",
                                                           "pp_virtual": 2}, "train": {"micro_batch": 2}},
    "dp2 ep2": {"model": {"moe": MOE}, "parallel": {"dp": 2, "ep": 2}},
    # MoE layers route each tp rank's own tokens: no collective with sp, 2 gathers without
    "moe tp2": {"model": {"moe": MOE}, "parallel": {"tp": 2}},
    "moe tp2 no-sp": {"model": {"moe": MOE}, "parallel": {"tp": 2, "sp": False}},
    # Qwen3's queries are wider than the stream (4 heads x 48 = 192 > dim 64): Ulysses moves q and
    # the output at that width, tp the hidden states at dim.
    "qwen3 cp2 ulysses": {"model": QWEN3, "parallel": {"cp": 2, "cp_method": "ulysses"}},
    "qwen3 tp2": {"model": QWEN3, "parallel": {"tp": 2}},
    # MLA: cp moves K and V at their own widths; tp also sums the latent projections' gradients.
    "deepseek tp2": {"model": DEEPSEEK_V3, "parallel": {"tp": 2}},
    "deepseek cp2 ring": {"model": DEEPSEEK_V3, "parallel": {"cp": 2}},
    "deepseek cp2 ulysses": {"model": DEEPSEEK_V3, "parallel": {"cp": 2, "cp_method": "ulysses"}},
}
FOUR_RANKS = {
    "cp4 ring": {"parallel": {"cp": 4}},
    "tp2 pp2": {"model": FOUR_LAYERS, "parallel": {"tp": 2, "pp": 2}, "train": {"micro_batch": 2}},
    "tp2 cp2": {"parallel": {"tp": 2, "cp": 2}},
    "moe dp2 tp2 ep2": {"model": {"moe": MOE}, "parallel": {"dp": 2, "tp": 2, "ep": 2}},  # each tp rank routes its own tokens
    # ep borrowing tp: the ep group is all 4 ranks, each tp rank dispatching its own slice.
    "moe dp2 tp2 ep4": {"model": {"moe": MOE}, "parallel": {"dp": 2, "tp": 2, "ep": 4}},
}


def _ledgers(layouts: dict) -> dict:
    from fivefold.train.trainer import train

    return {label: train(tiny_config({**overrides, "train": {**overrides.get("train", {}), "steps": 2}}))
            .records[-1]["comm_bytes"] for label, overrides in layouts.items()}


def _predicted(overrides: dict) -> dict:
    from fivefold.plan import plan_layout
    from fivefold.plan.layout import layout_from_config

    cfg = tiny_config(overrides)
    return plan_layout(cfg, layout_from_config(cfg), gpu="cpu").comm_bytes


@pytest.fixture(scope="module")
def measured():
    two = run_on_ranks(2, _ledgers, TWO_RANKS)
    four = run_on_ranks(4, _ledgers, FOUR_RANKS)
    return {label: [rank[label] for rank in ranks]
            for ranks, layouts in ((two, TWO_RANKS), (four, FOUR_RANKS)) for label in layouts}


def _dimensions(overrides: dict) -> list[str]:
    return [d for d in ("tp", "cp", "pp", "ep") if overrides["parallel"].get(d, 1) > 1]


@pytest.mark.parametrize("label", [*TWO_RANKS, *FOUR_RANKS])
def test_planned_traffic_equals_the_ledger(measured, label):
    layouts = {**TWO_RANKS, **FOUR_RANKS}
    predicted = _predicted(layouts[label])
    for dim in _dimensions(layouts[label]):
        # The worst rank for tp/cp/pp (all equal here); ep: routing is uneven per rank, so the
        # mean over ranks (the planner assumes balanced routing).
        per_rank = [ledger.get(dim, 0) for ledger in measured[label]]
        got = sum(per_rank) / len(per_rank) if dim == "ep" else max(per_rank)
        if dim == "cp" and "dp" not in measured[label][0]:
            # When cp spans the whole world (dp = 1, no tp/pp), the gradient reduction over dp·cp
            # uses the cp ranks' own process group, so the ledger files it under cp: count it there.
            predicted = {**predicted, "cp": predicted["cp"] + predicted["dp"]}
        want = predicted[dim]
        assert want > 0, (label, dim)
        assert abs(got - want) <= 0.01 * want, f"{label} {dim}: planned {want:,.0f}, ledger {got:,.0f}"


# ------------------------------------------------- collective time by message size, tier and nodes
# Pure model checks (no ranks): latency + size / bandwidth, NVLink inside a node, NICs across, and
# effective bandwidth falling with the nodes a group spans (plan/comm.py, Hardware.fabric_nodes).

def _h100():
    from fivefold.plan.hardware import hardware_for
    return hardware_for("h100")


def test_small_collectives_are_latency_bound_and_large_ones_bandwidth_bound():
    from fivefold.plan.comm import Link, gather_time

    hw, link = _h100(), Link(8, 8)
    small, large = gather_time(1e3, link, hw), gather_time(1e9, link, hw)
    assert small == pytest.approx(7 * hw.intra_latency_s, rel=0.01)  # 7 ring steps, no bytes to speak of
    bandwidth_part = 7 / 8 * 1e9 / hw.intra_bw
    assert large == pytest.approx(bandwidth_part + 7 * hw.intra_latency_s, rel=1e-9)
    assert bandwidth_part > 0.9 * large  # 1 GB: the bytes, not the hops, set the time


def test_crossing_nodes_costs_the_network_tier_and_only_a_tapered_fabric_falls_with_node_count():
    import dataclasses

    from fivefold.plan.comm import Link, all_reduce_time

    hw, nbytes = _h100(), 4e9
    inside = all_reduce_time(nbytes, Link(8, 8), hw)
    across = [all_reduce_time(nbytes, Link(8 * k, 8), hw) for k in (2, 8, 64)]
    assert inside < across[0]  # NVLink 360 GB/s against 8 NICs x 40 GB/s, and IB hops
    # full bisection (the default): the NICs' rate whatever the nodes spanned; only the ring's
    # (n-1)/n share and its hops grow
    per_byte = 2 * (511 / 512) * nbytes / (8 * hw.nic_bw)
    assert across[2] - 2 * 511 * hw.inter_latency_s == pytest.approx(per_byte, rel=1e-6)
    # a tapered fabric: bandwidth down by 1 + 63 / fabric_nodes at 64 nodes (spine traffic)
    tapered = dataclasses.replace(hw, fabric="tapered")
    slower = [all_reduce_time(nbytes, Link(8 * k, 8), tapered) for k in (2, 8, 64)]
    assert slower[0] < slower[1] < slower[2]
    assert slower[2] - 2 * 511 * hw.inter_latency_s == pytest.approx(per_byte * (1 + 63 / hw.fabric_nodes), rel=1e-6)


# ------------------------------------------------- expert parallelism borrowing tp: where, how much
# mesh.py `expert_groups` cuts each pipeline stage's row of ranks (tp outermost, then dp·cp) into
# blocks of ep; the planner takes the ep and edp groups from there (comm.expert_links).
ORDER = ("pp", "dp", "cp", "tp")


def test_ep_groups_sit_where_the_mesh_puts_them():
    from fivefold.plan.comm import Link, expert_links

    # dp2 tp2 pp2 cp2 ep8: rank = 8 pp + 4 dp + 2 cp + tp, so a stage is 8 consecutive ranks and ep8
    # is the whole stage (0-7 and 8-15); edp = dp·cp·tp/ep = 1. On 8-GPU nodes that is one node
    # (NVLink; the estimate used to place an ep member every tp = 2 ranks: 4 per node, 2 nodes),
    # on 4-GPU nodes two nodes of 4.
    full = Layout(dp=2, tp=2, pp=2, cp=2, ep=8)
    assert expert_links(full, ORDER, 8) == (Link(8, 8), Link(1, 1))
    assert expert_links(full, ORDER, 4) == (Link(8, 4), Link(1, 1))
    # dp2 tp4 ep4 (2 dp x 2 tp ranks): rank = 4 dp + tp; the row (tp outermost, then dp) is
    # 0 4 1 5 | 2 6 3 7: ep groups {0,1,4,5} and {2,3,6,7}, 2 members on each of 2 nodes of 4 GPUs.
    # The edp groups (dp·cp·tp/ep = 2: the same place in both blocks) {0,2} {1,3} {4,6} {5,7} stay
    # inside a node (the estimate used to take the dp group, {0,4}: across nodes).
    assert expert_links(Layout(dp=2, tp=4, ep=4), ORDER, 4) == (Link(4, 2), Link(2, 2))
    # ep inside dp only (configs/deepseek-v3.toml: dp64 pp32 ep8): an ep group is 8 consecutive
    # ranks, one node; its edp group every 8th rank of the stage: 8 nodes, one member on each.
    assert expert_links(Layout(dp=64, pp=32, ep=8), ORDER, 8) == (Link(8, 8), Link(8, 1))
    # Against the mesh itself, for another parallel.order: the ranks of every group, and the Links.
    from fivefold.mesh import ParallelDims
    from fivefold.plan.comm import group_link

    order = ("dp", "tp", "pp", "cp")
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=2, cp=2, ep=8, order=order)
    ep_groups, edp_groups = dims.expert_groups()
    # strides dp 8, tp 4, pp 2, cp 1: stage 0 is {0,1,4,5,8,9,12,13}, 2 ranks on each of 4 nodes of 4
    assert ep_groups[0] == [0, 1, 4, 5, 8, 9, 12, 13]
    got = expert_links(Layout(dp=2, tp=2, pp=2, cp=2, ep=8), order, 4)
    assert got == (group_link(ep_groups, 4), group_link(edp_groups, 4)) == (Link(8, 2), Link(1, 1))


def _mixtral(seq_len: int = 4096, global_batch: int = 8):
    from fivefold.configure import load_config
    from fivefold.plan.workload import workload_from_config

    return workload_from_config(load_config(None, ["--model.preset", "mixtral-8x7b", "--train.dtype", "bf16",
                                                   "--train.seq_len", str(seq_len),
                                                   "--train.global_batch", str(global_batch)]))


def test_ep_borrowing_tp_traffic_and_time_by_hand():
    import dataclasses

    from fivefold.plan.estimate import estimate
    from fivefold.plan.speed.frameworks import DEFAULT_RUNTIME

    # Mixtral 8x7B (32 MoE layers, dim 4096, top-2), seq 4096, bf16, dp2 tp2 cp2 ep8 (ep > dp·cp = 4:
    # it borrows tp), mbs 1, global batch 8: m = 8 / 2 = 4 micro-batches. Per micro-batch a rank
    # holds 4096 / cp2 = 2048 tokens and its tp slice routes 2048 / tp2 = 1024 of them; one
    # all-to-all sends 1024 x 2 copies x 4096 x 2 bytes x 7/8 (to the 7 others) = 14,680,064 bytes;
    # 4 per layer (dispatch, combine, forward and backward), 32 layers, 4 micro-batches:
    # 4 x 32 x 4 x 14,680,064 = 7,516,192,768 bytes per step.
    # An even load (the busiest rank's extra rows: tests/test_plan_moe_load.py).
    w, hw = dataclasses.replace(_mixtral(), moe_rank_imbalance=1.0), _h100()
    layout = Layout(dp=2, tp=2, cp=2, ep=8, mbs=1)
    sent = 1024 * 2 * 4096 * 2 * 7 / 8
    assert sent == 14_680_064
    exchanges = 4 * 32 * 4
    on_nvlink = estimate(w, layout, hw, DEFAULT_RUNTIME)
    assert on_nvlink.comm_bytes["ep"] == pytest.approx(exchanges * sent, rel=1e-12) == 7_516_192_768
    # 8 GPUs per node: the ep group is the job's 8 ranks, one node: NVLink, 14,680,064 / 360 GB/s
    # + 10 us = 50.8 us per all-to-all, 26.0 ms per step.
    assert on_nvlink.time_parts["ep"] == pytest.approx(exchanges * (sent / 360e9 + 10e-6), rel=1e-9)
    # 4 GPUs per node: two nodes of 4. Of a rank's 14,680,064 bytes, 4/7 (8,388,608) go to the other
    # node through its NIC at 40 GB/s (a full-bisection fabric), while 3/7 (6,291,456) cross
    # NVLink at the same time: 0.2097 ms + 57 us per all-to-all.
    across = estimate(w, layout, dataclasses.replace(hw, gpus_per_node=4), DEFAULT_RUNTIME)
    off_node = 8_388_608 / 40e9
    assert off_node > 6_291_456 / 360e9
    assert across.comm_bytes["ep"] == on_nvlink.comm_bytes["ep"]
    assert across.time_parts["ep"] == pytest.approx(exchanges * (off_node + 57e-6), rel=1e-9)


def test_expert_gradients_reduce_over_the_edp_group_only():
    from fivefold.plan.estimate import estimate
    from fivefold.plan.speed.frameworks import DEFAULT_RUNTIME
    from fivefold.plan.memory.peak import rank_param_counts
    from fivefold.plan.pipeline.schedule import pipeline_ranks

    # ZeRO-1 (fp32 reduction, bf16 weights: 4 + 2 bytes per parameter) under HSDP, dp4 as 2 shards x
    # 2 replicas, tp2. Dense weights (D per rank): reduce-scatter + all-gather over the shard pair,
    # 1/2 x 6D, and the replicas' all-reduce of the half, 2 x 1/2 x 4D/2: 5D. Expert weights (E per
    # rank) are sharded over their whole edp group, replicas included (parallel/data/zero.py): no replica
    # term. ep4 takes all of dp, and its edp group is the tp pair (4 x 2 / 4 = 2): 1/2 x 6E = 3E;
    # ep8 borrows tp: edp = 1, no expert traffic at all.
    w = _mixtral()
    for ep, expert_share in ((4, 3), (8, 0)):
        layout = Layout(dp=4, dp_shard=2, tp=2, ep=ep, zero=1, mbs=1)
        dense, experts = rank_param_counts(w.stats, layout, pipeline_ranks(w.stats, layout, w.seq_len)[0])
        got = estimate(w, layout, _h100(), DEFAULT_RUNTIME).comm_bytes["dp"]
        assert got == pytest.approx(5 * dense + expert_share * experts, rel=1e-12), ep
