"""Pipeline parallelism through torch.distributed.pipelining: stages.py builds the stages and runs the
schedules; schedule_table.py is a schedule's action table and timeline. The layer split is
arithmetic the planner shares: plan/pipeline/stage_split.py."""
