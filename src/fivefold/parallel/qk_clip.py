"""QK-clip (train.qk_clip = τ; Kimi K2's MuonClip) in every layout: each step, each attention
head's largest logit over the global batch; after the optimizer step, a head whose largest logit S
passed τ has its logits scaled by γ = τ / S through its query and key rows (the model's
`qk_row_scales` splits γ between them), in the weights the optimizer keeps (masters, ZeRO chunks,
FSDP2 shards: DataParallel.scale_rows).

Where the maxima come from: a forward hook on each attention core (the module that sees q and k:
the context-parallel one under cp, which gathers the keys of the whole sequence) asks it for the
heads' maxima of this micro-batch (`logit_max`), recorded per forward that counts
(models/forward_kind.py). A step's maximum is then taken over its last n_micro records (a pipeline
stage's first step begins with torch's shape-inference forward on uninitialised inputs, whose
"maxima" are garbage, NaN at worst), over the ranks that split the batch (dp and cp: an
all-reduce MAX) and assembled over tp (each tp rank holds a contiguous block of heads: an
all-gather). Pipeline stages clip their own layers. The model's modules say how (`qk_row_scales`,
`attention_core`); this file knows no family's names.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fivefold.models.forward_kind import counts_for_stats
from fivefold.parallel.step_hooks import StepHook


def clip_factors(maxima: torch.Tensor, threshold: float) -> torch.Tensor:
    """γ per head: τ / S where S > τ, else 1."""
    return (threshold / maxima).clamp(max=1.0)


class QKClipStep(StepHook):
    def __init__(self, parts, threshold: float):
        self.threshold = threshold
        self.attentions = [m for part in parts for m in part.modules() if hasattr(m, "qk_row_scales")]
        self.maxima: dict[int, list[torch.Tensor]] = {}  # id(attention) -> (local heads,) per forward
        for attention in self.attentions:
            attention.attention_core().register_forward_hook(functools.partial(self._record, attention),
                                                             with_kwargs=True)

    def _record(self, attention, core, args, kwargs, output) -> None:
        if not counts_for_stats():
            return
        q, k = args[0], args[1]
        documents = args[3] if len(args) > 3 else kwargs.get("documents")
        with torch.no_grad():
            heads = core.logit_max(q, k, documents)
        self.maxima.setdefault(id(attention), []).append(heads)

    def before_step(self, par, n_micro: int) -> None:
        self.maxima.clear()

    def after_optimizer_step(self, par, optimizer) -> dict:
        if not self.attentions:  # a pipeline stage without attention layers
            largest, clipped = float("-inf"), 0
        else:
            maxima = self._global_maxima(par)
            factors = clip_factors(maxima, self.threshold)
            scales = {}
            for attention, gamma in zip(self.attentions, factors):
                scales.update(attention.qk_row_scales(gamma))
            par.data_parallel.scale_rows(scales)
            largest, clipped = maxima.max().item(), int((factors < 1).sum())
        if par.pipeline is not None:  # every stage reports the whole model's
            numbers = torch.tensor([largest, clipped], dtype=torch.float64, device=par.device)
            largest_all = numbers[:1].clone()
            dist.all_reduce(largest_all, op=dist.ReduceOp.MAX, group=par.pipeline.pp_group)
            dist.all_reduce(numbers, group=par.pipeline.pp_group)
            largest, clipped = largest_all.item(), int(numbers[1].item())
        return {"qk_max_logit": largest, "qk_clipped_heads": clipped}

    def _global_maxima(self, par) -> torch.Tensor:
        """(attention layers of this rank, all heads): over the micro-batches, dp, cp and tp."""
        missing = [i for i, a in enumerate(self.attentions) if id(a) not in self.maxima]
        if missing:
            raise RuntimeError(f"QK-clip saw no forward pass of attention layer {missing[0]} this step")
        local = torch.stack([torch.stack(self.maxima[id(a)][-par.n_micro:]).amax(0) for a in self.attentions])
        if par.dp_cp_group is not None and dist.get_world_size(par.dp_cp_group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=par.dp_cp_group)
        if par.dims.tp > 1:  # tp rank r holds heads [r·H/tp, (r+1)·H/tp)
            pieces = [torch.empty_like(local) for _ in range(par.dims.tp)]
            dist.all_gather(pieces, local.contiguous(), group=par.mesh["tp"].get_group())
            local = torch.cat(pieces, dim=1)
        return local
