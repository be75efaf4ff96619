"""Facts about the pipeline schedules that validation, the planner and the pipeline all read.

They are declared here, at the bottom, so that checking a config needs neither torch nor the
pipeline code; parallel/pipeline/stages.py maps each name to torch.distributed.pipelining's class.
"""

from __future__ import annotations

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb", "zbv", "dualpipev")
# Schedules whose ranks hold two stages in a "V": rank r runs stages r and 2·pp-1-r, so the first
# and the last stage (embedding and output) sit on the same rank.
V_SCHEDULES = ("zbv", "dualpipev")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
# Schedules whose backward is split into input and weight passes (under them FSDP keeps blocks
# gathered from forward to backward, parallel/data/fsdp.py).
SPLIT_BACKWARD_SCHEDULES = ("zb", "zbv", "dualpipev")


def parse_layer_counts(text: str) -> list[int]:
    """`parallel.pp_layers` ('3,5') -> [3, 5]; ValueError when an entry is not an integer."""
    return [int(part) for part in text.split(",") if part.strip()]
