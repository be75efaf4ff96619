"""Pipeline parallelism: every schedule, and pipelines composed with tp and dp, against the
single-process run (8 layers, 8 micro-batches of one sequence)."""

import pytest

from layouts import TP_WEIGHT_ATOL, assert_same_run, reference, run_layouts
from ranks import run_on_ranks

EIGHT_LAYERS = {"n_layers": 8}
MICRO = {"micro_batch": 1}
# Held-out evaluation after steps 3 and 6 (forward only through the schedule), equal to the single
# process's. Not under zbv and dualpipev: torch 2.13's V schedules run their backward actions in
# eval() too and fail ("can't steal_bwd_input if this stage doesn't have backward").
EVAL = {"eval_every": 3, "eval_batches": 1}
V_SCHEDULES = ("zbv", "dualpipev")


def pp_layout(schedule: str, pp: int = 2, virtual: int = 1, **parallel) -> dict:
    train = dict(MICRO) if schedule in V_SCHEDULES else {**MICRO, **EVAL}
    return {"model": dict(EIGHT_LAYERS), "train": train,
            "parallel": {"pp": pp, "pp_schedule": schedule, "pp_virtual": virtual, **parallel}}


TWO_RANKS = [
    pp_layout("gpipe"),
    pp_layout("1f1b"),
    pp_layout("interleaved_1f1b", virtual=2),
    pp_layout("zb", virtual=2),
    pp_layout("zbv", virtual=2),
    pp_layout("dualpipev", virtual=2),
    pp_layout("1f1b", pp_layers="3,5"),  # uneven split
    {**pp_layout("1f1b"), "model": {**EIGHT_LAYERS, "tie_embeddings": False}},
]
FOUR_RANKS = [
    pp_layout("1f1b", pp=4),
    pp_layout("interleaved_1f1b", pp=4, virtual=2),
    pp_layout("1f1b", tp=2),
    {**pp_layout("1f1b", dp=2, zero=1), "train": {"micro_batch": 1}},
    {**pp_layout("1f1b", dp=2, zero=3), "train": {"micro_batch": 1}},
    {**pp_layout("zbv", virtual=2, dp=2, zero=1), "train": {"micro_batch": 1}},
    {**pp_layout("interleaved_1f1b", virtual=2, dp=2, zero=3), "train": {"micro_batch": 1}},
    # Split backward (input pass, then weight pass) with FSDP2: blocks must stay gathered in
    # between, or their weight gradients are lost (found here: the V's last stage got none).
    {**pp_layout("zbv", virtual=2, dp=2, zero=3), "train": {"micro_batch": 1}},
    {**pp_layout("zb", virtual=2, dp=2, zero=3), "train": {"micro_batch": 1}},
    {**pp_layout("dualpipev", virtual=2, dp=2, zero=3), "train": {"micro_batch": 1}},
]


@pytest.fixture(scope="module")
def two_rank_results():
    return run_on_ranks(2, run_layouts, TWO_RANKS)


@pytest.fixture(scope="module")
def four_rank_results():
    return run_on_ranks(4, run_layouts, FOUR_RANKS)


def _label(layout: dict) -> str:
    return f"{layout['parallel']} {layout['model']}{' eval' if 'eval_every' in layout['train'] else ''}"


@pytest.mark.parametrize("index", range(len(TWO_RANKS)), ids=[_label(l) for l in TWO_RANKS])
def test_pp2_schedules(two_rank_results, index):
    want = reference(TWO_RANKS[index])
    for rank, results in enumerate(two_rank_results):
        assert_same_run(results[index], want, label=f"{_label(TWO_RANKS[index])} rank {rank}")


# With tp, the 8-layer model's row-parallel sums reassociate (losses and gradient norms still agree
# to ~1e-6), and AdamW's m/sqrt(v) turns that into up to ~6e-5 on a few weights whose gradients
# nearly cancel; tp2 without any pipeline shows the same 5.7e-5 on the same weights (TP_WEIGHT_ATOL).

@pytest.mark.parametrize("index", range(len(FOUR_RANKS)), ids=[_label(l) for l in FOUR_RANKS])
def test_four_ranks(four_rank_results, index):
    layout = FOUR_RANKS[index]
    want = reference(layout)
    atol = TP_WEIGHT_ATOL if layout["parallel"].get("tp", 1) > 1 else 1e-5
    for rank, results in enumerate(four_rank_results):
        assert_same_run(results[index], want, weight_atol=atol, label=f"{_label(layout)} rank {rank}")


@pytest.mark.parametrize("overrides, message", [
    ({"pp": 4, "pp_virtual": 4, "pp_schedule": "interleaved_1f1b"},
     "parallel.pp*pp_virtual = 16 stages exceed model.n_layers=8"),
    ({"pp": 2, "pp_schedule": "1f1b", "pp_virtual": 2},
     "parallel.pp_schedule='1f1b' runs one stage per rank, so parallel.pp_virtual must be 1, got 2"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b"},
     "parallel.pp_schedule='interleaved_1f1b' interleaves virtual stages: set parallel.pp_virtual >= 2"),
    ({"pp": 2, "pp_schedule": "zbv", "pp_virtual": 3}, "parallel.pp_virtual must be 2, got 3"),
    ({"pp": 2, "pp_schedule": "dualpipev", "pp_virtual": 2},
     "'dualpipev' needs at least as many micro-batches as stages (4) but a step has 1"),
    ({"pp": 2, "pp_schedule": "1f1b"}, "'1f1b' needs at least as many micro-batches as stages (2)"),
    ({"pp": 2, "pp_layers": "1,2,5"}, "parallel.pp_layers='1,2,5' has 3 entries but there are"),
    ({"pp": 2, "pp_layers": "1,2"}, "parallel.pp_layers='1,2' adds up to 3 layers but model.n_layers=8"),
    ({"pp": 2, "pp_layers": "0,8"}, "gives a stage no layer"),
    ({"pp": 2, "pp_layers": "a,b"}, "must be comma-separated layer counts"),
])
def test_bad_pipeline_inputs(overrides, message):
    from fivefold.config import ConfigError
    from fivefold.configure import validate
    from layouts import tiny_config

    cfg = tiny_config({"parallel": overrides, "model": dict(EIGHT_LAYERS)})
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("pp, n_micro", [(2, 4), (4, 8), (4, 16)])
def test_schedule_table_bubble_matches_formula(schedule, virtual, pp, n_micro):
    """The schedules' own action tables, replayed with forward 1 / backward 2, give the textbook
    bubble (p-1)/(v·m+p-1)."""
    from fivefold.parallel.pipeline.schedule_table import schedule_bubble

    expected = (pp - 1) / (virtual * n_micro + pp - 1)
    assert schedule_bubble(schedule, pp, virtual, n_micro) == pytest.approx(expected, abs=1e-9)


def test_zero_bubble_schedules_beat_1f1b():
    from fivefold.parallel.pipeline.schedule_table import schedule_bubble

    one_f_one_b = schedule_bubble("1f1b", 4, 1, 16)
    assert schedule_bubble("zb", 4, 2, 16) < one_f_one_b / 3
    assert schedule_bubble("zbv", 4, 2, 16) < one_f_one_b / 3


def test_schedule_picture(tmp_path):
    from fivefold.cli import main

    out = tmp_path / "zbv.png"
    assert main(["viz", "schedule", "--schedule", "zbv", "--pp", "4", "--virtual", "2",
                 "--micro-batches", "8", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_schedule_picture_refuses_bad_layout(tmp_path, capsys):
    from fivefold.cli import main

    assert main(["viz", "schedule", "--schedule", "dualpipev", "--pp", "4", "--virtual", "2",
                 "--micro-batches", "4", "--out", str(tmp_path / "x.png")]) == 2
    assert "needs at least as many micro-batches as stages (8)" in capsys.readouterr().err


def test_balanced_split_counts_the_output_layer():
    """The last stage carries the output projection: with a large vocabulary it gets fewer layers."""
    from fivefold.configure import load_config
    from fivefold.plan.pipeline.stage_split import balanced_layer_counts, stage_costs

    small_vocab = load_config(None, {"model": {"n_layers": 8}}).model
    assert balanced_layer_counts(*stage_costs(small_vocab, 128), 2) == [4, 4]
    big_vocab = load_config(None, {"model": {"preset": "llama3-1b"}}).model  # 16 layers, 128k vocab
    counts = balanced_layer_counts(*stage_costs(big_vocab, 4096), 4)
    assert sum(counts) == 16 and counts[-1] < counts[0]
