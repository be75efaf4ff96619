"""Context parallelism (ours): each sequence is split over the cp ranks, attention made whole again.

Load balancing: the sequence is cut into 2·cp equal chunks and rank r keeps chunks r and 2·cp−1−r,
so under the causal mask every rank has the same attention work (an early chunk sees little, a
late one much). Inputs, labels and RoPE positions are split the same way; every other layer is
per-token and needs nothing. Every rank holds as many tokens as the others, so the mean of the
per-rank mean losses over dp×cp is the mean over the global batch.

Attention is the only layer that mixes tokens: each block's parameter-free attention core (the
family's ModelSpec.attention_core) is replaced by `ContextParallelAttention`, which runs one of three exact methods over the cp group:
ring (parallel/context/ring.py), all-gather or Ulysses (parallel/context/gathered.py), each
with the replaced core's sliding window and the attention sinks (parallel/context/windows.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.parallel.loss import IGNORE


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) that cp rank `rank` holds, early one first."""
    return rank, 2 * cp - 1 - rank


def gathered_chunk_order(cp: int) -> list[int]:
    """Global chunk index at each chunk slot of the ranks' local sequences laid end to end."""
    return [chunk for rank in range(cp) for chunk in chunks_of(rank, cp)]


def local_positions(rank: int, cp: int, local_len: int, device=None) -> torch.Tensor:
    """Positions in the whole sequence of this rank's `local_len` tokens."""
    chunk = local_len // 2
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks_of(rank, cp)])


@dataclass
class DocumentWindows:
    """Training windows (batch, seq_len+1) with each token's document id and, when RoPE restarts
    per document, its position in its document (`data.document_mask`, data/batches.py). It moves and
    splits along the batch as a tensor of windows does, so batches of either kind travel alike."""

    tokens: torch.Tensor
    documents: torch.Tensor
    positions: torch.Tensor | None = None  # None: 0, 1, 2... in every window
    # Chat data (`fivefold prepare --chat`): True where the token is a trained target; None: all are.
    loss_mask: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def _map(self, fn) -> "DocumentWindows":
        return DocumentWindows(*(None if t is None else fn(t) for t in self._fields()))

    def _fields(self) -> tuple:
        return self.tokens, self.documents, self.positions, self.loss_mask

    def to(self, device, non_blocking: bool = False) -> "DocumentWindows":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "DocumentWindows":
        return self._map(torch.Tensor.pin_memory)

    def chunk(self, n: int) -> list["DocumentWindows"]:
        parts = [t.chunk(n) if t is not None else [None] * n for t in self._fields()]
        return [DocumentWindows(*fields) for fields in zip(*parts)]


class SequenceSplit:
    """Which tokens of each training window this rank keeps: all of them at cp=1. With
    multi-token prediction (`mtp_depth` > 0) the labels are (batch, seq, 1 + mtp_depth), the tokens
    ahead of each position (models/mtp.py), made from the whole window before it is split."""

    def __init__(self, cp_rank: int = 0, cp: int = 1, mtp_depth: int = 0):
        self.cp_rank, self.cp, self.mtp_depth = cp_rank, cp, mtp_depth

    @classmethod
    def from_mesh(cls, mesh, mtp_depth: int = 0) -> "SequenceSplit":
        if mesh is None or mesh["cp"].size() == 1:
            return cls(mtp_depth=mtp_depth)
        return cls(mesh["cp"].get_local_rank(), mesh["cp"].size(), mtp_depth)

    def __call__(self, windows: torch.Tensor):
        """(inputs, labels, RoPE positions (1, local_seq) or None) from windows of seq_len+1 tokens."""
        return self.split(windows)[:3]

    def split(self, windows: torch.Tensor | DocumentWindows):
        """(inputs, labels, RoPE positions or None, document ids or None) of this rank's tokens;
        positions are (1, local_seq), or (batch, local_seq) when they restart per document."""
        tokens, documents, positions, trained = windows, None, None, None
        if isinstance(windows, DocumentWindows):
            tokens, documents = windows.tokens, windows.documents[:, :-1]  # the inputs' ids
            positions = None if windows.positions is None else windows.positions[:, :-1]
            trained = None if windows.loss_mask is None else windows.loss_mask[:, 1:]  # the labels' mask
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if trained is not None:
            labels = labels.masked_fill(~trained, IGNORE)
        if self.mtp_depth:
            from fivefold.models.mtp import future_tokens

            labels = future_tokens(tokens, self.mtp_depth)
        if self.cp == 1:
            return inputs, labels, positions, documents
        local_len = inputs.shape[1] // self.cp
        mine = local_positions(self.cp_rank, self.cp, local_len, device=tokens.device)
        positions = mine.unsqueeze(0) if positions is None else positions[:, mine]
        return inputs[:, mine], labels[:, mine], positions, None if documents is None else documents[:, mine]


class SequencePieces:
    """A cp-split sequence as MoE decisions need it (models/moe/capacity.py SequenceSplit): the
    global index of each of this rank's chunks, how many chunks make the sequence, a gather of
    per-chunk counts and a differentiable sum from every cp rank."""

    def __init__(self, group, cp_rank: int, cp: int):
        self.group, self.cp = group, cp
        self.chunks = list(chunks_of(cp_rank, cp))
        self.n_chunks = 2 * cp

    @torch.compiler.disable  # a collective inside a layer's forward: keep it out of graphs
    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(2, ...) for this rank's chunks -> (2·cp, ...) by global chunk. Counts: no autograd."""
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.cp)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        out = torch.empty((self.n_chunks, *local.shape[1:]), dtype=local.dtype, device=local.device)
        out[gathered_chunk_order(self.cp)] = torch.cat(parts)
        return out

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """Over the cp ranks; backward sums the gradient over them too: with gradients then averaged
        over dp·cp, each token's router gradient comes out as in one process."""
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t, group=self.group)


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's queries against the whole (cp-split) sequence; q, k, v are
    (batch, heads, local_seq, head_dim) in the load-balanced layout, k/v possibly with fewer heads.
    `window`: the keys a query sees at most (0: every earlier one), the replaced core's own.
    `blocks` counts the attention blocks computed and skipped (parallel/context/windows.py)."""

    def __init__(self, group, method: str, window: int = 0):
        super().__init__()
        from fivefold.parallel.context.gathered import allgather_attention, ulysses_attention
        from fivefold.parallel.context.ring import ring_attention

        methods = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
        self.group, self.method, self.window = group, method, window
        self._attend = methods[method]
        self.blocks: Counter = Counter()

    @torch.compiler.disable  # point-to-point sends and custom autograd: leave them out of graphs
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` (batch, local_seq): each local token's document id (document masking);
        `sinks` (heads,): the heads' sink logits, or None."""
        # The block math accumulates in fp32 itself; under bf16 autocast its matmuls would not.
        with torch.autocast(q.device.type, enabled=False):
            return self._attend(q, k, v, self.group, documents, self.window, sinks, self.blocks)

    @torch.compiler.disable
    def logit_max(self, q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """(heads,): each head's largest logit over what this rank's queries see: the keys of
        the whole sequence are gathered (as the all-gather method does), no autograd."""
        import torch.distributed as dist

        from fivefold.models.attention.logit_max import head_logit_max
        from fivefold.parallel.context.gathered import gather_sequence, sequence_documents

        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        keys = gather_sequence(k.detach(), self.group)
        q_positions = local_positions(rank, cp, q.shape[2], q.device)
        k_positions = torch.arange(keys.shape[2], device=q.device)
        k_documents = sequence_documents(documents, self.group) if documents is not None else None
        return head_logit_max(q, keys, q_positions, k_positions, self.window, documents, k_documents)

    def extra_repr(self) -> str:
        return f"method={self.method}" + (f", window={self.window}" if self.window else "")


def apply_context_parallel(model: nn.Module, attention_core: str, cp_mesh, method: str) -> None:
    """Swap every block's attention core for the context-parallel one over `cp_mesh`, and let MoE
    layers decide per whole sequence: the auxiliary loss adds its routing statistics over the cp
    ranks, capacity ranks each assignment among its expert's in the whole sequence."""
    from fivefold.models.moe.layer import moe_layers

    group = cp_mesh.get_group()
    pieces = SequencePieces(group, cp_mesh.get_local_rank(), cp_mesh.size())
    for block in model.layers.values():
        # A core with a sliding window says so in `window` (models/decoder.py CausalAttention).
        window = getattr(block.get_submodule(attention_core), "window", 0)
        block.set_submodule(attention_core, ContextParallelAttention(group, method, window))
    for moe in moe_layers(model):
        moe.split_sequences(over_ranks=pieces)
