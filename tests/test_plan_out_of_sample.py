"""The planner's fitted constants are what the committed calibrations make of their declared fit
sets, and their error is checked on the runs each fit leaves out (issue 53: plan/fitted.py, written
by benchmarks/calibrate_stacks.py and benchmarks/calibrate_time.py). Every bar is at least 10%
beyond what the model reaches out of sample (benchmarks/RESULTS.md), so an honest change does not
sit on it and no refit is needed to pass; the bands `plan` prints are these errors. Skipped
without ../shared/data."""

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
time_spec = importlib.util.spec_from_file_location("calibrate_time", ROOT / "benchmarks" / "calibrate_time.py")
calib_time = importlib.util.module_from_spec(time_spec)
time_spec.loader.exec_module(calib_time)

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
    from fivefold.plan.speed.frameworks import MEGATRON_RUNTIME
    band = (statistics.median(lomo), calib.quantile(lomo, 0.9))
    assert MEGATRON_RUNTIME.tokens_per_sec_error == pytest.approx(band, abs=1e-3)


# ---------------------------------------------------- the torch stacks (benchmarks/calibrate_time.py)

# Leave-one-model-out medians, each model's rows predicted by the constants fitted without it
# (benchmarks/RESULTS.md): the Playbook's 1,620 runs (nanotron), 12.4%, and torchtitan's 18
# (fivefold's profiles), 19.0% — above issue 53's 10%: these bars guard what is reached, 11-14%
# beyond it, and say how far out of sample the torch stacks' calibration is from that goal.
PLAYBOOK_OUT_OF_SAMPLE_BOUND = 0.14
TORCHTITAN_OUT_OF_SAMPLE_BOUND = 0.22
needs_time_data = pytest.mark.skipif(not (calib_time.acc.DEFAULT_CSV.is_file() and calib_time.acc.TORCHTITAN_CSV.is_file()),
                                     reason="published runs not available")


def test_every_time_constant_has_its_fit_set_and_folds():
    assert set(calib_time.PARAMS.values()) <= set(fitted.TIME_FIT_SETS)
    assert set(fitted.TIME_LEAVE_ONE_MODEL_OUT) == set(calib_time.PLAYBOOK_MODELS + calib_time.TITAN_MODELS)
    for fold in fitted.TIME_LEAVE_ONE_MODEL_OUT.values():
        assert set(fold) == set(calib_time.PARAMS.values())


@pytest.fixture(scope="module")
def time_problem():
    return calib_time.Problem()


def _left_out_errors(problem, models):
    """|error| of each row of `models`, predicted by the constants fitted without its model."""
    names = {name: key for key, name in calib_time.PARAMS.items()}
    errors = []
    for model in models:
        values = {names[n]: v for n, v in fitted.TIME_LEAVE_ONE_MODEL_OUT[model].items()}
        own_pb = [r for r in problem.playbook if r["model"] == model]
        own_tt = [r for r in problem.titan_fit + problem.titan_held if r["model"] == model]
        pb, tt = problem.predict(values, own_pb, own_tt)
        errors += calib_time._errors(pb) + calib_time._errors(tt)
    return errors


@needs_time_data
def test_nanotron_profile_out_of_sample(time_problem):
    from fivefold.plan.speed.frameworks import NANOTRON_RUNTIME

    errors = _left_out_errors(time_problem, calib_time.PLAYBOOK_MODELS)
    assert len(errors) == 1620
    assert statistics.median(errors) <= PLAYBOOK_OUT_OF_SAMPLE_BOUND
    # the band `plan` prints for the profile is this error, not the in-sample one
    band = (statistics.median(errors), calib_time.quantile(errors, 0.9))
    assert NANOTRON_RUNTIME.tokens_per_sec_error == pytest.approx(band, abs=1e-3)


@needs_time_data
def test_fivefold_profiles_out_of_sample(time_problem):
    from fivefold.plan.speed.frameworks import FIVEFOLD_COMPILED, FIVEFOLD_EAGER

    errors = _left_out_errors(time_problem, calib_time.TITAN_MODELS)
    assert len(errors) == 18
    assert statistics.median(errors) <= TORCHTITAN_OUT_OF_SAMPLE_BOUND
    band = (statistics.median(errors), calib_time.quantile(errors, 0.9))
    assert FIVEFOLD_EAGER.tokens_per_sec_error == FIVEFOLD_COMPILED.tokens_per_sec_error == pytest.approx(band, abs=1e-3)
