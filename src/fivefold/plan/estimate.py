"""One layout -> one prediction: worst-rank memory, communication per dimension, step time,
tokens/s per GPU, MFU and the pipeline bubble.

Time model of a step (per pipeline rank r, per micro-batch):
  gpu(r)  = matmuls at the achievable fraction of peak (an MoE layer's experts at the busiest ep
            rank's rows: plan/speed/expert_load.py) + memory-bound elementwise work + the gradient-
            accumulation pass (plan/speed/grad_accum.py) + exposed tp / cp / ep / pp communication
  host(r) = kernels x launch time + collectives x host time per collective (Runtime)
  t_mb    = max over ranks of max(gpu(r), host(r))   (the host runs ahead: launches of kernels
            longer than a launch are hidden)
  step    = (m + bubble slots) t_mb + exposed data-parallel communication + optimizer step
            (+ under Muon its gathers and Newton–Schulz, after the last backward: plan/muon.py)
Collectives cost latency x ring steps + bytes / bandwidth of their tier (comm.py: NVLink inside a
node, the NICs across nodes, falling with the nodes spanned). Overlap follows fivefold's code:
DP buckets launch from gradient hooks during the last backward (zero 0/1), zero 2 under every
backward, FSDP2 prefetches under compute (zero 3), ring attention under its blocks; tp, ep and pp
transfers are exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.plan import comm

from fivefold.plan.speed import gemm
from fivefold.plan.speed.attention import attention_seconds
from fivefold.plan.speed.expert_load import rank_imbalance
from fivefold.plan.memory.framework import as_recomputed_by, as_run_by
from fivefold.plan.speed.grad_accum import accumulation_bytes_per_weight
from fivefold.plan.hardware import Hardware, Runtime, on_stack
from fivefold.plan.layout import Layout
from fivefold.plan.memory.activations import keeps_gathered, rank_activation_elements
from fivefold.plan.memory.peak import (MemoryBreakdown, expert_shard_degree, rank_param_counts, root_params,
                                  worst_rank_memory)
from fivefold.plan.lora import adapter_param_counts, backward_share, matmul_share
from fivefold.plan.muon import muon_step
from fivefold.plan.pipeline.rank_kinds import distinct_compositions, heaviest_rank, most_partial_weights
from fivefold.plan.speed.flops import float8_flops_per_token, model_flops_per_token
from fivefold.plan.pipeline.schedule import (V_SHAPED, PipelineRank, _pipeline_ranks, bubble_fraction,
                                             bubble_slots, chunks_per_rank)
from fivefold.plan.workload import Workload

@dataclass
class Estimate:
    layout: Layout
    memory: MemoryBreakdown
    memory_limit: float
    step_time_s: float
    tokens_per_sec_per_gpu: float
    mfu: float
    bubble_fraction: float
    comm_bytes: dict
    time_parts: dict = field(default_factory=dict)  # seconds per step by cause, for "why"
    why: str = ""
    # The runtime profile's calibration error of tokens/s: (median, 90th percentile) of
    # |predicted / measured - 1| (Runtime.tokens_per_sec_error).
    error: tuple[float, float] = (0.0, 0.0)
    profile: str = ""  # the runtime profile (framework) the time was predicted for
    overlaps: str = ""  # what that framework overlaps
    muon: dict = field(default_factory=dict)  # train.optimizer = muon: where its work goes (plan/muon.py)
    moe_rank_imbalance: float = 1.0  # the busiest ep rank's routed rows over the mean (plan/speed/expert_load.py)
    goodput: object = None  # plan/goodput.py Goodput, attached by the command line (train.steps' cost)

    @property
    def tokens_per_sec_band(self) -> dict:
        """The prediction's uncertainty: half the calibration runs fell within +-median, nine in
        ten within +-p90 (relative errors of tokens/s per GPU)."""
        med, p90 = self.error
        tok = self.tokens_per_sec_per_gpu
        return {"median_rel_error": med, "p90_rel_error": p90,
                "p90_low": tok / (1 + p90), "p90_high": tok / max(1e-9, 1 - p90) if p90 < 1 else None}

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

    def to_json(self) -> dict:
        return {"layout": self.layout.to_dict(), "fits": self.fits,
                "memory_bytes": self.memory.to_dict(),
                # bytes, so no GB/GiB ambiguity: the device's capacity the fit was checked against
                "memory_capacity_bytes": int(self.memory_limit), "step_time_s": self.step_time_s,
                "tokens_per_sec_per_gpu": self.tokens_per_sec_per_gpu, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction,
                "comm_bytes": {k: int(round(v)) for k, v in self.comm_bytes.items()},
                "why": self.why, "tokens_per_sec_band": self.tokens_per_sec_band,
                "profile": self.profile, "overlaps": self.overlaps,
                "time_parts_s": {k: v for k, v in self.time_parts.items() if v},
                **({"moe_rank_imbalance": self.moe_rank_imbalance} if self.moe_rank_imbalance != 1.0 else {}),
                **(self.goodput.to_json() if self.goodput else {}),
                **({"muon": self.muon} if self.muon else {})}


def _rank_microbatch(workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime,
                     prank: PipelineRank, links: dict, m: int, imbalance: float) -> tuple[dict, dict]:
    """(seconds by cause, bytes by dimension) of one micro-batch's forward + backward on one
    pipeline rank; m micro-batches a step, `imbalance` the busiest ep rank's routed rows over the
    mean (plan/speed/expert_load.py), which sets an MoE layer's pace."""
    stats, pr, seq = workload.stats, workload.precision, workload.seq_len
    groups = prank.kinds
    n_layers = len(prank.layers)
    n_moe = prank.moe_layers
    tokens_mb = layout.mbs * seq  # one micro-batch of one data-parallel rank
    tokens_local = tokens_mb / layout.cp

    # Matmuls, each kind of layer at its GEMMs' efficiency (plan/speed/gemm.py: by shape and GPU). The
    # dense GEMMs see the rank's whole local sequence (sequence parallelism gathers it) and 1/tp
    # of the weights; MoE layers split their tokens over tp (parallel/tensor/apply.py).
    # LoRA: the frozen base's matmuls compute no weight gradient (plan/lora.py matmul_share).
    share = matmul_share(workload.lora)
    # Full recomputation: a second forward, 2 of the 6 FLOPs per weight and token (of 4 when frozen).
    recomputed = (share + 2 / 6) / share if layout.recompute == "full" else 1.0
    peak = hw.peak_flops
    fp8 = bool(workload.fp8) and hw.has_fp8
    speedup = runtime.float8_linear_speedup if fp8 else 1.0
    rows = tokens_local / layout.tp  # tokens per rank-share of a per-token FLOP count
    compute = attention = expert_wait = 0.0
    for layer, count in groups:
        moe = stats.is_moe(layer)
        eff_dense, eff_fp8, eff_experts = gemm.layer_efficiencies(
            stats, moe, tokens_local, layout.tp, layout.ep, hw, speedup, runtime.float8_casts(fp8), imbalance)
        attn = stats.layer_attention_flops_per_token(layer, seq)
        experts = stats.moe_flops_per_token(layer)
        dense = stats.layer_flops_per_token(layer, seq) - attn - experts
        in_fp8 = float8_flops_per_token(stats, ((layer, 1),), seq) if fp8 else 0.0
        seconds = ((dense - in_fp8) / eff_dense + in_fp8 / eff_fp8 + experts / eff_experts) / peak
        core = attention_seconds(stats, layer, seq, rows, hw, runtime.attention_kernel, layout.recompute,
                                  runtime.attention_rate)
        compute += count * (recomputed * share * rows * seconds + core)
        attention += count * attn * rows / (peak * hw.matmul_efficiency)
        if moe and imbalance != 1.0:  # what the busiest rank's extra rows cost beyond the mean load
            even = gemm.layer_efficiencies(stats, moe, tokens_local, layout.tp, layout.ep, hw, speedup,
                                           runtime.float8_casts(fp8))[2]
            expert_wait += count * recomputed * share * rows * experts / peak * (1 / eff_experts - 1 / even)
    if prank.has_output:
        compute += (share * stats.output_flops_per_token * rows
                    / (peak * gemm.output_efficiency(stats, tokens_local, layout.tp, hw)))
    # Elementwise work (norms, residuals, RoPE, SwiGLU, casts, the loss) is bound by memory
    # bandwidth: a few passes over the activations each layer saves, and over the logits.
    traffic = (rank_activation_elements(stats, prank, layout, seq, "none", hw.fuses_attention(stats))
               * tokens_local * pr.act_bytes * runtime.elementwise_passes)
    if prank.has_output:
        traffic += 2 * tokens_local * stats.vocab_size / layout.tp * runtime.logits_bytes_per_element
    compute += traffic / hw.hbm_bw
    # Each micro-batch's weight gradients join the accumulated ones: a pass over the rank's trained
    # weights (plan/speed/grad_accum.py).
    trained = (sum(adapter_param_counts(stats, layout, prank, workload.lora)) if workload.lora.rank
               else sum(rank_param_counts(stats, layout, prank)))
    compute += trained * accumulation_bytes_per_weight(pr, layout, runtime, m) / hw.hbm_bw

    # Tensor parallelism: 8 collectives per layer and 2 for the output projection in the compute
    # dtype, 2 for the vocab-parallel embedding in the residual stream's (the weights') dtype; each
    # an all-gather or reduce-scatter of the micro-batch's hidden states (an all-reduce counts 2).
    # A MoE layer's MLP part routes each tp rank's own slice of the tokens: under sequence
    # parallelism that is the stream's local part (no collective); without it the rank keeps its
    # slice and all-gathers the outputs in forward and the input gradients in backward (2).
    # Multi-token prediction's blocks (counted in n_layers) each embed once more and run the output
    # projection once more, on the last stage.
    heads = prank.has_output * (1 + stats.mtp_depth)
    n_tp = 8 * n_layers - (4 if layout.sp else 2) * n_moe + 2 * heads
    if (runtime.activation_recipe == "fivefold" and layout.tp > 1 and layout.sp and layout.recompute == "none"
            and not keeps_gathered(workload, runtime) and not runtime.regather_overlapped):
        # Backward gathers each gathered input again from the shard its matmuls kept
        # (parallel/tensor/sharded_inputs.py): attention's, a dense MLP's and the output layer's. (The
        # nanotron profile's constants were fitted on its runs as they are.)
        n_tp += 2 * n_layers - n_moe + heads
    n_stream = 2 * prank.has_embedding + 2 * prank.has_output * stats.mtp_depth
    tp_b = (n_tp * comm.tp_bytes_per_collective(layout, tokens_local, stats.dim, pr.act_bytes)
            + n_stream * comm.tp_bytes_per_collective(layout, tokens_local, stats.dim, pr.param_bytes))
    tp_t = (n_tp * comm.gather_time(tokens_local * stats.dim * pr.act_bytes, links["tp"], hw)
            + n_stream * comm.gather_time(tokens_local * stats.dim * pr.param_bytes, links["tp"], hw))
    tp_t *= runtime.tp_exposed_fraction

    cp_b = n_layers * comm.cp_bytes_per_layer(layout, tokens_local, stats.q_dim, stats.kv_dim,
                                              stats.v_dim, stats.o_dim, pr.act_bytes)
    cp_t = comm.collective_bytes_time(cp_b, links["cp"], hw)
    if layout.cp_method == "ring":
        cp_t = max(0.0, cp_t - attention)  # ring attention hides the passes behind its blocks

    # Each tp rank routes its 1/tp of the micro-batch's tokens (parallel/tensor/apply.py).
    ep_one = comm.ep_bytes_per_moe_layer(layout, tokens_local / layout.tp, stats.dim, stats.top_k, pr.act_bytes)
    ep_b = n_moe * ep_one
    # 4 exchanges a layer; each ends when the busiest rank has received (dispatch) or sent (combine) its rows
    ep_t = n_moe * 4 * comm.all_to_all_time(imbalance * ep_one / 4, links["ep"], hw)
    if runtime.ep_overlap == "always" or (runtime.ep_overlap == "dualpipe" and layout.pp_schedule == "dualpipev"):
        # Dispatch and combine run under compute: DualPipe(V) pairs one micro-batch's forward with
        # another's backward; Megatron-core splits a micro-batch in two. What exceeds the compute shows.
        ep_t = max(0.0, ep_t - compute)

    v = chunks_per_rank(layout)
    pp_b = comm.pp_bytes_per_microbatch(layout, tokens_local, stats.dim, pr.act_bytes, v,
                                        runtime.pp_scatter_gather)
    pp_t = 2 * v * comm.p2p_time(pp_b / (2 * v), links["pp"], hw) if pp_b else 0.0

    gpu = compute + tp_t + cp_t + ep_t + pp_t
    # Host: kernel launches and collective calls; the host runs ahead of the GPU, so only what a
    # layer's launches take beyond its GPU time shows (short kernels: small micro-batches, high tp).
    collectives = n_tp + n_stream + 4 * n_moe * (layout.ep > 1) + 2 * n_layers * (layout.cp > 1)
    host = n_layers * runtime.kernels_per_layer * runtime.launch_s + collectives * runtime.collective_host_s
    if layout.tp > 1 and layout.pp > 1 and not links["pp"].intra_node:
        host += n_tp * runtime.pp_cross_node_wait_per_tp_peer_s * layout.tp
    seconds = {"compute": compute - expert_wait, "expert_imbalance": expert_wait, "tp": tp_t, "cp": cp_t,
               "ep": ep_t, "pp": pp_t, "host": max(0.0, host - gpu)}
    return seconds, {"tp": tp_b, "cp": cp_b, "ep": ep_b, "pp": pp_b}


def _dp_time(workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime, dense: float,
             experts: float, m: int, root: float = 0.0,
             trained: tuple[float, float] | None = None) -> tuple[float, float, float, float]:
    """(bytes, seconds overlappable with backward, seconds overlappable with the next step's first
    forward, exposed-anyway seconds) of data-parallel traffic per step.

    ZeRO-0 all-reduces gradients once per step; ZeRO-1 reduce-scatters them once and all-gathers
    the updated weights after the step; ZeRO-2 keeps only a gradient shard, so it reduce-scatters
    every micro-batch; ZeRO-3 also gathers the weights twice per micro-batch. HSDP adds an
    all-reduce of the dense shard across replicas (expert weights are sharded over their whole
    expert-data-parallel group, replicas included: parallel/data/zero.py, fsdp.py). Under ep the
    experts' traffic runs on the edp group (comm.expert_links: dp·cp·tp/ep ranks, where mesh.py
    puts them), not on the dense weights' dp·cp group. `trained`: the (dense, expert) parameters
    with gradients when not all are (LoRA: the adapters), the only ones reduced and, under
    ZeRO-1/2, gathered after the step; FSDP2 gathers the frozen weights too."""
    pr, order, gpn = workload.precision, workload.order, hw.gpus_per_node
    trained = trained or (dense, experts)
    eff = runtime.dp_bw_efficiency
    group, dense_link, expert_link = comm.data_parallel_links(layout, order, gpn)
    replicas = layout.dp // (layout.dp_shard or layout.dp)
    replica_link = comm.Link(replicas, replicas if group.intra_node else 1)
    total_bytes = hidden = ahead = exposed = 0.0
    under_ep = layout.ep > 1  # without it the experts are dense weights, reduced as they are
    for params, learned, link, unit_root, replicated in ((dense, trained[0], dense_link, root, True),
                                                         (experts, trained[1], expert_link, 0.0, not under_ep)):
        if params <= 0:
            continue
        n = link.size
        grads, weights = learned * (runtime.reduce_bytes or pr.reduce_bytes), params * pr.param_bytes
        updated = learned * pr.param_bytes  # the weights the step changes
        if layout.zero == 0:
            total_bytes += 2 * (n - 1) / n * grads
            hidden += comm.all_reduce_time(grads, link, hw, eff)
        elif layout.zero in (1, 2):
            reductions = 1 if layout.zero == 1 else m
            total_bytes += (n - 1) / n * (reductions * grads + updated)
            hidden += reductions * comm.gather_time(grads, link, hw, eff)
            if runtime.param_gather_overlapped:  # under the next step's first forward, layer by layer
                ahead += comm.gather_time(updated, link, hw, eff)
            else:
                exposed += comm.gather_time(updated, link, hw, eff)
        elif runtime.fsdp_gather_once_in_pipeline and layout.pp > 1:
            # torchtitan under a pipeline: blocks stay gathered over all micro-batches of a step
            # (reshard_after_forward=False) and gradients are reduce-scattered once.
            reductions = 1
            total_bytes += (n - 1) / n * (grads + weights)
            hidden += comm.gather_time(grads, link, hw, eff) + comm.gather_time(weights, link, hw, eff)
        else:
            # fivefold's FSDP2 units: every block is gathered in forward and again in backward
            # (once under the zero-bubble schedules, which keep blocks gathered in between); the
            # root unit (embedding, norm, output) stays gathered from forward to backward.
            # Gradients are reduce-scattered every micro-batch (parallel/data/fsdp.py); under a
            # pipeline PyTorch's stage reduce-scatters once, after the step's last backward.
            regathered = 0.0 if layout.split_backward else weights - unit_root * pr.param_bytes
            reductions = 1 if layout.pp > 1 else m
            total_bytes += (n - 1) / n * (reductions * grads + m * (weights + regathered))
            hidden += (reductions * comm.gather_time(grads, link, hw, eff)
                       + m * (1 if layout.split_backward else 2) * comm.gather_time(weights, link, hw, eff))
        if replicas > 1 and layout.zero > 0 and replicated:
            # HSDP: the reduced shards are all-reduced across replicas: with each reduce-scatter
            # under FSDP2, once a step under fivefold's own ZeRO-1/2 buckets.
            across = reductions if layout.zero >= 3 else 1
            total_bytes += across * 2 * (replicas - 1) / replicas * grads / n
            hidden += across * comm.all_reduce_time(grads / n, replica_link, hw, eff)
    return total_bytes, hidden, ahead, exposed


_MICROBATCH_MEMO: dict = {}


def _rank_microbatch_memo(workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime,
                          prank: PipelineRank, links: dict, m: int, imbalance: float) -> tuple[dict, dict]:
    """_rank_microbatch, once per what it reads: every layout field but the ZeRO stage, of which
    only whether it is 3 (FSDP's gradient accumulation, plan/speed/grad_accum.py). A search times
    each grid's ZeRO stages 0-2 with the same micro-batch (links follow from the degrees, the
    workload's order and the device's node size). The dicts are shared: read them only."""
    key = (workload, hw, runtime, prank, m, imbalance, layout.dp, layout.tp, layout.pp, layout.cp, layout.ep,
           layout.mbs, layout.recompute, layout.pp_schedule, layout.pp_virtual, layout.dp_shard, layout.sp,
           layout.cp_method, layout.pp_layers, layout.zero >= 3)
    hit = _MICROBATCH_MEMO.get(key)
    if hit is None:
        if len(_MICROBATCH_MEMO) >= 65536:
            _MICROBATCH_MEMO.clear()
        hit = _MICROBATCH_MEMO[key] = _rank_microbatch(workload, layout, hw, runtime, prank, links, m, imbalance)
    return hit


def estimate(workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime,
             memory: MemoryBreakdown | None = None) -> Estimate:
    """Predict one layout (memory may be passed in when the caller already computed it)."""
    workload = as_run_by(workload, runtime)  # the framework's gradient buffer (plan/memory/framework.py)
    memory = memory or worst_rank_memory(workload, layout, hw, runtime)
    # Megatron's selective recomputation runs as 'none' where attention is fused (plan/memory/framework.py)
    given, layout = layout, as_recomputed_by(layout, runtime, hw, workload.stats)
    hw = on_stack(hw, runtime.matmul_rate)  # the framework's GEMM kernels (Runtime.matmul_rate)
    stats, pr = workload.stats, workload.precision
    order, gpn = workload.order, hw.gpus_per_node
    m = layout.micro_batches(workload.global_batch)
    links = {d: comm.placement(layout, order, (d,), gpn) for d in ("tp", "cp", "pp")}
    links["ep"] = comm.expert_links(layout, order, gpn)[0]
    imbalance = rank_imbalance(workload, layout)

    ranks = _pipeline_ranks(stats, layout.pp, chunks_per_rank(layout), layout.pp_schedule in V_SHAPED,
                            layout.pp_layers, workload.seq_len)
    t_mb, worst, per_mb_bytes = 0.0, None, {"tp": 0.0, "cp": 0.0, "ep": 0.0, "pp": 0.0}
    for prank in distinct_compositions(stats, ranks):
        seconds, nbytes = _rank_microbatch_memo(workload, layout, hw, runtime, prank, links, m, imbalance)
        rank_time = sum(seconds.values())
        if worst is None or rank_time > t_mb:
            t_mb, worst = rank_time, seconds
        for key, val in nbytes.items():
            per_mb_bytes[key] = max(per_mb_bytes[key], val)

    # nanotron's stall of every pipeline slot beyond one scalable unit (Runtime.slot_stall_s; 0 for fivefold).
    nodes = layout.world_size / gpn
    if runtime.slot_stall_s and nodes > hw.scalable_unit_nodes:
        worst = {**worst, "stall": runtime.slot_stall_s}
        t_mb += worst["stall"]
    slots = bubble_slots(layout, m)
    pipe_time = (m + slots) * t_mb

    # Data parallelism and the optimizer step, on the rank with the most parameters.
    heaviest = heaviest_rank(stats, layout.tp, layout.ep, ranks)
    dense, experts = rank_param_counts(stats, layout, heaviest)
    trained = adapter_param_counts(stats, layout, heaviest, workload.lora) if workload.lora.rank else None
    dp_bytes, dp_hidden, dp_ahead, dp_exposed = _dp_time(workload, layout, hw, runtime, dense, experts, m,
                                               root_params(stats, layout, heaviest), trained)
    backward = backward_share(workload.lora)
    if layout.zero >= 3:  # FSDP prefetches under every micro-batch's compute
        window = m * worst["compute"]
    elif layout.zero == 2:  # a reduce-scatter under every micro-batch's backward
        window = m * backward * worst["compute"]
    else:  # bucketed gradient reduction under the last micro-batch's backward
        window = backward * worst["compute"]
    dp_visible = (max(0.0, dp_hidden - window * runtime.dp_overlap_fraction) + dp_exposed
                  + max(0.0, dp_ahead - (1 - backward) * worst["compute"]))
    stepped_dense, stepped_experts = trained or (dense, experts)  # what the optimizer updates
    local = (stepped_dense / layout.shard_degree + stepped_experts / expert_shard_degree(layout)
             if layout.zero >= 1 else stepped_dense + stepped_experts)
    # Adam reads and writes master weights and both moments, reads the gradient, writes weights.
    optim_bytes = (2 * (pr.optim_bytes + pr.master_bytes) + pr.grad_bytes + pr.accum_bytes
                   + pr.param_bytes)
    optim_time = local * optim_bytes / hw.hbm_bw + runtime.step_overhead_s

    # MLA's latent projections and norms run whole on every tp rank and their gradients are partial
    # sums: one fp32 all-reduce over tp per step, before the data-parallel reduction (grad_norm.py).
    # So do an MoE layer's weights, whose tokens are split over tp (parallel/tensor/apply.py): the router
    # and shared experts, and the routed experts at ep = 1 (under ep the expert-data-parallel
    # reduction, which spans the tp ranks holding the same experts, sums them: the dp term).
    moe_partial = stats.router_params + stats.shared_expert_params
    if layout.ep == 1:
        moe_partial += stats.n_experts * stats.expert_params
    # Multi-token prediction's eh_proj, whole on every tp rank, sees this rank's tokens under sp.
    mtp_partial = 2 * stats.dim * stats.dim * stats.mtp_depth if layout.sp else 0
    # (Under LoRA these weights are frozen: no gradient to sum; their adapters' are r/h of them.)
    latent = (most_partial_weights(stats, ranks, moe_partial, mtp_partial)
              * pr.grad_bytes * (layout.tp > 1) * (not workload.lora.rank))
    latent_b = 2 * (layout.tp - 1) / layout.tp * latent
    latent_t = comm.all_reduce_time(latent, links["tp"], hw)

    # Muon (train.optimizer = muon): its gathers and Newton–Schulz after the last backward, exposed;
    # the pipeline's stages step at once, so the slowest stage's counts (plan/muon.py).
    muon = (max((muon_step(stats, layout, order, hw, runtime.dp_bw_efficiency, p) for p in ranks),
                key=lambda s: s.seconds) if workload.muon else None)
    step = pipe_time + dp_visible + optim_time + latent_t + (muon.seconds if muon else 0.0)
    tok_s_gpu = workload.tokens_per_step / step / layout.world_size
    mfu = tok_s_gpu * model_flops_per_token(stats, workload.seq_len, workload.lora) / hw.peak_flops
    parts = {k: m * v for k, v in worst.items()}
    parts.update({"bubble": slots * t_mb, "dp": dp_visible, "optimizer": optim_time})
    parts["tp"] += latent_t
    if muon:
        parts.update({"newton_schulz": muon.newton_schulz_s, "muon_gather": muon.gather_s})
    # The vocabulary-parallel loss (models/loss/cross_entropy.py): per token one fp32 max and one sum of
    # two fp32 values (exponentials, target logit), all-reduced over tp on the output's ranks.
    loss_b = 2 * (layout.tp - 1) / layout.tp * 12 * layout.mbs * workload.seq_len / layout.cp * m
    comm_bytes = {"dp": dp_bytes, "tp": m * per_mb_bytes["tp"] + latent_b + loss_b, "pp": m * per_mb_bytes["pp"],
                  "cp": m * per_mb_bytes["cp"], "ep": m * per_mb_bytes["ep"]}
    if muon:
        for dim, nbytes in muon.bytes.items():
            comm_bytes[dim] += nbytes
    return Estimate(layout=given, memory=memory, memory_limit=hw.memory_bytes, step_time_s=step,
                    tokens_per_sec_per_gpu=tok_s_gpu, mfu=mfu,
                    bubble_fraction=bubble_fraction(layout, m), comm_bytes=comm_bytes,
                    time_parts=parts, error=runtime.tokens_per_sec_error, profile=runtime.name,
                    overlaps=runtime.overlaps, muon=muon.to_json() if muon else {},
                    moe_rank_imbalance=imbalance)
