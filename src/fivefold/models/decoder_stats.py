"""Parameter counts and FLOPs of models/decoder.py's decoder, from the same ModelConfig training
uses: the planner's statistics of every family built on it (their stats.py call `decoder_stats`).

The block counted: RMSNorm, grouped-query attention (q, k, v and output projections; with qk_norm
an RMSNorm of head_dim on q and on k; with attention_bias their biases, with attention_sinks one
logit per head), SwiGLU MLP, and for MoE layers a linear router (with router_bias its bias), routed
experts (each a SwiGLU MLP of expert_ffn_dim, with projection_bias its three biases) and optional
shared experts. Layers with a sliding window (models/attention/layout.py) attend to at most that
many keys. Pure arithmetic: no torch (the planner must run anywhere in milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.models.attention.layout import attention_window
from fivefold.models.moe.layout import is_moe_layer


@dataclass(frozen=True)
class ModelStats:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool
    attention_params: int  # per layer: the q, k, v and output projections (+ q/k norms)
    norm_params: int  # per layer: two RMSNorm weights
    dense_mlp_params: int  # per dense layer
    # MoE (zeros for a dense model)
    n_experts: int
    top_k: int
    expert_params: int  # one routed expert
    shared_expert_params: int  # all shared experts of one MoE layer
    router_params: int  # per MoE layer
    moe_layers: tuple[int, ...]  # indices of MoE layers
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    # Value head dim when it differs from head_dim (latent attention: head_dim is the q/k head dim);
    # 0 = head_dim.
    v_head_dim: int = 0
    # Latent attention (MLA): the q and kv latent widths (0 = none; q_lora_rank 0 with kv_lora_rank
    # > 0 is a direct q projection) and the RoPE channels of each q/k head (0 = all of head_dim).
    # The down-projections d x (q_lora_rank + kv_lora_rank + rope) and the two latent norms run
    # whole on every tp rank (models/deepseek_v3/spec.py): latent_params.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    # Multi-token prediction (models/mtp.py): blocks n_layers .. n_layers + mtp_depth - 1, each a
    # layer (MoE where is_moe_layer says so) plus eh_proj (2d x d) and three norms, sharing the
    # embedding and output matrices. They run after the last layer, and on the last pipeline stage.
    mtp_depth: int = 0
    # Per layer: attention parameters whole on every tp rank besides MLA's latents (the output
    # projection's bias, added after the tp sum).
    replicated_attention_params: int = 0
    expert_ffn_dim: int = 0  # the routed experts' hidden width (0 = expert_params / (3 dim): no biases)
    # Sliding windows (gpt-oss): the layers that attend to at most `sliding_window` keys.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # sinks join the softmax: fivefold computes that attention unfused

    # ----- derived counts
    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of the values (kv heads x the value head dim)."""
        return self.n_kv_heads * (self.v_head_dim or self.head_dim)

    @property
    def o_dim(self) -> int:
        """Width of the attention output (heads x the value head dim)."""
        return self.n_heads * (self.v_head_dim or self.head_dim)

    @property
    def rope_dim(self) -> int:
        return self.rope_head_dim or self.head_dim

    @property
    def latent_params(self) -> int:
        """Per layer: the attention parameters replicated over tp (MLA's latent down-projections
        and norms); the rest of attention_params is split by heads."""
        if not self.kv_lora_rank:
            return self.replicated_attention_params
        q = self.q_lora_rank
        return (self.dim * (q + self.kv_lora_rank + self.rope_dim) + q + self.kv_lora_rank
                + self.replicated_attention_params)

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of a dense MLP: 3 for SwiGLU (gate, up, down), 2 for GeLU or squared ReLU."""
        if not self.ffn_dim or not self.dense_mlp_params:
            return 3
        return max(2, round(self.dense_mlp_params / (self.dim * self.ffn_dim)))

    @property
    def expert_hidden(self) -> float:
        """The routed experts' hidden width."""
        return self.expert_ffn_dim or self.expert_params / (3 * self.dim)

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): dim, unless head_dim is explicit."""
        return self.n_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the output projection when it is a separate matrix."""
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def mtp_layers(self) -> range:
        return range(self.n_layers, self.n_layers + self.mtp_depth)

    @property
    def mtp_params(self) -> int:
        """All multi-token-prediction blocks (their shared matrices are counted once, in embedding_params)."""
        return sum(self.layer_params(i) for i in self.mtp_layers)

    def layer_params(self, layer: int, active_only: bool = False) -> int:
        base = self.attention_params + self.norm_params
        if layer >= self.n_layers:  # a multi-token-prediction block: eh_proj, enorm, hnorm, head norm
            base += 2 * self.dim * self.dim + 3 * self.dim
        if not self.is_moe(layer):
            return base + self.dense_mlp_params
        experts = self.top_k if active_only else self.n_experts
        return base + self.router_params + self.shared_expert_params + experts * self.expert_params

    @property
    def total_params(self) -> int:
        layers = sum(self.layer_params(i) for i in range(self.n_layers + self.mtp_depth))
        return layers + self.embedding_params + self.dim  # + final norm

    @property
    def active_params(self) -> int:
        """Parameters one token touches (MoE: top_k routed experts instead of all of them)."""
        layers = sum(self.layer_params(i, active_only=True) for i in range(self.n_layers + self.mtp_depth))
        return layers + self.embedding_params + self.dim

    @property
    def expert_params_total(self) -> int:
        return self.n_moe_layers * self.n_experts * self.expert_params

    # ----- FLOPs
    def attention_flops_per_token(self, seq_len: int) -> float:
        """Score and value matmuls, forward + backward, counted over the full (non-causal) square
        the way the Playbook's MFU counts them: 12 * h * s per layer (h = heads x head_dim); with
        its own value head dim, 6 * heads * (head_dim + v_head_dim) * s."""
        if self.v_head_dim:
            return 6.0 * self.n_heads * (self.head_dim + self.v_head_dim) * seq_len
        return 12.0 * self.n_heads * self.head_dim * seq_len

    def layer_attention_flops_per_token(self, layer: int, seq_len: int) -> float:
        """attention_flops_per_token of one layer: a sliding-window layer's queries see at most
        `sliding_window` keys."""
        if layer in self.sliding_layers:
            seq_len = min(seq_len, self.sliding_window)
        return self.attention_flops_per_token(seq_len)

    def moe_flops_per_token(self, layer: int) -> float:
        """The MoE part of a layer (router, shared experts, the top-k routed experts); 0 if dense."""
        if not self.is_moe(layer):
            return 0.0
        return 6.0 * (self.router_params + self.shared_expert_params + self.top_k * self.expert_params)

    def layer_flops_per_token(self, layer: int, seq_len: int) -> float:
        """A multi-token-prediction block also runs the (shared) output layer once more."""
        head = self.output_flops_per_token if layer >= self.n_layers else 0.0
        return 6.0 * self.layer_params(layer, active_only=True) + self.layer_attention_flops_per_token(layer, seq_len) + head

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token for forward + backward: 6 N_active + 12 L q s (no recomputation;
        q = heads x head_dim). MoE counts the experts a token visits, not all of them. Each
        multi-token-prediction block counts as a layer, plus its use of the output layer.

        N includes the embedding, as the Playbook's and most MFU figures do."""
        attention = sum(self.layer_attention_flops_per_token(i, seq_len) for i in range(self.n_layers + self.mtp_depth))
        return 6.0 * self.active_params + attention + self.mtp_depth * self.output_flops_per_token

    def lora_flops_per_token(self, seq_len: int, adapter_params_per_token: float) -> float:
        """A LoRA run's model FLOPs per token: the frozen base runs forward and passes gradients
        back (4 per weight: forward and input gradient) but makes no weight gradient, and the
        adapters a token passes through train (6 per weight; models/block_weights.py counts them)."""
        return self.flops_per_token(seq_len) - 2.0 * self.active_params + 6.0 * adapter_params_per_token

    def mfu(self, seq_len: int, tokens_per_sec_per_device: float, peak_flops: float,
            adapter_params_per_token: float | None = None) -> float:
        """Model FLOPs utilisation: the share of a device's peak that this throughput's model FLOPs
        are. The one formula of the trainer's reported MFU and the planner's predicted one; under
        LoRA (`adapter_params_per_token` given) the FLOPs a frozen base needs, lora_flops_per_token."""
        flops = (self.flops_per_token(seq_len) if adapter_params_per_token is None
                 else self.lora_flops_per_token(seq_len, adapter_params_per_token))
        return tokens_per_sec_per_device * flops / peak_flops

    @property
    def output_flops_per_token(self) -> float:
        """The output projection (a real matmul, unlike the embedding lookup)."""
        return 6.0 * self.vocab_size * self.dim

    def head_flops_per_token(self, seq_len: int) -> float:
        """What the last pipeline stage runs after the layers: the output projection and the
        multi-token-prediction blocks."""
        return self.output_flops_per_token + sum(self.layer_flops_per_token(i, seq_len) for i in self.mtp_layers)


def decoder_stats(model, qk_norm: bool = False) -> ModelStats:
    """ModelConfig -> ModelStats of models/decoder.py's Transformer."""
    h, head_dim = model.dim, model.head_dim
    q, kv = model.n_heads * head_dim, model.n_kv_heads * head_dim
    moe = model.moe
    n_experts = moe.n_experts
    if n_experts > 0:
        expert_ffn = moe.expert_ffn_dim or model.ffn_dim
        moe_layers = tuple(i for i in range(model.n_layers + model.mtp_depth) if is_moe_layer(model, i))
        shared = moe.n_shared_experts * 3 * h * expert_ffn  # no biases
        expert_params = 3 * h * expert_ffn + ((2 * expert_ffn + h) if moe.projection_bias else 0)
        router = h * n_experts + (n_experts if moe.router_bias else 0)
        top_k = moe.top_k
    else:
        moe_layers, expert_params, shared, router, top_k, expert_ffn = (), 0, 0, 0, 0, 0
    biases = (q + 2 * kv) if model.attention_bias else 0  # split over tp with their heads
    sinks = model.n_heads if model.attention_sinks else 0
    return ModelStats(
        dim=h, n_layers=model.n_layers, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
        head_dim=head_dim, ffn_dim=model.ffn_dim, vocab_size=model.vocab_size,
        tie_embeddings=model.tie_embeddings,
        attention_params=(2 * h * q + 2 * h * kv + (2 * head_dim if qk_norm else 0) + biases + sinks
                          + (h if model.attention_bias else 0)), norm_params=2 * h,
        dense_mlp_params=(3 if model.mlp_activation == "swiglu" else 2) * h * model.ffn_dim,
        n_experts=n_experts, top_k=top_k, expert_params=expert_params,
        shared_expert_params=shared, router_params=router, moe_layers=moe_layers, qk_norm=qk_norm,
        mtp_depth=model.mtp_depth, replicated_attention_params=h if model.attention_bias else 0,
        expert_ffn_dim=expert_ffn, sliding_window=model.sliding_window,
        sliding_layers=tuple(i for i in range(model.n_layers) if attention_window(model, i)),
        attention_sinks=model.attention_sinks,
    )
