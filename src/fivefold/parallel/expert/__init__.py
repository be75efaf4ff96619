"""Expert parallelism (ours): apply.py spreads each MoE layer's experts over the ep ranks and
dispatches tokens to them; replicas.py copies the hottest experts onto the least-loaded ranks."""
