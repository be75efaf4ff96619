"""Parallelism, applied after a plain model is built: parallelize.py is the one ordered function,
parallelized.py the façade the trainer sees; one folder per dimension (data/, tensor/, pipeline/,
context/, expert/) and the pieces they share at this level (materialize, recompute, collectives,
gradient norm, communication ledger). Nothing here names a model family's modules: it reads ModelSpecs."""
