"""`fivefold plan --sweep K`: the top layouts really train on local ranks, measured beside predicted."""

import re

from fivefold.plan.cli import run_plan

TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.ffn_dim", "128", "--train.seq_len", "32",
        "--train.global_batch", "8", "--data.builtin_max_bytes", "200000", "--cluster.gpu", "cpu"]


def test_sweep_trains_the_top_layout_and_reports_measured_numbers(capsys):
    assert run_plan([*TINY, "--cluster.gpus", "2", "--top", "1", "--sweep", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "failed" not in row, row
    predicted, measured = (float(c.replace(",", "")) for c in cells[2:4])
    assert predicted > 0 and measured > 0
    assert re.fullmatch(r"\d+\.\d\d", cells[4])  # measured / predicted


def test_sweep_count_must_be_positive(capsys):
    assert run_plan([*TINY, "--cluster.gpus", "2", "--sweep", "0"]) == 2
    assert "--sweep must be at least 1, got 0" in capsys.readouterr().err
