"""Shared pieces of the layout-equivalence tests: one tiny config, a single-process reference,
and the comparison every parallel layout must pass (docs/design.md principle 1)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from fivefold.configure import load_config

# fp32, 6 steps, a model small enough for many layouts per minute on 2 cores.
BASE = {
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128},
    # adam_eps and muon_ns_dtype: the forms of the optimizers that do not amplify rounding (the
    # tolerance rule below says why); the defaults' own paths are checked apart.
    "train": {"steps": 6, "seq_len": 32, "global_batch": 8, "lr": 3e-3, "warmup": 2, "seed": 3,
              "adam_eps": 1e-6, "muon_ns_dtype": "fp32"},
    "data": {"builtin_max_bytes": 200_000},
    "log": {"progress": False},
}

# The tolerance rule. Layouts reassociate floating-point sums (gradients reduced in another order,
# matmuls split over ranks, softmaxes merged blockwise), and CPUs round differently: which kernels
# run (ATEN_CPU_CAPABILITY, MKL's code path) changes which roundings flip. A bound therefore comes
# from the arithmetic, with a margin checked on every ISA torch dispatches to
# (tests/scripts/isa_margins.py, docs/testing.md), never from one machine's last digit.
# - The optimizers run in the forms that do not amplify rounding (BASE): AdamW's update
#   g/(|g| + eps) moves by up to lr/eps per unit of gradient rounding where a gradient is near
#   zero: 3e5 at eps 1e-8 (a byte seen once ended 1.2e-4 apart on an AVX2 CPU), 3e3 at 1e-6.
#   Muon's bf16 Newton–Schulz turns a 1e-8 difference into a flipped bf16 rounding (1e-3 after one
#   step, on some CPUs); fp32 Newton–Schulz does not. The defaults' paths are checked apart
#   (tests/test_muon.py: torch's bf16 Newton–Schulz and eps 1e-8 against torch.optim).
# - Losses and step 1's gradient norm: within LOSS_RTOL relative. At step 1 every layout starts
#   from the same weights, so only the gradient's reassociation separates them: ~2e-7 measured
#   (n·u for fp32's u = 6e-8 over the few-hundred-term sums of the tiny model, as a random walk),
#   50x under 1e-5, which still catches a wrongly scaled gradient or a lost piece of one.
# - Later gradient norms: within LATER_NORM_GAIN times step 1's rule (1e-4 in fp32). They see the
#   previous steps' weight differences (allowed up to the weight bounds below) through the loss's
#   curvature, which is large where the tiny runs spike (tiny gelu at step 5: tp2 moves the norm by
#   1.7e-5 with weights 1.2e-6 apart, where step 1 moves it by 2e-7).
# - Final weights: within WEIGHT_ATOL, TP_WEIGHT_ATOL or CP_WEIGHT_ATOL (weight_atol()). A real
#   bug moves weights by an update's size: a last update skipped on one rank (invisible to losses
#   and norms) moves them by 5e-4 to 7e-4 and fails all 8 layouts of the 8-rank matrix.
# - bf16 runs (bf16 compute, fp32 masters and reductions) are compared with the bf16 single process
#   at BF16_RTOL: a layout flips roundings of bf16 activations (u = 2^-8 relative each), and the
#   loss averages them over the batch's tokens: u/16 holds them with room (measured 4.7e-5 in 5D).
#   tests/test_bf16.py also checks each run is within 2% of fp32 and really differs from it. Their
#   later norms take the same gain over step 1 as fp32's (2.4e-3: the bf16 MoE 5D run moved its
#   step-3 norm by 6.2e-4 under ATEN_CPU_CAPABILITY=default, tests/test_composition.py).
# - FP8 runs (train.fp8) take the same rule in FP8's units: the forward casts to e4m3 (u = 2^-4), so
#   losses within u/16 (FP8_LOSS_RTOL); gradients to e5m2 (u = 2^-3), so step 1's norm within its
#   u/16 (FP8_NORM_RTOL) and later norms LATER_NORM_GAIN times that. Measured under `default`: losses
#   2.6e-4, step-1 norms 2.2e-3, later norms 5.9e-3 (tests/test_fp8.py says what else checks FP8).
# - Where a trajectory is itself sensitive, the single process measures it: `reference()` runs each
#   setting twice, accumulating in two different orders, and every bound is at least NOISE_MARGIN
#   times that difference (tiny-qwen3 at seed 3, step 4: 6.3e-5 on the gradient norm from the
#   micro-batch split alone, the q/k norms' gradients nearly cancelling). The measurement only
#   widens a bound; none rests on it being small.
LOSS_RTOL = 1e-5
LATER_NORM_GAIN = 10
WEIGHT_ATOL = 1e-5
BF16_RTOL = 2.0 ** -8 / 16
FP8_LOSS_RTOL = 2.0 ** -4 / 16
FP8_NORM_RTOL = 2.0 ** -3 / 16
# - With tp, row-parallel sums reassociate inside each step too, which the micro-batch split does not
#   show: AdamW turns it into up to ~6e-5 on the few weights whose gradients nearly cancel (8 layers,
#   tests/test_pipeline.py, at eps 1e-8).
TP_WEIGHT_ATOL = 1e-4
# - With cp, ring attention merges blockwise softmaxes inside each step, which the micro-batch split
#   does not show either; at eps 1e-8 one embedding element of tiny-qwen3 at seed 5 whose gradient
#   was 2.2e-9 ended 1.8e-4 apart (losses within 1e-7, gradient norms 2e-6).
CP_WEIGHT_ATOL = 3e-4


def weight_atol(parallel: dict) -> float:
    """The weight bound for a layout's parallel settings: tp's, else cp's, else the plain one."""
    return (TP_WEIGHT_ATOL if parallel.get("tp", 1) > 1 else
            CP_WEIGHT_ATOL if parallel.get("cp", 1) > 1 else WEIGHT_ATOL)


# One dimension at a time on 2 ranks: what a model or family is checked under against one process
# (tests/test_families.py, tests/test_mlp_activation.py).
ONE_DIMENSION = {
    "dp2 z0": {"dp": 2, "zero": 0},
    "dp2 z1": {"dp": 2, "zero": 1},
    "dp2 z3": {"dp": 2, "zero": 3},
    "tp2 sp": {"tp": 2, "sp": True},
    "tp2 no-sp": {"tp": 2, "sp": False},
    "pp2 1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "pp2 zbv": {"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2},
    "cp2 ring": {"cp": 2, "cp_method": "ring"},
    "cp2 allgather": {"cp": 2, "cp_method": "allgather"},
    "cp2 ulysses": {"cp": 2, "cp_method": "ulysses"},
}
NOISE_MARGIN = 4.0


def _merge(base: dict, top: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in top.items():
        out.setdefault(section, {}).update(values)
    return out


def write_short_documents(path, n_documents: int = 3000, seed: int = 0) -> str:
    """A .jsonl corpus of short documents (1 to 60 characters, no newline inside), so that most
    windows of the tiny config cross document boundaries: what document masking tests train on.
    Each document ends with the newline tokenizing appends (data/batches.py)."""
    import json
    import random

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     .,"
    with open(path, "w") as out:
        for _ in range(n_documents):
            text = "".join(rng.choice(letters) for _ in range(rng.randint(1, 60)))
            out.write(json.dumps({"text": text}) + "\n")
    return str(path)


def with_documents(settings: dict, source: str, **data) -> dict:
    """`settings` trained with document masking on `source` (extra data keys in `data`)."""
    return _merge(settings, {"data": {"source": source, "document_mask": True, **data}})


def tiny_config(overrides: dict | None = None):
    return load_config(None, _merge(BASE, overrides or {}))


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]  # AdamW hides a wrongly scaled gradient from the losses; the norm does not
    weights: dict[str, torch.Tensor]  # whole tensors, gathered
    comm: dict[str, int]  # the ledger of the last step
    state_bytes: dict[str, int]  # this rank's parameter / gradient / optimizer bytes
    local_wq: torch.Tensor | None  # this rank's piece of the first wq weight it holds
    # Persistent buffers, whole (MoE bias balancing's `expert_bias`): state the optimizer does not
    # own, moved by the step's routing, so a wrong load count changes them and not the weights.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # A tied matrix's second copy where a pipeline holds it apart (the last stage's output weight):
    # copy name -> (source name, whole tensor). The single process holds it once, so both must stay equal.
    tied_copies: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    eval_losses: list[float] = field(default_factory=list)  # the held-out loss of each evaluation
    mtp_losses: list[float] = field(default_factory=list)  # multi-token prediction's loss of each step
    qk_clipped: list[int] = field(default_factory=list)  # train.qk_clip: heads clipped at each step
    nan_shape_inputs: int = 0  # pipeline shape inference's inputs this rank made NaN (nan_shape_inference)
    compile_s: float = 0.0  # seconds torch.compile spent (train.compile): 0 when nothing compiled
    dtype: str = "fp32"  # train.dtype: bf16 runs are compared at bf16's floor (BF16_RTOL)
    fp8: str = ""  # train.fp8: FP8 runs at FP8's floors (FP8_LOSS_RTOL, FP8_NORM_RTOL)
    # Reference runs only: the largest weight difference between this run and the same settings
    # accumulated in another micro-batch split (the reassociation noise of the tolerance rule).
    weight_noise: float = 0.0
    loss_noise: float = 0.0  # ... and the largest relative change of a step's loss
    norm_noise: float = 0.0  # ... and of a step's gradient norm


@contextlib.contextmanager
def groups_released():
    """The process groups made inside (a layout's mesh) are destroyed on the way out.

    A group keeps two gloo worker threads and a TCP loop thread in every member rank until it is
    destroyed and freed: a 16-rank spawn training ten 5D layouts held ~535 threads per rank, on 2
    cores, and its time grew faster than its layouts."""
    import gc

    import torch.distributed as dist

    from fivefold import torch_internals

    if not dist.is_initialized():
        yield
        return
    before = set(torch_internals.process_groups())
    try:
        yield
    finally:
        torch_internals.forget_dtensor_shardings()  # its cached specs name the groups destroyed below
        made = [group for group in torch_internals.process_groups() if group not in before]
        if made:
            # Every rank done with the groups before any closes their sockets: a socket closed while
            # a peer's gloo thread still reads or writes on it fails that thread, and gloo aborts
            # the process from there (SIGABRT, no traceback).
            dist.barrier()
        for group in made:
            dist.destroy_process_group(group)
        # The layout's model, optimizer and meshes are cycles, which hold its groups until the
        # collector frees them: now, so that no rank carries finished layouts' threads into the next.
        gc.collect()
        # What survives (modules imported, caches) lives as long as the rank: later collections,
        # automatic ones during the next layouts included, need not walk it again. Measured on
        # five 4-rank layouts: 20% less CPU per rank (benchmarks/RESULTS.md, "gc.freeze in the ranks").
        gc.freeze()


def run_layout(overrides: dict) -> Run:
    """Train the tiny config under the current process group (or alone)."""
    with groups_released(), nan_shape_inference() as made:
        run = _run_layout(overrides)
    run.nan_shape_inputs = len(made)
    return run


@contextlib.contextmanager
def nan_shape_inference():
    """torch's pipelining infers a later stage's shapes with a real forward (and an input-gradient
    backward) on inputs it makes from metadata with torch.empty: uninitialised memory, which may
    hold anything. Here they hold NaN, the worst case, so that every pipeline layout of the suite
    shows that nothing a step keeps (QK-clip's maxima, router statistics, MTP losses, the loss)
    counts that forward. Yields the list of inputs made so (a test can check the patch acted)."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    from fivefold.parallel.pipeline.observed_stage import ObservedStage

    made = []

    def nan_filled(stage, arg):
        tensor = PipelineStage._to_tensor(stage, arg)
        if not isinstance(arg, torch.Tensor):  # made from metadata, not a micro-batch's tensor
            with torch.no_grad():
                tensor.fill_(float("nan"))
            made.append(tuple(tensor.shape))
        return tensor

    ObservedStage._to_tensor = nan_filled
    try:
        yield made
    finally:
        del ObservedStage._to_tensor


def _run_layout(overrides: dict) -> Run:
    from torch.distributed.tensor import DTensor

    from fivefold.train.trainer import train

    cfg = tiny_config(overrides)
    result = train(cfg)
    first_block = next(iter(result.parallel.parts[0].layers.values()))
    # The decoder families' query projection (MLA's has other names: None there).
    wq = dict(first_block.named_parameters()).get("attention.wq.weight")
    local_wq = None if wq is None else (wq.to_local() if isinstance(wq, DTensor) else wq).detach().clone()
    return Run(losses=result.losses, grad_norms=[r["grad_norm"] for r in result.records],
               weights=result.parallel.full_state_dict(), comm=result.records[-1]["comm_bytes"],
               state_bytes=result.state_bytes, local_wq=local_wq, buffers=_whole_buffers(result.parallel),
               tied_copies=_tied_copies(result.parallel),
               eval_losses=[r["val_loss"] for r in result.records if "val_loss" in r],
               mtp_losses=[r["mtp_loss"] for r in result.records if "mtp_loss" in r],
               qk_clipped=[r["qk_clipped_heads"] for r in result.records if "qk_clipped_heads" in r],
               compile_s=sum(r.get("compile_s", 0.0) for r in result.records), dtype=cfg.train.dtype,
               fp8=cfg.train.fp8 or "")


def _over_stages(par, mine: dict) -> dict:
    """The union of every pipeline stage's `mine` (a collective over pp; `mine` itself without one)."""
    import torch.distributed as dist

    if par.pipeline is None:
        return mine
    stages = [None] * par.dims.pp
    dist.all_gather_object(stages, mine, group=par.mesh["pp"].get_group())
    return {name: value for stage in stages for name, value in stage.items()}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # a collective over tp
    return whole.detach().cpu().clone()


def _whole_buffers(par) -> dict[str, torch.Tensor]:
    from fivefold.parallel.pieces import persistent_buffers

    return _over_stages(par, {name: _whole(buf) for name, buf in persistent_buffers(par).items()})


def _tied_copies(par) -> dict[str, tuple[str, torch.Tensor]]:
    """What `full_state_dict` drops: the copies of tied matrices the pipeline's last stage holds."""
    if par.pipeline is None:
        return {}
    mine = {}
    for part in par.parts:
        params = dict(part.named_parameters())
        for copy_name, source in par.pipeline.tied_pairs.items():
            if copy_name in params:
                mine[copy_name] = (source, _whole(params[copy_name]))
    return _over_stages(par, mine)


def run_layouts(layouts: list[dict]) -> list:
    """Several layouts one after another inside one group of ranks (start-up costs dominate)."""
    return [run_layout(layout) for layout in layouts]


def reassociated(settings: dict) -> dict:
    """The same settings with the global batch accumulated in a different number of micro-batches:
    the same math, sums taken in another order."""
    train = dict(settings.get("train", {}))
    global_batch = train.get("global_batch", BASE["train"]["global_batch"])
    micro = train.get("micro_batch", 0) or global_batch
    train["micro_batch"] = global_batch // 2 if micro == global_batch else global_batch
    return {**settings, "train": train}


@functools.lru_cache(maxsize=None)
def _reference(key: str):
    import json

    settings = json.loads(key)
    run, other = run_layout(settings), run_layout(reassociated(settings))
    run.weight_noise = max((run.weights[n] - other.weights[n]).abs().max().item() for n in run.weights)
    run.loss_noise = max(abs(a - b) / abs(a) for a, b in zip(run.losses, other.losses))
    run.norm_noise = max(abs(a - b) / abs(a) for a, b in zip(run.grad_norms, other.grad_norms))
    return run


def reference(model_and_train: dict | None = None):
    """The single-process run of the same model/train settings (cached per settings)."""
    import json

    kept = {s: v for s, v in (model_and_train or {}).items() if s != "parallel"}
    return _reference(json.dumps(kept, sort_keys=True))


def continued(reference_run, steps_done: int):
    """The uninterrupted run from step `steps_done` + 1 on (the tolerance rule's noise kept): what a
    run resumed from that step's checkpoint must equal."""
    return dataclasses.replace(reference_run, losses=reference_run.losses[steps_done:],
                               grad_norms=reference_run.grad_norms[steps_done:])


def assert_resumed_bit_for_bit(full, resumed, steps_done: int, label: str = "") -> None:
    """A run resumed in its own layout: the resumed steps and final weights equal the uninterrupted
    run's exactly (every piece of state came back)."""
    assert resumed.losses == full.losses[steps_done:], f"{label}: losses"
    assert resumed.grad_norms == full.grad_norms[steps_done:], f"{label}: grad norms"
    for name, tensor in full.weights.items():
        assert torch.equal(resumed.weights[name], tensor), f"{label}: {name}"


def rounding_floors(run) -> tuple[float, float]:
    """The loss and step-1 gradient-norm bounds (relative) that the run's number format sets."""
    if run.fp8:
        return FP8_LOSS_RTOL, FP8_NORM_RTOL
    return (BF16_RTOL, BF16_RTOL) if run.dtype == "bf16" else (LOSS_RTOL, LOSS_RTOL)


def assert_same_run(got, want, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL, label=""):
    loss_floor, norm_floor = rounding_floors(want)
    loss_rtol = max(loss_rtol, loss_floor)
    weight_atol = max(weight_atol, NOISE_MARGIN * want.weight_noise)
    norm_rtol = max(loss_rtol, norm_floor, NOISE_MARGIN * want.norm_noise)
    later_norm_rtol = max(norm_rtol, LATER_NORM_GAIN * norm_floor)
    loss_rtol = max(loss_rtol, NOISE_MARGIN * want.loss_noise)
    margins = _Margins(label)
    try:
        _assert_same_run(got, want, loss_rtol, (norm_rtol, later_norm_rtol), weight_atol, label, margins)
    finally:
        margins.write()


class _Margins:
    """The largest ratio of difference to bound of each kind in one comparison, appended as a JSON
    line to $FIVEFOLD_TOLERANCE_LOG when it is set (tests/scripts/isa_margins.py reads them): how
    close each bound came to failing, on the machine and kernels that ran it."""

    def __init__(self, label: str):
        self.label, self.worst = label, {"loss": 0.0, "grad_norm": 0.0, "weight": 0.0}

    def seen(self, kind: str, diff: float, bound: float) -> None:
        self.worst[kind] = max(self.worst[kind], diff / bound if bound else float("inf") if diff else 0.0)

    def write(self) -> None:
        import json
        import os

        path = os.environ.get("FIVEFOLD_TOLERANCE_LOG")
        if path:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
            with open(path, "a") as f:
                f.write(json.dumps({"test": test, "label": self.label, **self.worst}) + "\n")


def _assert_same_run(got, want, loss_rtol, norm_rtols, weight_atol, label, margins):
    losses, norms, weights = got.losses, got.grad_norms, got.weights
    ref_losses, ref_norms, ref_weights = want.losses, want.grad_norms, want.weights
    assert len(losses) == len(ref_losses), label
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        margins.seen("loss", abs(a - b), loss_rtol * abs(b))
        assert abs(a - b) <= loss_rtol * abs(b), f"{label}: step {step} loss {a} != {b} (bound {loss_rtol:.1e} relative)"
    for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
        rtol = norm_rtols[0] if step == 1 else norm_rtols[1]
        margins.seen("grad_norm", abs(a - b), rtol * abs(b))
        assert abs(a - b) <= rtol * abs(b), f"{label}: step {step} grad norm {a} != {b} (bound {rtol:.1e} relative)"
    assert len(got.eval_losses) == len(want.eval_losses), f"{label}: {len(got.eval_losses)} evaluations, want {len(want.eval_losses)}"
    for i, (a, b) in enumerate(zip(got.eval_losses, want.eval_losses), 1):
        margins.seen("loss", abs(a - b), loss_rtol * abs(b))
        assert abs(a - b) <= loss_rtol * abs(b), f"{label}: evaluation {i} loss {a} != {b} (bound {loss_rtol:.1e} relative)"
    assert len(got.mtp_losses) == len(want.mtp_losses), f"{label}: {len(got.mtp_losses)} MTP losses, want {len(want.mtp_losses)}"
    for step, (a, b) in enumerate(zip(got.mtp_losses, want.mtp_losses), 1):
        margins.seen("loss", abs(a - b), loss_rtol * abs(b))
        assert abs(a - b) <= loss_rtol * abs(b), f"{label}: step {step} MTP loss {a} != {b} (bound {loss_rtol:.1e} relative)"
    assert weights.keys() == ref_weights.keys(), f"{label}: parameter names differ"
    assert got.buffers.keys() == want.buffers.keys(), f"{label}: buffer names differ"
    # Buffers (the MoE balancing bias) follow the weights' rule; a tied matrix's pipeline copy must
    # match the single process's one matrix just as its source does.
    compared = [*weights.items(), *got.buffers.items(),
                *((f"{copy} (tied copy of {source})", tensor) for copy, (source, tensor) in got.tied_copies.items())]
    ref_of = {**ref_weights, **want.buffers,
              **{f"{copy} (tied copy of {source})": ref_weights[source] for copy, (source, _) in got.tied_copies.items()}}
    for name, tensor in compared:
        ref = ref_of[name]
        # (a - b) broadcasts: a wrong shape could otherwise pass as a small difference
        assert tensor.shape == ref.shape, f"{label}: {name} has shape {list(tensor.shape)}, want {list(ref.shape)}"
        diff = (tensor - ref).abs().max().item() if tensor.numel() else 0.0
        margins.seen("weight", diff, weight_atol)
        assert diff <= weight_atol, (f"{label}: {name} differs by {diff} (bound {weight_atol:.2e}: "
                                     f"{NOISE_MARGIN} x measured reassociation noise {want.weight_noise:.2e})")
