"""Data: text in, global batches out. Reading documents (readers.py), `fivefold prepare` and its
chat packing (prepare.py, prepare_chat.py, chat_template.py), the prepared folder memory-mapped
(token_shards.py), the global batch of each step from one source or a mixture (batches.py,
mixture.py, permutation.py) and the next batch read ahead (prefetch.py)."""
