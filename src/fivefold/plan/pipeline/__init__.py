"""Pipeline facts for the planner: stages and the ranks that run them (stage_split.py), micro-batches
in flight and the bubble per schedule (schedule.py), and the splits the planner prices that the
trainer does not run (short_chunks.py)."""
