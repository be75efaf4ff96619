"""The planner's fitted constants are what the committed calibration makes of its declared fit set,
and its error is checked on the runs that set leaves out (issue 53: benchmarks/calibrate_stacks.py,
plan/fitted.py). The bars are at least 10% beyond what the model reaches out of sample (4.7%
leave-one-model-out, 3.1% on the held-out scale: benchmarks/RESULTS.md), so an honest change
does not sit on them and no refit is needed to pass. Skipped without ../shared/data."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

from fivefold.plan import fitted

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("calibrate_stacks", ROOT / "benchmarks" / "calibrate_stacks.py")
calib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calib)

OUT_OF_SAMPLE_BOUND = 0.10  # issue 53's target for the published H100/B200 runs

needs_data = pytest.mark.skipif(not calib.CSV.is_file(), reason="published runs not available")


@pytest.fixture(scope="module")
def rows():
    return calib.Rows(calib.CSV)


def test_the_split_is_declared_and_disjoint():
    assert len(calib.FIT) == len(calib.HELD_OUT) == len(calib.MODELS) == 6
    assert not set(calib.FIT) & set(calib.HELD_OUT)
    # every model is fitted at one scale and held out at the other
    assert sorted(calib._model(n) for n in calib.FIT) == sorted(calib._model(n) for n in calib.HELD_OUT)


@needs_data
def test_committed_constants_are_what_the_script_fits(rows):
    rate = calib.fit(rows, calib.FIT)
    assert fitted.MEGATRON_MATMUL_RATE == pytest.approx(rate, abs=1e-3)
    assert fitted.MEGATRON_FP8_SPEEDUP == pytest.approx(calib.fit_fp8(rows, rate, calib.FP8_TWINS), abs=1e-2)
    assert "calibrate_stacks.py" in fitted.FIT_SETS["MEGATRON_MATMUL_RATE"]


@needs_data
def test_megatron_profile_out_of_sample(rows):
    rate = fitted.MEGATRON_MATMUL_RATE
    held = [abs(rows.error(n, rate)) for n in calib.HELD_OUT]
    assert statistics.median(held) <= OUT_OF_SAMPLE_BOUND
    lomo = []
    for model in calib.MODELS:
        alone = calib.fit(rows, [n for n in calib.FIT if calib._model(n) != model])
        lomo += [abs(rows.error(n, alone)) for n in calib.FIT + calib.HELD_OUT if calib._model(n) == model]
    assert statistics.median(lomo) <= OUT_OF_SAMPLE_BOUND
    # the band `plan` prints for the profile is this leave-one-model-out error, not the in-sample one
    from fivefold.plan.hardware import MEGATRON_RUNTIME
    band = (statistics.median(lomo), calib.quantile(lomo, 0.9))
    assert MEGATRON_RUNTIME.tokens_per_sec_error == pytest.approx(band, abs=1e-3)
