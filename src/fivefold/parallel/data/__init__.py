"""Data parallelism: build.py picks the variant for parallel.zero; replicate.py (DDP, and the base
every variant shares), zero.py (ZeRO-1/2, ours), fsdp.py (ZeRO-3 through FSDP2), buckets.py."""
