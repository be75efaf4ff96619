"""Mixture-of-Experts: the layer with its router and experts (layer.py), the assignments each
expert takes under a capacity (capacity.py) and which layers are MoE (layout.py)."""
