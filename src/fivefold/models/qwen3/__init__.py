"""Qwen3 (dense): the decoder with per-head q/k RMSNorm and an explicit head_dim; Hugging Face
Qwen3ForCausalLM."""
