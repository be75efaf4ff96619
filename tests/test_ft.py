"""In-place healing with torchft replica groups (`[ft]`, src/fivefold/ft/): two replica groups of one
rank each, started by `fivefold train --ft.replicas 2` on loopback (its lighthouse and the groups'
servers on port 0), train the tiny config to the single process's losses; a group killed by a real
SIGKILL inside a step is started again, heals from the live group, and the job ends with every step
logged once, the uninterrupted run's losses and the same weights in both groups. The same with two
ranks (dp=2) in each group; a group that trains steps alone under same_batch keeps the losses and
the weights; under shrink a lone group's step is its own half of the batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.config import ConfigError
from fivefold.configure import load_config, validate
from fivefold.ft.share import step_share
from layouts import BASE, LATER_NORM_GAIN, LOSS_RTOL, NOISE_MARGIN, reference

STEPS = BASE["train"]["steps"]


def _toml(settings: dict) -> str:
    lines = []
    for section, values in settings.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _train_ft(tmp: Path, *extra: str) -> tuple[list[dict], str, Path]:
    """`fivefold train` with two replica groups; (the job's metrics records, the console, log.dir)."""
    config = tmp / "tiny_ft.toml"
    config.write_text(_toml(BASE))
    log_dir = tmp / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "fivefold", "train", str(config), "--ft.replicas", "2",
                          "--log.dir", str(log_dir), "--log.every", "1", "--log.progress", "true",
                          "--parallel.timeout_s", "90", *extra],
                         capture_output=True, text=True, env=env, timeout=540)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-6000:]
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return records, console, log_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _train_ft(tmp_path_factory.mktemp("ft_whole"))


def _assert_losses_match(records: list[dict], want_losses, want_norms, loss_rtol, norm_rtol, label: str) -> None:
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), f"{label}: steps logged {[r['step'] for r in records]}"
    for r, loss, norm in zip(records, want_losses, want_norms):
        assert abs(r["loss"] - loss) <= loss_rtol * abs(loss), f"{label}: step {r['step']} loss {r['loss']} != {loss}"
        rtol = norm_rtol if r["step"] == 1 else max(norm_rtol, LATER_NORM_GAIN * LOSS_RTOL)
        assert abs(r["grad_norm"] - norm) <= rtol * abs(norm), f"{label}: step {r['step']} grad norm {r['grad_norm']} != {norm}"


def _final_states(log_dir: Path) -> dict[int, dict]:
    return {g: json.loads((log_dir / f"group{g}" / "final.json").read_text()) for g in (0, 1)}


def _assert_single_process_losses(records: list[dict], label: str) -> None:
    ref = reference()  # the tiny config in one process
    _assert_losses_match(records, ref.losses, ref.grad_norms, max(LOSS_RTOL, NOISE_MARGIN * ref.loss_noise),
                         max(LOSS_RTOL, NOISE_MARGIN * ref.norm_noise), label)


def test_two_replica_groups_equal_the_single_process(uninterrupted):
    records, console, log_dir = uninterrupted
    _assert_single_process_losses(records, "2 replica groups")
    finals = _final_states(log_dir)
    assert finals[0]["step"] == finals[1]["step"] == STEPS
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"], "the groups' weights differ"


def test_a_killed_group_heals_and_the_losses_stay(uninterrupted, tmp_path):
    # ft.min_replicas 2: the live group waits for the restarted one instead of racing to the last step
    # alone (on a busy machine a restart can take longer than the steps left), so healing always happens.
    records, console, log_dir = _train_ft(tmp_path, "--debug.kill_replica", "1:3", "--ft.min_replicas", "2")
    assert "replica group 1 was killed by SIGKILL" in console, console[-4000:]
    assert "step 3 was not committed" in console, console[-4000:]  # the survivor's step, interrupted
    assert "replica group 1 healed from a live peer" in console, console[-4000:]
    # every step once, the uninterrupted run's losses: the interrupted step ran again, whole
    whole = uninterrupted[0]
    _assert_losses_match(records, [r["loss"] for r in whole], [r["grad_norm"] for r in whole], LOSS_RTOL, LOSS_RTOL,
                         "killed and healed")
    finals = _final_states(log_dir)
    assert finals[0]["step"] == finals[1]["step"] == STEPS
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"], "the healed group's weights differ"
    # Exact even where the rerun step had one group: its two micro-batches weigh 1/2 each either way (a
    # power of two), and a sum of two terms does not depend on its order.
    assert finals[0]["weights_sha256"] == _final_states(uninterrupted[2])[0]["weights_sha256"], \
        "the healed run ended with other weights than the uninterrupted one"


def test_a_group_alone_trains_the_whole_batch(uninterrupted, tmp_path):
    # ft.min_replicas 1 and the restarted group held back for 10 s: the live group reruns step 3 alone
    # and goes on alone (to the end, or until the restarted group heals from it); under same_batch it
    # runs the missing group's micro-batches too, so every step's gradient is the whole batch's.
    records, console, log_dir = _train_ft(tmp_path, "--debug.kill_replica", "1:3", "--debug.rejoin_delay_s", "10")
    assert "replica group 1 was killed by SIGKILL" in console, console[-4000:]
    assert "replica group 1 waits debug.rejoin_delay_s=10 s" in console, console[-4000:]
    alone = [r["step"] for r in records if r["replicas_live"] == 1]
    assert 3 in alone, f"steps trained by one group: {alone}; the rerun of step 3 should be"
    _assert_single_process_losses(records, "one group alone from step 3")
    whole = uninterrupted[0]
    _assert_losses_match(records, [r["loss"] for r in whole], [r["grad_norm"] for r in whole], LOSS_RTOL, LOSS_RTOL,
                         "one group alone from step 3")
    final = json.loads((log_dir / "group0" / "final.json").read_text())
    # Exact, as in the test above: the lone group's two micro-batches weigh 1/2 each, as the two groups' did.
    assert final["weights_sha256"] == _final_states(uninterrupted[2])[0]["weights_sha256"], \
        "the group that trained alone ended with other weights than the uninterrupted run"
    healed = log_dir / "group1" / "final.json"  # a restart that came before the end heals; its weights agree
    if healed.exists():
        assert json.loads(healed.read_text())["weights_sha256"] == final["weights_sha256"]


def test_groups_of_two_ranks_heal_and_equal_the_single_process(tmp_path):
    # dp=2 inside each group (torch elastic starts its ranks; torchft's Manager borrows the elastic store):
    # group 1's two ranks SIGKILL themselves at step 3, the group is started again and each rank heals from
    # the same rank of group 0.
    records, console, log_dir = _train_ft(tmp_path, "--nproc", "2", "--parallel.dp", "2", "--debug.kill_replica",
                                          "1:3", "--ft.min_replicas", "2")
    assert "replica group 1 exited with code" in console or "replica group 1 was killed" in console, console[-4000:]
    assert "step 3 was not committed" in console, console[-4000:]
    assert "replica group 1 healed from a live peer" in console, console[-4000:]
    _assert_single_process_losses(records, "2 replica groups of dp=2, group 1 killed at step 3")
    finals = _final_states(log_dir)
    assert finals[0]["step"] == finals[1]["step"] == STEPS
    assert finals[0]["weights_sha256"] == finals[1]["weights_sha256"], "the healed group's weights differ"


def test_shrink_drops_a_missing_groups_share(tmp_path):
    # ft.mode shrink (torchft's own way): group 1 is killed inside its first step and held back, so group 0
    # trains step 1 alone on its own half of the batch, weighed 1: step 1's loss and gradient norm are
    # the single process's at global_batch 4 (the first 4 of the 8 sequences), not the whole batch's.
    records, console, log_dir = _train_ft(tmp_path, "--ft.mode", "shrink", "--debug.kill_replica", "1:1",
                                          "--debug.rejoin_delay_s", "10")
    assert "replica group 1 was killed by SIGKILL" in console, console[-4000:]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), [r["step"] for r in records]
    assert records[0]["replicas_live"] == 1
    half, whole = reference({"train": {"global_batch": 4}}), reference()
    for got, want, noise in ((records[0]["loss"], half.losses[0], half.loss_noise),
                             (records[0]["grad_norm"], half.grad_norms[0], half.norm_noise)):
        assert abs(got - want) <= max(LOSS_RTOL, NOISE_MARGIN * noise) * abs(want), f"step 1: {got} != {want}"
    assert abs(records[0]["loss"] - whole.losses[0]) > 1e3 * LOSS_RTOL * whole.losses[0], \
        "shrink's lone step should differ from the whole batch's"


def test_live_groups_split_the_whole_batch():
    """same_batch: the live groups' units cover the step's units once, weights summing to 1; shrink:
    each group keeps its own units and the live groups are averaged."""
    for units in (2, 3, 8):
        for live in range(1, units + 1):
            shares = [step_share("same_batch", units, r, live, group=0, replicas=live) for r in range(live)]
            covered = [u for s in shares for u in range(s.first_unit, s.first_unit + s.units)]
            assert covered == list(range(units)) and abs(sum(s.weight for s in shares) - 1) < 1e-12
    kept = step_share("shrink", 8, live_rank=0, live=1, group=1, replicas=2)
    assert (kept.first_unit, kept.units, kept.weight) == (4, 4, 1.0)
    share = step_share("same_batch", 4, 1, 2, group=0, replicas=2)
    assert list(share.micro_batches(dp_rank=1, dp=2)) == [6, 7]  # units 2-3; this dp rank's two micro-batches


@pytest.mark.parametrize("overrides, words", [
    (["--parallel.tp", "2"], "parallel.tp=2 is not yet available with ft.replicas=2"),
    (["--ft.min_replicas", "3"], "ft.min_replicas=3 exceeds ft.replicas=2"),
    (["--ft.group", "2"], "ft.group=2 must be below ft.replicas=2"),
    (["--ft.lighthouse", "nowhere"], "ft.lighthouse='nowhere' must be HOST:PORT"),
    (["--checkpoint.every", "2", "--checkpoint.dir", "/tmp/fivefold-ft-checkpoints"],
     "checkpoint.every=2 is not yet available with ft.replicas=2"),
    (["--train.micro_batch", "8"], "fewer than ft.replicas=2"),
    (["--debug.kill_replica", "2:3"], "debug.kill_replica='2:3' must be GROUP:STEP"),
])
def test_ft_config_refusals(overrides, words):
    settings = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
                "--train.global_batch", "8", "--ft.replicas", "2", "--parallel.dp", "1"]
    cfg = load_config(None, [*settings, *overrides])
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, cfg.parallel.tp)


def test_kill_replica_needs_replicas():
    with pytest.raises(ConfigError, match="ft.replicas=0 starts none"):
        validate(load_config(None, ["--debug.kill_replica", "1:3", "--train.steps", "6"]), 1)
    with pytest.raises(ConfigError, match="debug.rejoin_delay_s=10.0 delays a restarted replica group, and "
                                          "ft.replicas=0 starts none; set ft.replicas"):
        validate(load_config(None, ["--debug.rejoin_delay_s", "10"]), 1)
