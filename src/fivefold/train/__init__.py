"""Training: the loop (trainer.py), the optimizer (optim.py, muon.py), faults and hangs, the local
launcher, preemption, the metrics a step reports, export to Hugging Face, and the probes the planner
is checked against. Data and checkpoints have rooms of their own (fivefold/data, fivefold/checkpoint)."""
