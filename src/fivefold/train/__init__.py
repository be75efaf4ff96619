"""Training: the loop (trainer.py), the optimizer, the data (prepare, token shards, mixtures,
readers), checkpoints (checkpoint.py with sharded_io.py, state_boxes.py, state_shapes.py), faults,
the local launcher and the metrics a step reports."""
