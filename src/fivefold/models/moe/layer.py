"""Mixture-of-Experts feed-forward: router, SwiGLU experts, optional shared experts; gpt-oss's
router bias, expert biases and clamped SwiGLU as options of the same modules.

Still a plain single-device module. Two seams let parallel/expert/apply.py spread the experts over ranks
without touching the math here:
- `MoE.run_experts(tokens, counts)` computes the experts on tokens already sorted by expert;
  expert parallelism swaps it for all-to-all dispatch, the local experts, and all-to-all combine.
- Everything that depends on several tokens (capacity, auxiliary loss, load) is decided per
  *sequence* (GShard's "group" = one sequence), on the rank that holds the sequence, before any
  dispatch. A sequence never spans data-parallel ranks, micro-batches or pipeline stages, so every
  such layout makes the same decisions as the single process, without extra communication.
  Context parallelism does split sequences, and tensor parallelism splits a rank's sequence once
  more (each tp rank routes a contiguous slice of it): a layout declares each split with
  `split_sequences` (a models/moe/capacity.py SequenceSplit: which chunks of the whole these tokens
  are, a gather of per-chunk counts, a sum over holders), and the decisions become those of the
  whole sequence; `nested` composes the two levels, so tp alone, cp alone and both decide as the
  single process does. Without a split this file computes everything from the tokens it is given.

The auxiliary loss reaches the gradients without being added to the model's output: an autograd
function passes the layer's output through unchanged and, in backward, gives the auxiliary loss the
gradient of the micro-batch's weight in its step (Megatron's approach; models/loss/weight.py: 1/micro-
batches, like the LM loss, stated by the training loop around its forwards). So it works the same
inside a pipeline stage or a recomputed block.
Router statistics (load per expert, dropped assignments, auxiliary loss value) are kept per
forward that counts (models/forward_kind.py: not evaluation, not a recomputation); `take_stats(n)`
sums the last n (a step's micro-batches: a pipeline stage's first step runs one extra forward to
infer shapes) and clears them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig, MoEConfig
from fivefold.models.decoder import FeedForward
from fivefold.models.forward_kind import counts_for_stats
from fivefold.models.loss.weight import current_micro_batch_weight
from fivefold.models.moe.capacity import SequenceSplit, capacity_keep, nested
from fivefold.models.moe.layout import is_moe_layer
from fivefold.models.swiglu import swiglu
from fivefold.torch_internals import grouped_mm, has_grouped_mm


def moe_feed_forward(cfg: ModelConfig, index: int) -> nn.Module | None:
    """The MoE feed-forward of layer `index`, or None where the layer stays dense."""
    return MoE(cfg.dim, cfg.moe.expert_ffn_dim or cfg.ffn_dim, cfg.moe) if is_moe_layer(cfg, index) else None


class Router(nn.Module):
    """Scores every expert, picks top-k. With balance="bias" (DeepSeek-V3), a per-expert bias is
    added for the choice only; the combine weights come from the unbiased scores. DeepSeek-V3 also
    limits each token to its best `topk_group` of `n_group` expert groups, and scales the combine
    weights by `routed_scaling_factor`; at their defaults (1, 1, 1.0) both steps are skipped, so
    the other families route exactly as before. gpt-oss's softmax over the top-k logits alone is
    this softmax over all of them renormalised over the chosen ones (norm_topk_prob), the same
    numbers; its router adds a learned bias to the logits (`router_bias`)."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.n_experts, bias=cfg.router_bias)  # gpt-oss's router has a bias
        # A buffer, not a parameter: moved by observed load, never by gradients; saved with the model.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (T, dim) -> scores (T, E) fp32, chosen experts (T, k), combine weights (T, k)."""
        logits = self.gate(tokens).float()
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.cfg.balance == "bias" else scores
        if self.cfg.n_group > 1:
            choice = limit_to_groups(choice, self.cfg.n_group, self.cfg.topk_group)
        indices = choice.topk(self.cfg.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, indices)
        if self.cfg.top_k > 1 and self.cfg.norm_topk_prob:  # Mixtral, DeepSeek-V3 and Qwen3-MoE renormalise
            weights = weights / weights.sum(-1, keepdim=True)
        if self.cfg.routed_scaling_factor != 1.0:
            weights = weights * self.cfg.routed_scaling_factor
        return scores, indices, weights


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: (T, E) choice scores with every expert outside the token's
    best `topk_group` groups set to -inf. A group's score is the sum of its two best choice scores
    (its single best when a group holds one expert), so one lucky expert does not carry a group."""
    tokens, n_experts = choice.shape
    grouped = choice.view(tokens, n_group, n_experts // n_group)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, n_experts)


class Experts(nn.Module):
    """n SwiGLU experts stored stacked, (experts, out, in) like nn.Linear weights, so that a rank
    can keep a slice of them and a grouped matmul can take them whole. With `bias` (gpt-oss) each
    projection has a stacked bias too: b1 (gate) and b3 (up) (experts, hidden), b2 (experts, dim).
    `activation(gate, up)` joins the two (`swiglu`, or gpt-oss's `clamped_swiglu`)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, bias: bool = False, activation=None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b2 = nn.Parameter(torch.empty(n_experts, dim))
            self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
        self.activation = activation or swiglu

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (N, dim) rows sorted by expert, counts[e] rows for expert e of this module."""
        return self.apply_weights(x, counts, lambda w: w)

    def apply_weights(self, x: torch.Tensor, counts: list[int], local) -> torch.Tensor:
        """The experts with each stacked tensor read through `local` (tensor parallelism: its local
        tensor, parallel/tensor/apply.py)."""
        biases = tuple(local(getattr(self, b)) for b in ("b1", "b2", "b3")) if hasattr(self, "b1") else None
        if hasattr(self, "lora_scaling"):  # adapters beside some projections (models/lora/adapters.py)
            from fivefold.models.lora.experts import adapted_swiglu

            return adapted_swiglu(self, x, counts, local, biases)
        return grouped_swiglu(x, local(self.w1), local(self.w2), local(self.w3), counts, biases, self.activation)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's: the gate clamped from above and the up projection on both sides at `limit`, then
    gate·sigmoid(alpha·gate)·(up + 1)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def expert_activation(cfg: MoEConfig):
    if cfg.activation == "clamped_swiglu":
        return functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return swiglu


def grouped_swiglu(x, w1, w2, w3, counts: list[int], biases=None, activation=swiglu) -> torch.Tensor:
    """`biases`: (b1, b2, b3) stacked per expert, or None."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    biases = tuple(b.to(dtype) for b in biases) if biases is not None else None
    if grouped_mm_usable(x.device, dtype, x.shape[-1], w1.shape[1]):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        gate, up = grouped_mm(x, w1.mT, offs=offsets), grouped_mm(x, w3.mT, offs=offsets)
        if biases is not None:  # each row's expert's bias
            expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                             torch.tensor(counts, device=x.device), output_size=x.shape[0])
            gate, up = gate + biases[0][expert], up + biases[2][expert]
        out = grouped_mm(activation(gate, up), w2.mT, offs=offsets)
        return out + biases[1][expert] if biases is not None else out
    return looped_swiglu(x, w1, w2, w3, counts, biases, activation)


def looped_swiglu(x, w1, w2, w3, counts: list[int], biases=None, activation=swiglu) -> torch.Tensor:
    """One matmul per expert: the fallback, and the reference the grouped path is tested against."""
    b1, b2, b3 = biases if biases is not None else (None, None, None)
    outs = [F.linear(activation(F.linear(part, w1[e], None if b1 is None else b1[e]),
                                F.linear(part, w3[e], None if b3 is None else b3[e])),
                     w2[e], None if b2 is None else b2[e])
            for e, part in enumerate(x.split(counts))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


GROUPED_MM_ENABLED = True  # benchmarks turn it off to time the per-expert loop


def grouped_mm_usable(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    # torch._grouped_mm needs row strides in multiples of 16 bytes, and not every device/dtype has it
    # (CUDA wants bf16 on recent GPUs; CPU takes fp32 and bf16 in torch 2.13).
    aligned = all(n * torch.finfo(dtype).bits // 8 % 16 == 0 for n in (dim, hidden))
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False  # torch 2.13's fake-tensor kernel of _grouped_mm takes bf16 only: trace the loop
    return GROUPED_MM_ENABLED and aligned and _grouped_mm_works(device.type, device.index, dtype)


@functools.cache
def _grouped_mm_works(device_type: str, index, dtype: torch.dtype) -> bool:
    """Try it once per device and dtype on a tiny aligned problem, forward and backward."""
    if not has_grouped_mm():
        return False
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    # In a thread of its own: the first call may come from inside a recomputed (checkpointed) block,
    # whose saved-tensor hooks and dispatch modes are per thread. Selective recomputation's mode
    # replays the saved matmuls in order, so a probe seen by the first forward and not by the
    # recomputation would shift every later one (a shape mismatch in backward).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_try_grouped_mm, device, dtype).result()


def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        x = torch.ones(3, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        out = grouped_mm(x, w, offs=torch.tensor([1, 3], device=device, dtype=torch.int32))
        out.backward(torch.ones_like(out))
        return bool(torch.allclose(out.float(), torch.full((3, 16), 16.0, device=device)))
    except (RuntimeError, NotImplementedError):
        return False


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `out`; backward also sends `scale` into `aux`, as if `scale·aux` were in the loss."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


@dataclass
class RouterStats:
    """Summed over forwards on this rank."""
    load: torch.Tensor | None = None  # (E,) assignments chosen per expert, before capacity drops
    dropped: int = 0  # assignments dropped by capacity
    aux_loss: float = 0.0  # sum of the forwards' auxiliary losses (unscaled)
    forwards: int = 0

    def add(self, other: "RouterStats") -> "RouterStats":
        load = other.load if self.load is None else self.load + other.load
        return RouterStats(load, self.dropped + other.dropped, self.aux_loss + other.aux_loss,
                           self.forwards + other.forwards)


EXPERTS = "experts"  # the attribute of MoE holding the stacked experts (expert parallelism splits it)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(dim, cfg)
        self.experts = Experts(cfg.n_experts, dim, hidden, cfg.projection_bias, expert_activation(cfg))
        self.shared = FeedForward(dim, hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.sequence_split: SequenceSplit | None = None  # the whole sequence split over ranks
        self.slice_split: SequenceSplit | None = None  # the rank's sequence cut into slices
        self.stats: list[RouterStats] = []  # one per forward since the last take_stats

    def split_sequences(self, over_ranks: SequenceSplit | None = None, into_slices: SequenceSplit | None = None):
        """What a layout tells the layer once, as it builds: its sequences are split over ranks
        (context parallelism) and/or the rank's sequence into slices (tensor parallelism)."""
        self.sequence_split = over_ranks or self.sequence_split
        self.slice_split = into_slices or self.slice_split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        k, n_experts = self.cfg.top_k, self.cfg.n_experts
        tokens = x.reshape(-1, dim)
        scores, indices, weights = self.router(tokens)
        split = nested(self.sequence_split, self.slice_split)
        whole_seq = seq if split is None else seq * split.n_chunks // len(split.chunks)
        keep = capacity_keep(indices.view(batch, seq, k), n_experts, self.capacity(whole_seq), split).reshape(-1)
        aux = (sequence_aux_loss(scores.view(batch, seq, -1), indices.view(batch, seq, k), self.cfg,
                                 None if split is None else split.total)
               if self.cfg.balance == "aux_loss" else None)
        if counts_for_stats():
            self._record(indices, keep, aux)

        # Assignments (token, slot) that survive capacity, sorted by expert (stable: same order in
        # every layout, so the combine below adds the same numbers in the same order).
        experts_of = indices.reshape(-1)[keep]
        token_of = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(k)[keep]
        order = torch.argsort(experts_of, stable=True)
        counts = torch.bincount(experts_of, minlength=n_experts).tolist()
        routed = self.run_experts(tokens[token_of[order]], counts)
        weighted = routed * weights.reshape(-1)[keep][order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros(tokens.shape[0], dim, dtype=routed.dtype, device=x.device)
        out = out.index_add(0, token_of[order], weighted)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(batch, seq, dim).to(x.dtype)
        if aux is not None and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, aux, current_micro_batch_weight())
        return out

    @torch.no_grad()
    def _record(self, indices, keep, aux) -> None:
        self.stats.append(RouterStats(torch.bincount(indices.reshape(-1), minlength=self.cfg.n_experts),
                                      int((~keep).sum()), float(aux) if aux is not None else 0.0, 1))

    def take_stats(self, last: int | None = None) -> RouterStats:
        """The sum over the last `last` recorded forwards (all when None); clears the record."""
        kept = self.stats[-last:] if last else self.stats
        self.stats = []
        total = RouterStats()
        for one in kept:
            total = total.add(one)
        return total

    def run_experts(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by expert (counts[e] for expert e) -> expert outputs in the same order."""
        return self.experts(routed, counts)

    def capacity(self, seq: int) -> int | None:
        """Assignments each expert takes per sequence; None = dropless."""
        c = self.cfg
        return math.ceil(c.capacity_factor * seq * c.top_k / c.n_experts) if c.capacity_factor > 0 else None

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's aux-loss-free balancing: nudge the choice bias of overloaded experts down and
        of underloaded ones up by a fixed rate, from the load seen over a whole step."""
        load = load.to(self.router.expert_bias.device, torch.float32)
        self.router.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)


def sequence_aux_loss(scores: torch.Tensor, indices: torch.Tensor, cfg: MoEConfig,
                      sequence_sum=None) -> torch.Tensor:
    """Switch/GShard load-balancing loss per sequence, averaged over the sequences:
    coeff · E · Σ_e f_e · P_e, f_e = share of the sequence's k·seq assignments that chose e,
    P_e = mean routing probability of e over its tokens (sigmoid scores normalised per token).
    Uniform routing gives exactly `coeff`.

    `sequence_sum`, when given, adds a per-sequence statistic over every holder of a piece of
    the sequence (differentiably), for a sequence split over ranks; None: this is the whole
    sequence."""
    batch, seq, k = indices.shape
    probs = scores if cfg.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    with torch.no_grad():
        chosen = F.one_hot(indices, cfg.n_experts).sum((1, 2)).float()  # (batch, E)
    prob_sums = probs.sum(1)  # (batch, E)
    tokens = torch.full((batch, 1), float(seq), device=scores.device)
    if sequence_sum is not None:
        chosen, prob_sums, tokens = sequence_sum(chosen), sequence_sum(prob_sums), sequence_sum(tokens)
    fraction = chosen.detach() / (tokens.detach() * k)
    per_sequence = cfg.n_experts * (fraction * prob_sums / tokens.detach()).sum(-1)
    return cfg.aux_loss_coeff * per_sequence.mean()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def is_expert_param(name: str) -> bool:
    """Whether a parameter (by its single-device name) is one of an MoE layer's stacked expert
    tensors: a direct parameter of the `experts` module of this file's MoE."""
    parent, _, _ = name.rpartition(".")
    return parent == EXPERTS or parent.endswith("." + EXPERTS)
