"""DeepSeek-V3: multi-head latent attention with YaRN RoPE, the first layers dense, then MoE layers
with a shared expert, sigmoid scores, bias balancing, group-limited routing and
routed_scaling_factor; Hugging Face DeepseekV3ForCausalLM. Multi-token prediction is not here:
transformers' class drops the MTP layers on load, so there is nothing to be equal to."""
