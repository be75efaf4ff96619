"""Attention beyond SDPA's causal flag: blocks of queries against blocks of keys with their
log-sum-exp (blocks.py), how windows, document masks and sinks cut them (windows.py, masked.py,
documents.py), which layers slide (layout.py) and each head's largest logit for QK-clip
(logit_max.py)."""
