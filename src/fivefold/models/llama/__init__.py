"""Llama 3.x (dense): models/decoder.py with Llama 3.1's RoPE scaling; Hugging Face LlamaForCausalLM."""
