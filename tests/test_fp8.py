"""FP8 training (train.fp8, parallel/float8.py): what it converts, that it changes the computation,
and that tp2, dp2 (zero 1 and 3), pp2 and cp2 train like the single-process FP8 run.

Two kinds of evidence, because FP8 turns reassociation into visible noise: e5m2 keeps 2 bits of
mantissa, so a sum taken in another order (a tp partial sum rounded to bf16, ring attention's
blocks, another micro-batch split) moves some elements across a rounding boundary by up to a
quarter of their value, and the next steps carry that on. Measured on the tiny model: one step's
gradients under tp2 differ from the single process's by 3.4e-2 (relative L2; bf16 alone: 3.6e-3),
and a 6-step FP8 run moves its losses by up to 3.7e-4 and its gradient norms by up to 1.6e-2
(relative) when only its micro-batch split changes (bf16 alone: 3.7e-5 and 3.8e-4).

1. Exact, per cast: each of the six casts of a local shard (Float8ShardMatmul.cast), split along
   a layer's input, output or tokens dimension, equals the same slice of torchao's cast of the
   whole tensor bit for bit, for both recipes; and the tp layers' FP8 matmuls (column then row
   split) equal torchao's Float8Linear on the whole weights (tensorwise: 4e-7 of the largest value,
   bound 1e-5; rowwise returns bf16: 3e-3, bound one bf16 ulp). Breaking the amax reduction (every
   cast's reduction dropped in Float8ShardMatmul) moved the casts of split tensors by 11% to 28% of
   their shard's largest value against a bound of 0 (tensorwise everywhere; rowwise only where its
   rows run along the split, and only for shards further apart than FP8's range, which these
   inputs are: torchao rounds rowwise scales to powers of two, so a per-shard scale changes
   nothing else), and the tensorwise layers' output by 2.3e-2, their input gradient by 3.4e-2 and
   the column weight's gradient by 7.1e-2 against 1e-5. `test_the_cast_check_can_fail` keeps that
   break in the suite.
2. Whole runs, harness rule in FP8's units (tests/layouts.py): losses within e4m3's u/16 (3.9e-3
   relative), step 1's gradient norm within e5m2's u/16 (7.8e-3), later norms 10 times that, each
   widened to NOISE_MARGIN times the single-process FP8 run's own micro-batch-split noise where that
   is larger. The final weights are bounded by what AdamW can move them, about 2 lr per step (an
   element moves by at most about lr a step whatever its gradient, `_adamw_reach`): FP8 turns a
   flipped rounding of a near-zero gradient into a whole update, so a bound from one noise sample
   fell low on other kernels (tp2 rowwise at 0.53 of it under ATEN_CPU_CAPABILITY=default). Measured
   there: losses 2.6e-4, step-1 norms 2.2e-3, later norms 5.9e-3, weights 1.3e-2 (bound 3.6e-2).
   With the amax reduction broken, tp2 tensorwise moved by 3.3e-4 and 6.3e-3: inside the bounds. So
   the whole runs show that the layouts compose, that FP8 ran in each (the converted modules are
   counted) and catch gross errors (a gradient scaled wrongly), while check 1 is the one the scales
   fail.
"""

from __future__ import annotations

import pytest
import torch

from layouts import assert_same_run, reference, run_layout, tiny_config
from ranks import run_on_ranks

TENSORWISE = {"dtype": "bf16", "fp8": "tensorwise"}
ROWWISE = {"dtype": "bf16", "fp8": "rowwise"}
LAYOUTS = [
    {"parallel": {"tp": 2}, "train": TENSORWISE},
    {"parallel": {"tp": 2}, "train": ROWWISE},
    # dp ranks see micro-batches of 4: the reference accumulates the same ones (activation scales
    # are taken over a micro-batch).
    {"parallel": {"dp": 2, "zero": 3}, "train": {**TENSORWISE, "micro_batch": 4}},
    {"parallel": {"dp": 2, "zero": 3}, "train": {**ROWWISE, "micro_batch": 4}},
    {"parallel": {"pp": 2}, "train": {**TENSORWISE, "micro_batch": 2}},
    {"parallel": {"dp": 2, "zero": 1}, "train": {**TENSORWISE, "micro_batch": 4}},
    # cp ranks hold chunks of every sequence: activation and gradient scales are reduced over cp.
    {"parallel": {"cp": 2}, "train": TENSORWISE},
]
ZERO3_TENSORWISE, ZERO3_ROWWISE = 2, 3  # the first one's run also saves a checkpoint
ZERO3_BF16 = {"parallel": {"dp": 2, "zero": 3}, "train": {"dtype": "bf16", "micro_batch": 4}}  # bytes only
DENSE_PROJECTIONS = 7 * 2  # q, k, v, o, w1, w2, w3 in each of the 2 layers
IMBALANCE = 2.0 ** -16  # one shard this much smaller: past FP8's range relative to the other


def _casts(recipe: str, reduce: bool = True) -> dict[str, float]:
    """Per split dimension and cast: the largest difference between this rank's cast of its shard
    and the same slice of the whole tensor's cast, relative to the shard's largest value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import GemmInputRole as Role

    from fivefold.parallel.float8 import Float8ShardMatmul, float8_config

    mesh, rank, config = init_device_mesh("cpu", (2,)), torch.distributed.get_rank(), float8_config(recipe)
    sizes = {"tokens": 32, "in": 64, "out": 48}
    casts = {"input": ("cast_config_input", ("tokens", "in"), -1, Role.INPUT),
             "weight": ("cast_config_weight", ("in", "out"), 0, Role.WEIGHT),
             "grad_output": ("cast_config_grad_output", ("tokens", "out"), -1, Role.GRAD_OUTPUT),
             "weight_for_grad_input": ("cast_config_weight_for_grad_input", ("in", "out"), -1, Role.WEIGHT),
             "grad_output_for_grad_weight": ("cast_config_grad_output_for_grad_weight", ("tokens", "out"), 0,
                                             Role.GRAD_OUTPUT),
             "input_for_grad_weight": ("cast_config_input_for_grad_weight", ("tokens", "in"), 0, Role.INPUT)}
    out = {}
    for sharded in ("in", "out", "tokens"):
        local_mm, whole_mm = Float8ShardMatmul(config, {sharded: mesh}), Float8ShardMatmul(config, {})
        if not reduce:
            local_mm.reduce = dict.fromkeys(local_mm.reduce, [])
        for name, (attr, dims, axis, role) in casts.items():
            cast_config = getattr(config, attr)
            whole = torch.randn(*(sizes[d] for d in dims), generator=torch.Generator().manual_seed(1))
            if sharded not in dims:
                local, pick = whole, lambda t: t
            else:
                d = dims.index(sharded)
                whole.narrow(d, sizes[sharded] // 2, sizes[sharded] // 2).mul_(IMBALANCE)
                local, pick = whole.chunk(2, d)[rank].contiguous(), lambda t, d=d: t.chunk(2, d)[rank]
            want = pick(whole_mm.cast(whole, name, cast_config, axis, role).to_original_precision())
            got = local_mm.cast(local, name, cast_config, axis, role).to_original_precision()
            out[f"{sharded}/{name}"] = ((got - want).abs().max() / local.abs().max()).item()
    return out


def _layers(recipe: str, reduce: bool = True) -> dict[str, float]:
    """fivefold's column- then row-split layers with FP8 matmuls against torchao's Float8Linear on
    the whole weights (fp32 inputs): output, input gradient and this rank's weight gradients, each
    relative to the reference's largest value."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from fivefold.parallel.float8 import Float8ShardMatmul, float8_config, import_torchao
    from fivefold.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallelGroup

    mesh, rank, config = init_device_mesh("cpu", (2,)), torch.distributed.get_rank(), float8_config(recipe)
    group = TensorParallelGroup(mesh, sequence_parallel=False)
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    col, row = ColumnParallelLinear(whole[0], group), RowParallelLinear(whole[1], group, group.scatter_sequence)
    import_torchao().convert_to_float8_training(whole, config=config)
    col.matmul, row.matmul = Float8ShardMatmul(config, {"out": mesh}), Float8ShardMatmul(config, {"in": mesh})
    if not reduce:
        col.matmul.reduce = dict.fromkeys(col.matmul.reduce, [])
        row.matmul.reduce = dict.fromkeys(row.matmul.reduce, [])
    x = torch.randn(2, 16, 64)
    x_whole, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_whole, y_split = whole(x_whole), row(col(x_split))
    weights = torch.randn(y_whole.shape, generator=torch.Generator().manual_seed(2))
    (y_whole.float() * weights).sum().backward()
    (y_split.float() * weights).sum().backward()
    grad_x = x_split.grad.clone()
    torch.distributed.all_reduce(grad_x)  # a column-split layer's input gradient is a partial sum
    pairs = {"output": (y_split, y_whole), "grad_input": (grad_x, x_whole.grad),
             "grad_w_column": (col.weight.grad.to_local(), whole[0].weight.grad.chunk(2, 0)[rank]),
             "grad_w_row": (row.weight.grad.to_local(), whole[1].weight.grad.chunk(2, 1)[rank])}
    return {k: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for k, (a, b) in pairs.items()}


def fp8_ranks(layouts: list[dict], saves: dict[int, str]) -> dict:
    """On each rank: the layouts' runs with how many FP8 modules each held and whether FSDP
    gathered FP8 weights, then the cast and layer checks. saves: layout index -> a folder its run
    writes its last step's checkpoint to."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from fivefold.parallel.float8 import is_float8
    from fivefold.train import trainer

    seen, train = [], trainer.train

    def recording(cfg, rt=None):
        result = train(cfg, rt)
        modules = [m for part in result.parallel.parts for m in part.modules()]
        params = [p for part in result.parallel.parts for p in part.parameters()]
        seen.append((sum(map(is_float8, modules)),
                     any(isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)
                         for p in params)))
        return result

    trainer.train = recording
    try:
        runs = [run_layout({**layout, "checkpoint": {"dir": saves[i], "every": 6}} if i in saves else layout)
                for i, layout in enumerate(layouts)]
    finally:
        trainer.train = train
    return {"runs": list(zip(runs, seen)),
            "casts": {recipe: _casts(recipe) for recipe in ("tensorwise", "rowwise")},
            "broken_casts": _casts("tensorwise", reduce=False),
            "layers": {recipe: _layers(recipe) for recipe in ("tensorwise", "rowwise")}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8_checkpoints")


@pytest.fixture(scope="module")
def two_ranks(saved):
    return run_on_ranks(2, fp8_ranks, LAYOUTS + [ZERO3_BF16], {ZERO3_TENSORWISE: str(saved)})


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_fp8_layout_matches_single_process_fp8(two_ranks, index):
    layout = LAYOUTS[index]
    want = reference(layout)
    stages = layout["parallel"].get("pp", 1)
    counts = [ranks["runs"][index][1][0] for ranks in two_ranks]
    assert sum(counts) // (2 // stages) == DENSE_PROJECTIONS, f"{layout}: FP8 modules per rank {counts}"
    for rank, ranks in enumerate(two_ranks):
        assert_same_run(ranks["runs"][index][0], want, weight_atol=_adamw_reach(layout), label=f"{layout} rank {rank}")


def _adamw_reach(layout: dict) -> float:
    """How far apart two AdamW runs can end, element by element, whatever their gradients: twice the
    sum over steps of lr times the largest |m_hat / sqrt(v_hat)|, which Cauchy-Schwarz over the two
    moving averages bounds by (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2) * sum_{i<t} (b1^2 / b2)^i)
    (1 at step 1, 1.004 at step 6 for the default betas 0.9 and 0.95)."""
    train = tiny_config(layout).train
    b1, b2 = train.beta1, train.beta2
    reach = 0.0
    for t in range(1, train.steps + 1):
        geometric = sum((b1 * b1 / b2) ** i for i in range(t))
        reach += (1 - b1) / (1 - b1 ** t) * ((1 - b2 ** t) / (1 - b2) * geometric) ** 0.5
    return 2 * train.lr * reach


def test_zero3_gathers_fp8_weights(two_ranks):
    """Tensorwise under zero 3: FSDP2 all-gathers the projections' weights in FP8 (1 byte instead of
    fp32's 4; the embedding, norms and output layer stay fp32), rowwise keeps the fp32 gather."""
    runs = two_ranks[0]["runs"]
    tensorwise, rowwise, bf16 = runs[ZERO3_TENSORWISE], runs[ZERO3_ROWWISE], runs[len(LAYOUTS)]
    assert tensorwise[1][1] and not rowwise[1][1]
    assert tensorwise[0].comm["dp"] < 0.8 * bf16[0].comm["dp"], (tensorwise[0].comm, bf16[0].comm)
    assert rowwise[0].comm["dp"] == bf16[0].comm["dp"]


def test_zero3_fp8_checkpoint_holds_plain_tensors(two_ranks, saved):
    """torchao wraps FSDP2's weight shards (and AdamW's moments made like them) for its FP8
    all-gather; the checkpoint stores what is inside, so it loads where torchao is not imported
    (a torchao class in the files fails torch.load's weights_only there)."""
    files = [f for f in (saved / "step_00000006").iterdir() if f.is_file()]
    assert any(f.suffix == ".distcp" for f in files), files
    assert not [f.name for f in files if b"torchao" in f.read_bytes()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_shard_casts_equal_whole_tensor_casts(two_ranks, recipe):
    for rank, ranks in enumerate(two_ranks):
        moved = {k: v for k, v in ranks["casts"][recipe].items() if v != 0.0}
        assert not moved, f"rank {rank}: casts of a shard differ from the whole tensor's: {moved}"


def test_the_cast_check_can_fail(two_ranks):
    """Without the amax reduction, rank 1's shard (the small one) is cast on a scale of its own."""
    broken = two_ranks[1]["broken_casts"]
    for cast in ("in/input", "in/weight", "out/weight", "out/grad_output"):
        assert broken[cast] > 0.05, (cast, broken)


@pytest.mark.parametrize("recipe, bound", [("tensorwise", 1e-5), ("rowwise", 2.0 ** -8)])
def test_tp_layers_equal_float8_linear(two_ranks, recipe, bound):
    for rank, ranks in enumerate(two_ranks):
        got = ranks["layers"][recipe]
        assert all(v <= bound for v in got.values()), f"rank {rank}: {got} (bound {bound:.1e})"


def _one_step(train: dict, moe: bool = False):
    """Logits and gradients of one forward/backward of the tiny model's initial weights on one
    batch, built as the trainer builds it (meta device, FP8 conversion, materialise)."""
    from fivefold.models import build_meta_model, initial_values
    from fivefold.models.registry import model_spec
    from fivefold.parallel.float8 import apply_float8
    from fivefold.parallel.materialize import materialize
    from fivefold.train.trainer import autocast

    cfg = tiny_config({"train": train, **({"model": {"moe": {"n_experts": 4, "top_k": 2}}} if moe else {})})
    model = build_meta_model(cfg.model)
    if cfg.train.fp8:
        apply_float8(model, model_spec(cfg.model), cfg.model, cfg.train.fp8)
    materialize([model], torch.device("cpu"), initial_values(cfg.model, cfg.train.seed))
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    with autocast(cfg, torch.device("cpu")):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return model, logits.float().detach(), grads


def test_fp8_changes_the_computation_beyond_rounding():
    """bf16 rounds 8 bits of mantissa, FP8 3 (e4m3) and 2 (e5m2): against fp32, an FP8 forward and
    backward differs several times more than bf16 does (measured: logits 2.7e-2 vs 2.9e-3, gradients
    6.0e-2 vs 5.8e-3, relative L2), and still follows it."""
    _, logits32, grads32 = _one_step({"dtype": "fp32"})
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    _, logits16, grads16 = _one_step({"dtype": "bf16"})
    for recipe in ("tensorwise", "rowwise"):
        _, logits8, grads8 = _one_step({"dtype": "bf16", "fp8": recipe})
        assert rel(logits8, logits32) > 3 * rel(logits16, logits32), recipe
        assert rel(grads8, grads32) > 3 * rel(grads16, grads32), recipe
        assert rel(logits8, logits32) < 0.1 and rel(grads8, grads32) < 0.3, recipe


def test_fp8_training_stays_close_to_bf16():
    bf16 = run_layout({"train": {"dtype": "bf16"}})
    for recipe in ("tensorwise", "rowwise"):
        fp8 = run_layout({"train": {"dtype": "bf16", "fp8": recipe}})
        assert fp8.losses != bf16.losses, recipe
        for step, (a, b) in enumerate(zip(fp8.losses, bf16.losses), 1):
            assert abs(a - b) <= 0.01 * b, f"{recipe} step {step}: {a} vs bf16 {b}"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_converted_modules_are_the_dense_projections(moe):
    """The spec's dense projections, and nothing else: embedding, output layer, router, routed and
    shared experts stay in high precision."""
    from fivefold.parallel.float8 import is_float8

    model, _, _ = _one_step({"dtype": "bf16", "fp8": "tensorwise"}, moe=moe)
    converted = sorted(name for name, m in model.named_modules() if is_float8(m))
    paths = [f"attention.{w}" for w in ("wq", "wk", "wv", "wo")]
    paths += [] if moe else [f"feed_forward.{w}" for w in ("w1", "w2", "w3")]  # an MoE layer's MLP stays
    assert converted == sorted(f"layers.{i}.{path}" for i in range(2) for path in paths)
    assert not any(is_float8(m) for name, m in model.named_modules()
                   if name in ("tok_embeddings", "output") or ".router" in name or ".experts" in name)


def test_start_up_line_says_what_stays_in_bf16():
    from fivefold.configure import load_config
    from fivefold.models.registry import model_spec
    from fivefold.parallel.float8 import describe, float8_config

    # as the command line gives it (a str subclass, which torchao's recipe lookup would refuse)
    cfg = load_config(None, ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
                             "--model.moe.n_experts", "4", "--train.dtype", "bf16", "--train.fp8", "rowwise"])
    assert float8_config(cfg.train.fp8).round_scales_to_power_of_2  # the rowwise recipe
    line = describe(cfg, model_spec(cfg.model), all_gather=False)
    assert line.startswith("fp8: rowwise scaling (torchao 0.")
    assert "8 dense projections in FP8" in line and "MoE layers" in line and "no FP8 grouped-matmul kernel" in line


def test_planner_credits_fp8_only_to_fp8_runs(capsys):
    """The profile's FP8 speed-up (plan/hardware.py) applies to train.fp8 runs, to their dense
    projections: a bf16 run predicts as with no speed-up at all, an MoE run gains less than a dense
    one (its experts stay bf16)."""
    import dataclasses
    import json

    from fivefold.configure import load_config
    from fivefold.plan.cli import run_plan
    from fivefold.plan.estimate import estimate
    from fivefold.plan.hardware import hardware_for
    from fivefold.plan.speed.frameworks import FIVEFOLD_EAGER
    from fivefold.plan.layout import Layout
    from fivefold.plan.workload import workload_from_config

    def predict(preset, fp8="", runtime=FIVEFOLD_EAGER):
        cfg = load_config(None, ["--model.preset", preset, *SHAPE, "--train.fp8", fp8])
        layout = Layout(dp=8, zero=3, tp=1, mbs=1, recompute="selective")
        return estimate(workload_from_config(cfg), layout, hardware_for("h100"), runtime)

    SHAPE = ["--train.dtype", "bf16", "--train.seq_len", "4096", "--train.global_batch", "256"]
    assert FIVEFOLD_EAGER.float8_linear_speedup > 1
    bf16 = predict("llama3-8b")
    unsped = predict("llama3-8b", runtime=dataclasses.replace(FIVEFOLD_EAGER, float8_linear_speedup=1.0))
    assert bf16.tokens_per_sec_per_gpu == unsped.tokens_per_sec_per_gpu
    # compute time: the dense model's falls by nearly the whole speed-up, the MoE model's by less
    dense = bf16.time_parts["compute"] / predict("llama3-8b", "tensorwise").time_parts["compute"]
    moe = predict("mixtral-8x7b").time_parts["compute"] / predict("mixtral-8x7b", "tensorwise").time_parts["compute"]
    assert 1.05 < dense < FIVEFOLD_EAGER.float8_linear_speedup and 1.0 < moe < dense, (dense, moe)
    # the CLI a user types
    argv = ["--model.preset", "llama3-8b", *SHAPE, "--layout", "dp=8,zero=3,mbs=1", "--json"]
    runs = []
    for extra in ([], ["--train.fp8", "tensorwise"]):
        assert run_plan(argv + extra) == 0
        runs.append(json.loads(capsys.readouterr().out)["candidates"][0]["tokens_per_sec_per_gpu"])
    assert runs[1] > 1.05 * runs[0]


def test_cuda_refusals_are_one_sentence(monkeypatch):
    """On CUDA (simulated here): a GPU without FP8 matmuls, and sizes torch._scaled_mm's CUDA kernel
    does not take (multiples of 16), are refused before any process group exists."""
    from fivefold.config import ConfigError
    from fivefold.configure import load_config
    from fivefold.configure.machine import check_float8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    base = ["--train.dtype", "bf16", "--train.fp8", "tensorwise", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
    cases = [((8, 0), [], "needs FP8 matrix multiplies (CUDA compute capability 8.9 or newer"),
             ((9, 0), ["--model.dim", "40"], "layers.0.attention.wq multiplies 40 -> 40 at parallel.tp=1"),
             ((9, 0), ["--train.seq_len", "20", "--train.global_batch", "1"], "tokens per rank"),
             ((9, 0), [], None)]
    for capability, extra, fragment in cases:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        cfg = load_config(None, [*base, *extra])
        if fragment is None:
            check_float8(cfg)
            continue
        with pytest.raises(ConfigError, match="^train.fp8") as refused:
            check_float8(cfg)
        assert fragment in str(refused.value) and "\n" not in str(refused.value)
