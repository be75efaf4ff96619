"""Mixtral-style MoE: the Llama block with a routed-experts feed-forward (models/moe/layer.py) in its MoE
layers; Hugging Face MixtralForCausalLM. DeepSeek-V3-style configs (sigmoid router, bias balancing,
shared experts) train in this family too, but only Mixtral-shaped ones export to Hugging Face."""
