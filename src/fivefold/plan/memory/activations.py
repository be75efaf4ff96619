"""Activation bytes one rank keeps for backward: per layer, per pipeline rank (with the schedule's
micro-batches in flight), the logits and the multi-token prediction blocks.

Activations come in two recipes (Runtime.activation_recipe):

'fivefold' — what fivefold's own decoder block (models/decoder.py, every family) keeps, counted
tensor by tensor on our runs with train/activation_probe.py and checked in
tests/test_plan_activations.py (fp32 and bf16, tp/sp, cp, none/selective/full; llama,
mixtral, qwen3, qwen3_moe). Per token of one micro-batch, a layer keeps, with S the residual-stream
bytes (the weights' dtype: bf16 under train.dtype = bf16), A the compute bytes, s the sequence split (tp
under sequence parallelism), t the tp degree, h the model width and q = heads x head_dim the width of
the queries and of the attention output (h unless head_dim is explicit, as in Qwen3):
  each RMSNorm (models/rms_norm.py): its input, h/s x S, and rstd (fp32, 1/s); an fp32 input also
      x·rstd (PyTorch's composite), h/s x 4
  the norm output, cast once to A (models/decoder.py) and saved by the matmuls that read it: h x A,
      full sequence (gathered) under sequence parallelism
  attention: q and k after RoPE, v, the output (q + kv + kv + q)/t x A, logsumexp (fp32 per head);
      under context parallelism also the output's contiguous copy that the output projection
      reads, q/t x A (ring and Ulysses attention return it head-major)
  per-head q/k RMSNorm (Qwen3): its input and rstd per head: ((q + kv) x A + 4 (heads + kv heads))/t
  latent attention (MLA, deepseek_v3; measured on tiny-deepseek-v3): q and k are heads x (nope +
      rope) wide, v and the output heads x v_head_dim; the latent norms (q_lora_rank, kv_lora_rank)
      run whole on every tp rank on the gathered sequence and keep, like the q/k norms, their
      input, rstd and their output in A (the kv norm's input a view of kv_a's output, k_pe with it); 'selective' keeps the latent down-projections'
      outputs (kv's with the shared RoPE key) and q_b's and kv_b's instead of q, k, v. Where the
      device has no fused kernel for the shape (CPU: v_head_dim != q/k's), SDPA's math path keeps
      fp32 copies of q, k, v and the fp32 softmax (heads x every key), and ring attention's plain
      path, under 'selective', its fp32 score tiles
  MLP: gate and up outputs (models/swiglu.py recomputes silu(gate)), silu(gate)·up: 3f/t x A; a
      two-matrix MLP (GeLU, squared ReLU: stats with 2 h f MLP parameters, ModelStats.mlp_matrices)
      its up projection's output and the activation's: 2f/t x A
  MoE instead (weights replicated over tp, tokens split: each tp rank routes 1/t of them, so
      every term below is /t; the ffn norm's output is then read locally, h/t, not gathered):
      the k dispatched copies of each token, their expert output and
      its weighted copy 3kh, each copy's SwiGLU 3kf (x A), shared experts' SwiGLU, the routing
      bookkeeping (fp32 scores, int64 top-k and sort indices: 4E + 41k bytes); Megatron-core's
      grouped experts weight each copy inside the activation (Runtime.moe_probs_in_activation) and
      keep per copy its input, fc1's output and the weighted activation: (h + 3f) x A
'selective' keeps the block input and the outputs of the matmuls and attention (q, k, v and the
attention output, and the row-parallel outputs whole, h x A, before their reduce-scatter; ring
attention's cp kernels each keep their output and lse, all queries' on the last cp rank) — or, where
that is smaller (plan/memory/branch_split.py: tp ≥ 4 for Llama shapes), checkpoints the two residual
branches apart and keeps the stream between them (h/s x S) and the output projections' inputs (the
attention output, and the SwiGLU product f/t x A) instead of their whole outputs; 'full'
keeps the block input. Per micro-batch the forward also keeps the RoPE tables (fp32 cos and sin,
seq/cp x head_dim each) and each sent stage output until its backward (unless
Runtime.frees_sent_outputs: Megatron's deallocate_output_tensor); the last stage keeps the final
norm, the output layer's input, an fp32 log-sum-exp and the int64 target per token (fivefold's
output layer fused with its loss: no logits; the stacks that make the logits keep them,
Runtime.fuses_output_loss). The weights' compute-dtype copies are model state ('other'), not
activations.

'nanotron' — Korthikanti et al. 2022 (arXiv 2205.05198) as the Playbook's nanotron runs keep it,
for benchmarks/planner_accuracy.py. Per token of one micro-batch, a layer saves:
  both RMSNorm inputs and both norm outputs                 4h  (split across tp only under
      sequence parallelism, where the column-parallel matmuls re-gather their input in backward)
  q, k and v q + 2 kv_dim, attention output q, logsumexp    split across tp
  implementation copies: the attention output again (the contiguous copy the output projection
      reads) and q, k before RoPE (kept alive by the fused QKV output they are views of)  3q
  MLP: gate and up 2f, silu(gate) f, silu(gate)*up f        split across tp
      (two matrices: the up output f and the activation's output f, which 'selective' recomputes)
(an unfused attention also keeps the a x s softmax). 'selective' recomputes the norms and the
activation function (drops the norm outputs and silu(gate)); 'full' keeps only each layer's input
and recomputes one layer at a time during backward. The speed model's elementwise-traffic term
uses this count in every recipe (it was calibrated with it).
"""


from __future__ import annotations

from functools import lru_cache
from itertools import repeat

from fivefold.plan.memory.branch_split import split_branches
from fivefold.plan.speed.expert_load import rank_imbalance
from fivefold.plan.hardware import Hardware, Runtime
from fivefold.plan.layout import Layout
from fivefold.plan.lora import adapter_activation_bytes
from fivefold.plan.model_stats import ModelStats
from fivefold.plan.pipeline.schedule import PipelineRank, in_flight_per_chunk, outputs_held
from fivefold.plan.workload import Workload


def gated(stats: ModelStats) -> bool:
    """A gated MLP (SwiGLU: three matrices) rather than a two-matrix one (GeLU, squared ReLU)."""
    return stats.mlp_matrices == 3


def norm_kept(width: float, input_bytes: int, trained: bool = True) -> float:
    """Bytes an RMSNorm (models/rms_norm.py) keeps per row of `width` elements, rstd aside: its input;
    an fp32 input through PyTorch's composite also keeps the fp32 x·rstd, for its weight's gradient
    only: not when the weight is frozen (LoRA)."""
    return width * (input_bytes + (4 if input_bytes == 4 and trained else 0))


def layer_activation_elements(stats: ModelStats, layer: int, layout: Layout, seq_len: int,
                              recompute: str, fused_attention: bool, imbalance: float = 1.0) -> float:
    """Activation elements one layer saves per token of one micro-batch on one rank; an MoE layer's
    routed copies on the busiest ep rank, `imbalance` times the mean (plan/speed/expert_load.py)."""
    h, q, kv, t, cp = stats.dim, stats.q_dim, stats.kv_dim, layout.tp, layout.cp
    seq_split = t if (t > 1 and layout.sp) else 1
    if recompute == "full":
        return h / seq_split  # the layer input only
    norms_in, norms_out = 2 * h / seq_split, 2 * h / seq_split  # norms_out: the matmul inputs
    # q, k, v, output, fp32 logsumexp (2 bf16 units per head), and the 3q of copies (docstring)
    attention = (2 * q + 2 * kv + 3 * q) / t + 2 * stats.n_heads / t
    if not fused_attention:
        attention += stats.n_heads * seq_len / cp / t  # the softmax over all keys
    if stats.is_moe(layer):
        f = stats.expert_hidden  # expert ffn width
        k, n_shared = stats.top_k, stats.shared_expert_params / stats.expert_params
        # each token's top_k copies: dispatched input h and combined output h, plus the SwiGLU
        # of every routed and shared expert it visits; router scores (fp32) per token
        mlp = (imbalance * k * (2 * h + 4 * f) + n_shared * 4 * f) / t + 2 * stats.n_experts / t  # tokens split over tp
        silu = (imbalance * k + n_shared) * f / t
    else:
        mlp = (4 if gated(stats) else 2) * stats.ffn_dim / t
        silu = stats.ffn_dim / t
    total = norms_in + norms_out + attention + mlp
    if recompute == "selective":
        total -= norms_out + silu
    return total


def rank_activation_elements(stats: ModelStats, prank: PipelineRank, layout: Layout, seq_len: int,
                             recompute: str, fused_attention: bool) -> float:
    """Sum over the rank's layers of layer_activation_elements (the 'nanotron' count)."""
    return sum(count * layer_activation_elements(stats, layer, layout, seq_len, recompute,
                                                 fused_attention)
               for layer, count in prank.kinds)


def fivefold_layer_bytes(stats: ModelStats, layer: int, layout: Layout, seq_len: int, recompute: str,
                         precision, fused_attention: bool, keep_gathered: bool = False, trained: bool = True,
                         imbalance: float = 1.0, probs_in_activation: bool = False) -> float:
    """Bytes one of fivefold's blocks keeps per token of one micro-batch on one rank (docstring).
    keep_gathered: parallel.sp_keep_gathered (else, with sp and no recomputation, the matmuls
    reading the gathered sequence keep its shard: parallel/tensor/sharded_inputs.py). imbalance:
    the busiest ep rank's routed rows over the mean (plan/speed/expert_load.py), which it keeps copies of.
    probs_in_activation: Runtime.moe_probs_in_activation (a routed copy keeps h + 3f, not 3h + 3f)."""
    h, t = stats.dim, layout.tp
    s = t if (t > 1 and layout.sp) else 1
    S, A = precision.param_bytes, precision.act_bytes
    # What a norm's output costs as the matmuls that read it keep it: the gathered sequence, or
    # under parallel/tensor/sharded_inputs.py its shard.
    gathered = h / s * A if (s > 1 and recompute == "none" and not keep_gathered) else h * A
    if recompute == "full":
        return h / s * S
    if stats.is_moe(layer):  # tokens split over tp (parallel/tensor/apply.py): each rank routes 1/t of them
        f = stats.expert_hidden
        k, n_experts = stats.top_k, stats.n_experts
        n_shared = stats.shared_expert_params / stats.expert_params
        copy = h + 3 * f if probs_in_activation else 3 * (h + f)  # per routed copy (docstring)
        mlp = ((imbalance * k * copy + n_shared * 3 * f) * A
               + 4 * n_experts + 41 * k + 4) / t  # routing bookkeeping: scores, top-k, sort (int64)
        # The router reads the ffn norm's output locally (h/t), not gathered whole as `norms` counts.
        mlp -= gathered - h / t * A
        mlp_selective = (imbalance * k * (2 * f + h) + n_experts + n_shared * (2 * f + h)) * A / t
    else:
        # gate, up (models/swiglu.py) and their product; a two-matrix MLP: up and the activation's output
        mlp = (3 if gated(stats) else 2) * stats.ffn_dim / t * A
        # the up matrices' outputs (gate and up, or up) and the down projection's whole output
        mlp_selective = ((2 if gated(stats) else 1) * stats.ffn_dim / t + h) * A
    attention = fivefold_attention_bytes(stats, layout, seq_len, recompute, A, fused_attention, trained)
    if recompute == "selective":
        o = stats.o_dim / t
        projection_inputs = [o] if stats.is_moe(layer) else [o, stats.ffn_dim / t]
        if not split_branches(h, s, S, A, projection_inputs):  # + the output projection's whole output
            return h / s * S + attention + h * A + mlp_selective
        # Branches checkpointed apart (plan/memory/branch_split.py): the stream between them, and the
        # projections' inputs instead of their outputs: the attention output (kept already, but for
        # the contiguous copy the projection reads under cp or the math path) and the SwiGLU product.
        math = not fused_attention and not (layout.cp_method == "ring" and layout.cp > 1)
        copy = o * A if (layout.cp > 1 or math) else 0
        if not stats.is_moe(layer):
            mlp_selective += (stats.ffn_dim / t - h) * A
        return 2 * h / s * S + attention + copy + mlp_selective
    # models/rms_norm.py keeps its input in the stream's dtype and an fp32 rstd per row.
    norms = 2 * (norm_kept(h / s, S, trained) + 4 / s + gathered)  # + each output in A, as the matmuls read it
    return norms + attention + mlp


def fivefold_attention_bytes(stats: ModelStats, layout: Layout, seq_len: int, recompute: str, A: int,
                             fused: bool, trained: bool = True) -> float:
    """Bytes the attention sub-layer keeps per token ('none' or 'selective'; docstring), q/k/v/o
    the rank's widths of the queries, keys, values and attention output."""
    t, cp, ring = layout.tp, layout.cp, layout.cp_method == "ring"
    q, k, v, o = stats.q_dim / t, stats.kv_dim / t, stats.v_dim / t, stats.o_dim / t
    heads = stats.n_heads / t
    # Unfused (no kernel for this shape on this device): SDPA's math path and ring attention's
    # plain one (models/attention/blocks.py) compute in fp32 and hold fp32 scores of every key
    # (Ulysses: all heads' share of the whole sequence); under ring each rank holds its own square
    # block and half of each of the other cp-1 (the zigzag split).
    math = not fused and not (ring and cp > 1)
    scores = 4 * heads * (seq_len if not ring else seq_len / cp * (cp + 1) / 2)
    kernel_out = o * A + 4 * heads  # the kernel's output and its fp32 logsumexp
    latent = stats.q_lora_rank + stats.kv_lora_rank  # MLA's latents (whole over tp, all tokens)
    if recompute == "selective":
        # The matmuls' outputs: q, k, v, or MLA's latent projections (kv's with the shared RoPE key)
        # and the head-split q and kv_b's (k's non-RoPE part and v); every attention kernel's
        # output: ring attention runs cp of them, and the last cp rank runs each over all its queries.
        projections = q + k + v
        if stats.kv_lora_rank:
            projections += latent + stats.rope_dim - stats.n_heads * stats.rope_dim / t
        if math:
            return projections * A + scores + 4 * o  # the fp32 scores and their product with v
        kernels = cp if ring else 1
        return projections * A + kernels * kernel_out + (0 if fused else scores)
    if math:  # fp32 copies of q and k (scaled) and v, the softmax, no logsumexp
        attention = 4 * (q + k + v) + scores
    else:
        attention = (q + k + v) * A + kernel_out
    if stats.qk_norm:  # the per-head norms' input (the projections' output, A) and rstd per head
        attention += norm_kept(q + k, A, trained) + 4 * (stats.n_heads + stats.n_kv_heads) / t
    if stats.kv_lora_rank:  # each latent norm: its input, rstd, the output in A; the kv norm's
        # input is a view of kv_a's output, which holds k_pe too
        attention += (norm_kept(latent, A, trained) + A * latent + 4 * (2 if stats.q_lora_rank else 1)
                      + A * stats.rope_dim)
    if cp > 1 or math:  # the output projection reads a contiguous copy of the head-major output
        attention += o * A
    return attention


def keeps_gathered(workload: Workload, runtime: Runtime) -> bool:
    """Whether the matmuls reading the gathered sequence keep it whole (else, with sp and no
    recomputation, its shard): parallel.sp_keep_gathered, or compiled blocks."""
    return workload.keep_gathered or not runtime.regathers_inputs


def layer_activation_bytes(workload: Workload, layer: int, layout: Layout, recompute: str,
                           hw: Hardware, runtime: Runtime, imbalance: float | None = None) -> float:
    """Bytes one layer keeps per token of one micro-batch, in the runtime's recipe, on the busiest
    expert-parallel rank (imbalance: plan/speed/expert_load.py's rank_imbalance, computed when None)."""
    stats, seq = workload.stats, workload.seq_len
    imbalance = rank_imbalance(workload, layout) if imbalance is None else imbalance
    if runtime.activation_recipe == "fivefold":
        return (fivefold_layer_bytes(stats, layer, layout, seq, recompute, workload.precision,
                                     hw.fuses_attention(stats), keeps_gathered(workload, runtime),
                                     trained=not workload.lora.rank, imbalance=imbalance,
                                     probs_in_activation=runtime.moe_probs_in_activation)
                + adapter_activation_bytes(stats, layer, layout, recompute, workload.lora,
                                           workload.precision.act_bytes))
    return (layer_activation_elements(stats, layer, layout, seq, recompute, hw.fuses_attention(stats), imbalance)
            * workload.precision.act_bytes)


def output_bytes(workload: Workload, layout: Layout, runtime: Runtime) -> tuple[float, float, float]:
    """Per token at the last stage: (final norm kept per micro-batch, logits kept for the last
    micro-batch, logits' gradient at the start of backward)."""
    stats, pr = workload.stats, workload.precision
    s = layout.tp if (layout.tp > 1 and layout.sp) else 1
    vocab = stats.vocab_size / layout.tp
    if runtime.activation_recipe == "fivefold":
        # norm input and rstd, the output layer's input (gathered under sp: its shard
        # where parallel/tensor/sharded_inputs.py applies); a stack that makes the logits and runs
        # the chunked loss on them (models/loss/cross_entropy.py) keeps the vocab-parallel logits in their
        # compute dtype, an fp32 log-sum-exp and the int64 label per token, and writes their gradient
        # into the logits' own storage (one chunk's fp32 temporaries at a time).
        sharded = s > 1 and layout.recompute == "none" and not keeps_gathered(workload, runtime)
        if runtime.fuses_output_loss:
            # The output layer fused with its loss (models/loss/linear_cross_entropy.py) keeps its input
            # (it makes the logits again in backward, frozen or not), an fp32 log-sum-exp and the
            # int64 target per token, and no logits.
            read = stats.dim / (s if sharded else 1) * pr.act_bytes
            return norm_kept(stats.dim / s, pr.param_bytes, not workload.lora.rank) + 4 / s + read, 4 + 8, 0.0
        # A frozen output layer (LoRA: never adapted) keeps no input, which only its weight's gradient reads.
        read = 0.0 if workload.lora.rank else stats.dim / (s if sharded else 1) * pr.act_bytes
        norm = norm_kept(stats.dim / s, pr.param_bytes, not workload.lora.rank) + 4 / s + read
        return norm, pr.act_bytes * vocab + 4 + 8, 0.0
    return 2 * stats.dim / s * pr.act_bytes, vocab * runtime.logits_bytes_per_element, 0.0


def mtp_block_bytes(workload: Workload, layout: Layout, head_norm: float) -> float:
    """Per token, what one multi-token-prediction block keeps beyond a layer of its kind (counted
    with the layers) and its logits (counted with the output's). Without recomputation: its input
    norms (the embedding, and rstd of each; the stream itself is the final norm's input), eh_proj's input (both halves) and the head norm as the final norm keeps it
    (`head_norm`). Recomputed, the block's checkpoint keeps the embedding, which the layer's own
    count (its input) stands for, its other input being the final norm's; and the output layer
    keeps its input."""
    stats, pr = workload.stats, workload.precision
    s = layout.tp if (layout.tp > 1 and layout.sp) else 1
    if layout.recompute == "none":
        return (norm_kept(stats.dim, pr.param_bytes) + 2 * stats.dim * pr.act_bytes + 8) / s + head_norm
    return stats.dim * pr.act_bytes


def activation_bytes(workload: Workload, layout: Layout, prank: PipelineRank, rank: int,
                     micro_batches: int, hw: Hardware, runtime: Runtime) -> tuple[float, float]:
    """(saved activations at the peak, transient working memory) of one pipeline rank: each chunk
    (pipeline stage) of the rank holds its in-flight micro-batches (plan/pipeline/schedule.py).
    Once per the layout fields it reads: not dp (the micro-batches are given), ZeRO or HSDP."""
    return ranks_activation_bytes(workload, activation_fields(layout), ((rank, prank),), micro_batches, hw, runtime)[0]


def activation_fields(layout: Layout) -> tuple:
    """The layout fields a rank's activations read (the key ranks_activation_bytes takes)."""
    return (layout.tp, layout.pp, layout.cp, layout.ep, layout.mbs, layout.recompute, layout.pp_schedule,
            layout.pp_virtual, layout.sp, layout.cp_method)


def clear_caches() -> None:
    """Forget the memoised counts (for a test that changes the recipe under them)."""
    ranks_activation_bytes.cache_clear()
    _per_kind_bytes.cache_clear()


@lru_cache(maxsize=16384)
def ranks_activation_bytes(workload: Workload, fields: tuple, ranks: tuple, micro_batches: int, hw: Hardware,
                           runtime: Runtime) -> tuple[tuple[float, float], ...]:
    """activation_bytes of each of `ranks` ((index, pipeline rank) pairs) of a layout given as
    activation_fields(layout): what a caller pricing a layout's ranks looks up once."""
    tp, pp, cp, ep, mbs, recompute, schedule, virtual, sp, cp_method = fields
    layout = Layout(tp=tp, pp=pp, cp=cp, ep=ep, mbs=mbs, recompute=recompute, pp_schedule=schedule,
                    pp_virtual=virtual, sp=sp, cp_method=cp_method)
    return tuple(_rank_activation_bytes(workload, layout, fields, prank, rank, micro_batches, hw, runtime)
                 for rank, prank in ranks)


def _rank_activation_bytes(workload: Workload, layout: Layout, fields: tuple, prank: PipelineRank, rank: int,
                           micro_batches: int, hw: Hardware, runtime: Runtime) -> tuple[float, float]:
    tokens = layout.mbs * workload.seq_len / layout.cp  # tokens of one micro-batch on this rank
    fivefold = runtime.activation_recipe == "fivefold"
    counts = in_flight_per_chunk(layout, rank, micro_batches)
    representatives = (tuple(layer for layer, _ in prank.kinds) if workload.lora.rank
                       else _first_of_each_kind(workload.stats, prank.kinds))
    # A layer reads its splits, tokens (mbs: an MoE rank's imbalance) and recomputation, not the
    # pipeline: its bytes are shared by a search's pipeline depths and schedules.
    per_kind, biggest = _per_kind_bytes(workload, (layout.tp, layout.cp, layout.ep, layout.mbs, layout.recompute,
                                                   layout.sp, layout.cp_method), representatives, hw, runtime)
    one_kind = next(iter(per_kind.values())) if len(per_kind) == 1 else None
    s = layout.tp if (layout.tp > 1 and layout.sp) else 1
    stream = workload.stats.dim / s * workload.precision.param_bytes  # one stage output, per token
    saved = 0.0
    for count, layers, sends in zip(counts, prank.chunks, prank.sends):
        # (A rank of one kind of layer sums copies of one value, in C: the same sum, in order.)
        layer_bytes = (sum(repeat(one_kind, len(layers))) if one_kind is not None
                       else sum(per_kind[workload.stats.is_moe(i)] for i in layers))
        saved += count * tokens * layer_bytes
        if fivefold and layers:
            # Each micro-batch's RoPE tables: fp32 cos and sin of its local positions (one per
            # sequence position, shared by the batch).
            saved += count * 2 * 4 * workload.seq_len / layout.cp * workload.stats.rope_dim
        if fivefold and sends and not runtime.frees_sent_outputs:  # outputs sent on, until the send is known done
            saved += outputs_held(layout, count, micro_batches) * tokens * stream
    working = biggest * tokens * (2 if layout.recompute == "full" else 1)
    if prank.has_output:
        last = counts[-1]  # the last stage is the rank's last chunk
        norm, logits, logits_grad = output_bytes(workload, layout, runtime)
        # Multi-token prediction's blocks each end in the shared output layer and a loss of their own.
        depth = workload.stats.mtp_depth
        if depth:
            norm += depth * mtp_block_bytes(workload, layout, norm)
            logits *= 1 + depth
        # Each in-flight micro-batch's final norm and loss graph; a split backward's input pass
        # (run right after the last stage's forward) frees the graph above the output layer's
        # weight, the log-softmax with it: only the newest micro-batch's is held.
        saved += (norm * last + logits * (min(last, 1) if layout.split_backward else last)) * tokens
        if fivefold and layout.pp > 1 and not runtime.fuses_output_loss:
            # The schedule holds the newest micro-batch's logits (A x vocab/t) until its next forward.
            saved += workload.precision.act_bytes * workload.stats.vocab_size / layout.tp * tokens
        if fivefold and runtime.fuses_output_loss and not workload.lora.rank:
            # Its backward sums the weight's gradient over the chunks in fp32 (vocab/t x dim).
            working += 4 * workload.stats.vocab_size / layout.tp * workload.stats.dim
        working += logits_grad * tokens
    return saved, working


@lru_cache(maxsize=4096)
def _first_of_each_kind(stats: ModelStats, kinds: tuple) -> tuple[int, ...]:
    """For each of a rank's (layer, count) kinds, the model's first layer of that kind (MoE or
    dense, sliding-window or full, multi-token prediction): without LoRA, whose adapters may be
    chosen by a layer's name, what a layer keeps depends on its kind alone, so every pipeline
    rank's layers of a kind share one count."""
    first: dict = {}
    for i in range(stats.n_layers + stats.mtp_depth):
        first.setdefault((stats.is_moe(i), i in stats.sliding_layers, i >= stats.n_layers), i)
    return tuple(first[(stats.is_moe(i), i in stats.sliding_layers, i >= stats.n_layers)] for i, _ in kinds)


@lru_cache(maxsize=8192)
def _per_kind_bytes(workload: Workload, fields: tuple, layers: tuple, hw: Hardware,
                    runtime: Runtime) -> tuple[dict, float]:
    """({is MoE: bytes a layer of that kind keeps per token}, the most a layer keeps without
    recomputation, which its backward's gradients are about as large as) for a rank holding
    `layers`' kinds (one layer of each): once per kinds and fields, not per rank or pipeline."""
    tp, cp, ep, mbs, recompute, sp, cp_method = fields
    layout = Layout(tp=tp, cp=cp, ep=ep, mbs=mbs, recompute=recompute, sp=sp, cp_method=cp_method)
    imbalance = rank_imbalance(workload, layout)
    per_kind = {workload.stats.is_moe(layer): layer_activation_bytes(workload, layer, layout, layout.recompute,
                                                                     hw, runtime, imbalance)
                for layer in layers}
    # The backward of one layer materialises gradients about as large as what that layer saved;
    # under full recomputation it first rebuilds that layer's activations as well.
    biggest = max((layer_activation_bytes(workload, layer, layout, "none", hw, runtime, imbalance)
                   for layer in layers), default=0.0)
    return per_kind, biggest


# ----------------------------------------------------------------------------------------- total
