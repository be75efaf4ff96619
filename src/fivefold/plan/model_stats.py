"""Parameter counts and FLOPs of a decoder-only model, from the same ModelConfig training uses.

The architecture counted is fivefold's Llama-style block: RMSNorm, grouped-query attention without
biases (wq, wk, wv, wo), SwiGLU MLP (w1, w2, w3), and for MoE layers a linear router, routed
experts (each a SwiGLU MLP of expert_ffn_dim) and optional shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    attention_params: int  # per layer: wq, wk, wv, wo
    norm_params: int  # per layer: two RMSNorm weights
    dense_mlp_params: int  # per dense layer
    # MoE (zeros for a dense model)
    n_experts: int
    top_k: int
    expert_params: int  # one routed expert
    shared_expert_params: int  # all shared experts of one MoE layer
    router_params: int  # per MoE layer
    moe_layers: tuple[int, ...]  # indices of MoE layers

    # ----- derived counts
    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the output projection when it is a separate matrix."""
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def layer_params(self, layer: int, active_only: bool = False) -> int:
        base = self.attention_params + self.norm_params
        if not self.is_moe(layer):
            return base + self.dense_mlp_params
        experts = self.top_k if active_only else self.n_experts
        return base + self.router_params + self.shared_expert_params + experts * self.expert_params

    @property
    def total_params(self) -> int:
        layers = sum(self.layer_params(i) for i in range(self.n_layers))
        return layers + self.embedding_params + self.dim  # + final norm

    @property
    def active_params(self) -> int:
        """Parameters one token touches (MoE: top_k routed experts instead of all of them)."""
        layers = sum(self.layer_params(i, active_only=True) for i in range(self.n_layers))
        return layers + self.embedding_params + self.dim

    @property
    def expert_params_total(self) -> int:
        return self.n_moe_layers * self.n_experts * self.expert_params

    # ----- FLOPs
    def attention_flops_per_token(self, seq_len: int) -> float:
        """Score and value matmuls, forward + backward, counted over the full (non-causal) square
        the way the Playbook's MFU counts them: 12 * h * s per layer (h = heads x head_dim)."""
        return 12.0 * self.n_heads * self.head_dim * seq_len

    def moe_flops_per_token(self, layer: int) -> float:
        """The MoE part of a layer (router, shared experts, the top-k routed experts); 0 if dense."""
        if not self.is_moe(layer):
            return 0.0
        return 6.0 * (self.router_params + self.shared_expert_params + self.top_k * self.expert_params)

    def layer_flops_per_token(self, layer: int, seq_len: int) -> float:
        return 6.0 * self.layer_params(layer, active_only=True) + self.attention_flops_per_token(seq_len)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token for forward + backward: 6 N_active + 12 L h s (no recomputation).

        N includes the embedding, as the Playbook's and most MFU figures do."""
        return 6.0 * self.active_params + self.n_layers * self.attention_flops_per_token(seq_len)

    @property
    def output_flops_per_token(self) -> float:
        """The output projection (a real matmul, unlike the embedding lookup)."""
        return 6.0 * self.vocab_size * self.dim


def model_stats(model) -> ModelStats:
    """ModelConfig -> ModelStats."""
    h, head_dim = model.dim, model.dim // model.n_heads
    kv = model.n_kv_heads * head_dim
    moe = model.moe
    n_experts = moe.n_experts
    if n_experts > 0:
        expert_ffn = moe.expert_ffn_dim or model.ffn_dim
        moe_layers = tuple(i for i in range(moe.first_dense, model.n_layers)
                           if (i - moe.first_dense) % moe.every == 0)
        expert_params = 3 * h * expert_ffn
        shared = moe.n_shared_experts * expert_params
        router = h * n_experts
        top_k = moe.top_k
    else:
        moe_layers, expert_params, shared, router, top_k = (), 0, 0, 0, 0
    return ModelStats(
        dim=h, n_layers=model.n_layers, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
        head_dim=head_dim, ffn_dim=model.ffn_dim, vocab_size=model.vocab_size,
        tie_embeddings=model.tie_embeddings,
        attention_params=2 * h * h + 2 * h * kv, norm_params=2 * h,
        dense_mlp_params=3 * h * model.ffn_dim,
        n_experts=n_experts, top_k=top_k, expert_params=expert_params,
        shared_expert_params=shared, router_params=router, moe_layers=moe_layers,
    )
