"""Mixture-of-Experts: the feed-forward with its router and experts (feed_forward.py), the
assignments each expert takes under a capacity (capacity.py) and which layers are MoE (layout.py)."""
