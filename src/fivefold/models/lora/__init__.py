"""LoRA: adapters beside the targeted linear layers (adapters.py) and beside stacked experts
(experts.py)."""
