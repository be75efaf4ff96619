"""Context parallelism (ours): apply.py splits each sequence over the cp ranks and swaps the attention
core; ring.py, gathered.py (all-gather, Ulysses) make attention whole; blocks.py is one block's math."""
