"""No silent fallbacks (issue 19, item 3): zero 2 really shards gradients under a pipeline, options
that do nothing for the layout are reported, V schedules get their two stages per rank, and no
non-contiguous parameter reaches a fused optimizer."""

import pytest
import torch

from layouts import assert_same_run, reference, run_layout, tiny_config
from ranks import run_on_ranks

EIGHT_LAYERS = {"n_layers": 8}


def pp_dp(zero: int, schedule: str = "1f1b", virtual: int = 1, **model) -> dict:
    return {"model": {**EIGHT_LAYERS, **model}, "train": {"micro_batch": 1},
            "parallel": {"pp": 2, "dp": 2, "zero": zero, "pp_schedule": schedule, "pp_virtual": virtual}}


ZERO_PP = [
    pp_dp(1),
    pp_dp(2),
    pp_dp(2, "zbv", 2),  # split backward; both tied copies on one rank (the V's ends)
    pp_dp(2, "interleaved_1f1b", 2, tie_embeddings=False),  # two stages per rank, untied
]


def _held_bytes(dp) -> int:
    """Gradient bytes this rank holds now: whole gradients on parameters, buckets, chunks."""
    from fivefold.parallel.grad_norm import local_tensor

    tensors = [p.grad for p in dp.params if p.grad is not None] + dp.gradient_buffers()
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def _run_measuring_grads(layouts):
    """Each layout's run, and the most gradient bytes held after any backward action of a step
    (after the actions' own reduction), with the bytes of this rank's whole parameters."""
    import fivefold.parallel.parallelize as parallelize_module
    from fivefold.parallel.pipeline.stages import Pipeline

    built, build = {}, parallelize_module.build_data_parallel
    original_schedule = Pipeline.build_schedule

    def capture(*args, **kwargs):
        built["dp"] = build(*args, **kwargs)
        built["peak"] = 0
        return built["dp"]

    def build_schedule(self, *args, **kwargs):
        original_schedule(self, *args, **kwargs)
        for stage in self.stages:  # outermost wrappers: measured after any reduction they trigger
            for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                def measured(*a, _method=getattr(stage, name), **k):
                    _method(*a, **k)
                    built["peak"] = max(built["peak"], _held_bytes(built["dp"]))
                setattr(stage, name, measured)

    parallelize_module.build_data_parallel, Pipeline.build_schedule = capture, build_schedule
    try:
        out = []
        for layout in layouts:
            run = run_layout(layout)
            dp = built["dp"]
            whole = sum(p.numel() * p.element_size() for p in dp.params)
            out.append((run, built["peak"], whole))
        return out
    finally:
        parallelize_module.build_data_parallel, Pipeline.build_schedule = build, original_schedule


@pytest.fixture(scope="module")
def zero_pp_results():
    return run_on_ranks(4, _run_measuring_grads, ZERO_PP)


@pytest.mark.parametrize("index", range(len(ZERO_PP)), ids=[str(l["parallel"]) for l in ZERO_PP])
def test_zero_under_pipeline_equals_one_process(zero_pp_results, index):
    want = reference(ZERO_PP[index])
    for rank, results in enumerate(zero_pp_results):
        assert_same_run(results[index][0], want, label=f"{ZERO_PP[index]['parallel']} rank {rank}")


def test_zero2_under_pipeline_holds_a_gradient_shard(zero_pp_results):
    for rank, results in enumerate(zero_pp_results):
        (_, zero1_peak, whole), *zero2 = results
        # zero 1 accumulates whole gradients over the schedule; zero 2 keeps only its 1/dp chunk
        # between backward actions (a little more for padding to a multiple of dp).
        assert zero1_peak >= whole, (rank, zero1_peak, whole)
        for run, peak, whole2 in zero2:
            assert peak <= 1.05 * whole2 / 2, (rank, peak, whole2)
            assert run.state_bytes["grads"] <= 1.05 * whole2 / 2, (rank, run.state_bytes)


# ------------------------------------------------------------------- options the layout ignores

def test_ignored_options_are_reported_once_before_training(capsys):
    from fivefold.train.trainer import train

    cfg = tiny_config({"parallel": {"zero": 1, "pp_schedule": "zbv", "cp_method": "allgather", "sp": False},
                       "train": {"steps": 1}, "log": {"progress": True, "every": 1}})
    train(cfg)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "ignored" in line]
    assert lines == ["ignored for this layout: parallel.zero=1 (dp*cp=1: nothing to shard), parallel.sp=False "
                     "(tp=1), parallel.pp_schedule='zbv' (pp=1), parallel.cp_method='allgather' (cp=1)"], out
    assert out.index(lines[0]) < out.index("step     1/1")  # before training


def test_defaults_and_used_options_are_not_reported():
    from fivefold.config.validate import ignored_note

    assert ignored_note(tiny_config()) is None
    used = tiny_config({"parallel": {"dp": 2, "zero": 1, "cp": 2, "cp_method": "allgather", "pp": 2,
                                     "pp_schedule": "zbv", "tp": 2, "sp": False}})
    assert ignored_note(used) is None


def test_planner_lists_no_twins():
    from fivefold.configure import load_config
    from fivefold.plan.hardware import Runtime, hardware_for
    from fivefold.plan.search import search, without_ignored
    from fivefold.plan.workload import workload_from_config

    cfg = load_config("configs/tiny.toml")
    for gpus in (1, 2, 4):
        result = search(cfg, workload_from_config(cfg), hardware_for("h100"), Runtime(), gpus)
        seen = {}
        for est in result.ranked:
            key = without_ignored(est.layout)
            assert key not in seen, f"{est.layout.short()} is a twin of {seen[key]}"
            seen[key] = est.layout.short()
        assert result.ranked


# ---------------------------------------------------------------------- V schedules' stages

@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_set_two_stages_per_rank(schedule):
    from fivefold.config import ConfigError
    from fivefold.configure import validate

    cfg = tiny_config({"model": EIGHT_LAYERS, "train": {"micro_batch": 1},
                       "parallel": {"pp": 2, "pp_schedule": schedule}})
    assert validate(cfg).parallel.pp_virtual == 2
    with pytest.raises(ConfigError, match=f"parallel.pp_schedule='{schedule}' runs two stages per rank in "
                       "a V, so parallel.pp_virtual must be 2, got 3"):
        validate(tiny_config({"model": EIGHT_LAYERS, "train": {"micro_batch": 1},
                              "parallel": {"pp": 2, "pp_schedule": schedule, "pp_virtual": 3}}))


# ------------------------------------------------------------------ fused AdamW, contiguous only

def _adamw_steps(param, fused: bool, steps: int = 3):
    from fivefold.train.optim import adamw

    cfg = tiny_config().train
    if fused:
        optimizer = adamw([param], cfg)
    else:  # PyTorch's reference loop, which handles any strides
        optimizer = torch.optim.AdamW([param], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                      weight_decay=cfg.weight_decay, foreach=False, fused=False)
    for step in range(steps):
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step)).t().t()
        optimizer.step()
    return optimizer


def test_a_non_contiguous_parameter_never_reaches_fused_adamw():
    base = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(base.t())  # a transposed view: non-contiguous
    assert not param.is_contiguous()
    optimizer = _adamw_steps(param, fused=True)
    assert optimizer.param_groups[0]["fused"]
    assert all(p.is_contiguous() for g in optimizer.param_groups for p in g["params"])
    assert optimizer.param_groups[0]["params"][0] is param  # the same parameter, re-laid out


def test_guarded_fused_adamw_updates_a_once_non_contiguous_parameter_exactly():
    """Why the guard exists: fused AdamW on the transposed parameter as it came would be off by
    ~6e-2 after 3 steps (PyTorch 2.13, CPU); through adamw() it matches the reference loop."""
    base = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    guarded = torch.nn.Parameter(base.t())
    want = torch.nn.Parameter(base.t().contiguous())
    _adamw_steps(guarded, fused=True)
    _adamw_steps(want, fused=False)
    assert (guarded.detach() - want.detach()).abs().max().item() < 1e-6


def _non_contiguous_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from fivefold.train.optim import adamw

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(DTensor.from_local(torch.randn(16, 24).t(), mesh, [Replicate()]))
    try:
        adamw([param], tiny_config().train)
    except RuntimeError as err:
        return str(err)
    return None


def test_a_non_contiguous_dtensor_parameter_is_refused():
    (message,) = run_on_ranks(1, _non_contiguous_dtensor)
    assert message is not None and "non-contiguous local shard" in message, message
