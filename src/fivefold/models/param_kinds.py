"""The kind of every parameter (embedding, output, norm, bias, router, attention, mlp, experts,
other), so that optimizer settings can be chosen per kind (config/param_groups.py) while the code
that shards parameters knows no family's module names: the kinds come from this package's module
classes and the decoder's block structure, never from parameter names.

A block is any module holding `attention` and `feed_forward` (TransformerBlock and its
subclasses, e.g. the MTP layers); a parameter inside its attention is `attention`, inside its
feed-forward `mlp`, inside an MoE's `Experts` `experts` and inside its `Router` `router`. A norm's
weight and any bias (an expert's stacked biases too) are `norm` and `bias` wherever they sit. A
tied output matrix is the embedding: one tensor has one kind.
"""

from __future__ import annotations

from torch import nn

# Kinds whose parameters are the weight matrices inside the blocks (what Muon orthogonalises).
BLOCK_MATRIX_KINDS = ("attention", "mlp", "experts", "router")


def _is_block(module: nn.Module) -> bool:
    return isinstance(getattr(module, "attention", None), nn.Module) and \
        isinstance(getattr(module, "feed_forward", None), nn.Module)


def param_kinds(model: nn.Module) -> dict[str, str]:
    """Single-device parameter name -> kind, for every name a parameter has (a tied matrix's
    second name included, with the kind of its first)."""
    from fivefold.models.moe.layer import Experts, Router
    from fivefold.models.rms_norm import RMSNorm

    region: dict[str, str] = {}  # module name -> the block region it opens
    for name, module in model.named_modules():
        if _is_block(module):
            region[f"{name}.attention"] = "attention"
            region[f"{name}.feed_forward"] = "mlp"
        if isinstance(module, Router):
            region[name] = "router"
        elif isinstance(module, Experts):
            region[name] = "experts"
    first_kind: dict[int, str] = {}
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for short, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{module_name}.{short}" if module_name else short
            if id(param) not in first_kind:
                first_kind[id(param)] = _kind(module_name, module, short, param, region, RMSNorm)
            out[full] = first_kind[id(param)]
    return out


def _kind(module_name: str, module: nn.Module, short: str, param, region: dict, norm_class) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, norm_class):
        return "norm"
    if short == "bias" or (region.get(module_name) == "experts" and param.dim() < 3):
        return "bias"  # an nn.Linear's bias, or an MoE's per-expert biases (one vector per expert)
    # The innermost region around the module: a router inside an MoE inside a block is a router.
    parts = module_name.split(".")
    for end in range(len(parts), 0, -1):
        kind = region.get(".".join(parts[:end]))
        if kind is not None:
            return kind
    if module_name == "output":
        return "output"
    return "other"
