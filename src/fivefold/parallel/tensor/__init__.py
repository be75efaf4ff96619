"""Tensor parallelism (+ sequence parallelism): apply.py lays the weights out over the tp group,
layers.py computes on the local shards, sharded_inputs.py keeps the gathered inputs' shards."""
