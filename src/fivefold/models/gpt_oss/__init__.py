"""gpt-oss: grouped-query attention with q/k/v/o biases, attention sinks and sliding windows in
alternate layers, YaRN RoPE over the whole head, and every layer an MoE with a router bias, expert
biases and the clamped SwiGLU; Hugging Face GptOssForCausalLM (unquantised weights: MXFP4 files
are refused)."""
