"""What a rank holds at its peak: the total by ZeRO stage, pipeline rank and schedule (peak.py), the
activations backward reads (activations.py), selective recomputation's split of a block's branches
(branch_split.py), and what another framework's memory recipe changes (framework.py)."""
