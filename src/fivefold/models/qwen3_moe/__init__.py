"""Qwen3-MoE: Qwen3's attention with fine-grained routed experts (their own expert_ffn_dim),
`norm_topk_prob`, and dense layers by list (mlp_only_layers) or step (decoder_sparse_step);
Hugging Face Qwen3MoeForCausalLM."""
