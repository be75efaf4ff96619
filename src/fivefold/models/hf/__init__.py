"""Hugging Face interop: reading and writing a family's checkpoint folders (interop.py) through its
adapter (adapter.py) and the shared config.json keys (config.py), weights streamed box by box from
safetensors (stream.py), gpt-oss's MXFP4 experts (mxfp4.py) and LoRA adapters under PEFT's names
(peft_names.py)."""
