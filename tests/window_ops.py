"""Sliding windows and attention sinks in each context-parallel method, against the model's own
masked attention on the whole sequence (models/attention/masked.py, itself checked against
transformers' gpt-oss in tests/test_hf_gpt_oss.py). `window_op_errors` runs inside the cp spawns of
tests/test_context_parallel.py: every rank keeps its share of the same seeded tensors, runs forward
and backward, and reports the largest error of out, dq, dk, dv and the sinks' gradient, with the
blocks the method computed and skipped."""

from __future__ import annotations

import torch
from attention_inputs import attention_inputs

METHODS = ("ring", "allgather", "ulysses")
TOL = 1e-5  # fp32
# (shape (batch, heads, kv_heads, seq, head_dim[, v_dim]), window, sinks, document starts per row)
CASES = [
    ((2, 4, 2, 32, 5), 4, False, None),   # a window shorter than a chunk at cp2 and cp4
    ((1, 4, 2, 32, 6), 8, True, None),    # sinks too; 8 = one chunk at cp2 (16) is crossed
    ((1, 4, 1, 48, 5), 13, True, [[5, 20, 21, 40]]),  # not a chunk multiple; with documents
    ((2, 4, 4, 32, 4), 0, True, [[7], []]),  # sinks without a window, documents in one row
    ((1, 8, 2, 64, 4, 6), 9, False, None),  # V's head dim other than Q's
    ((1, 4, 2, 32, 5), 64, True, None),  # a window longer than the sequence: full attention
]


def _ids(starts, batch, seq):
    if starts is None:
        return None
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    for row, bounds in enumerate(starts):
        for start in bounds:
            ids[row, start:] += 1
    return ids


def _sinks(heads, seed):
    return torch.randn(heads, generator=torch.Generator().manual_seed(100 + seed)) * 2


def reference(q, k, v, dout, window, sinks, documents):
    """(out, dq, dk, dv, dsinks or None) of the whole sequence in one process."""
    from fivefold.models.attention.masked import masked_attention

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink = None if sinks is None else sinks.clone().requires_grad_()
    out = masked_attention(*leaves, window, documents, sink)
    out.backward(dout)
    return out.detach(), *(t.grad for t in leaves), None if sink is None else sink.grad


def window_op_errors():
    """{(method, case): [errors of out, dq, dk, dv, dsinks], ...} and {(method, case): block counts}
    on this rank; a case the layout cannot split (ulysses heads, seq) is left out."""
    import torch.distributed as dist

    from fivefold.parallel.context.apply import ContextParallelAttention, local_positions

    rank, cp = dist.get_rank(), dist.get_world_size()
    errors, counts = {}, {}
    for method in METHODS:
        for index, (shape, window, with_sinks, starts) in enumerate(CASES):
            if shape[3] % (2 * cp) or (method == "ulysses" and shape[1] % cp):
                continue
            q, k, v, dout = attention_inputs(shape, seed=index)
            sinks = _sinks(shape[1], index) if with_sinks else None
            documents = _ids(starts, shape[0], shape[3])
            want = reference(q, k, v, dout, window, sinks, documents)
            mine = local_positions(rank, cp, shape[3] // cp)
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            sink = None if sinks is None else sinks.clone().requires_grad_()
            core = ContextParallelAttention(dist.group.WORLD, method, window)
            out = core(*local, None if documents is None else documents[:, mine], sink)
            out.backward(dout[:, :, mine])
            got = [out.detach(), *(t.grad for t in local)]
            errs = [(g - w[:, :, mine]).abs().max().item() for g, w in zip(got, want)]
            if sink is not None:
                # Each rank's sink gradient is its rows' share; the training step sums it over cp.
                total = sink.grad.clone()
                dist.all_reduce(total)
                errs.append((total - want[4]).abs().max().item())
            errors[(method, index)] = errs
            counts[(method, index)] = dict(core.blocks)
    return errors, counts


def assert_window_ops_exact(per_rank, method):
    checked = 0
    for rank, (errors, _) in enumerate(per_rank):
        for (case_method, index), errs in errors.items():
            if case_method == method:
                checked += 1
                for name, err in zip(("out", "dq", "dk", "dv", "dsinks"), errs):
                    assert err <= TOL, f"{method} case {index} ({CASES[index][1:]}) rank {rank}: {name} off by {err}"
    assert checked
