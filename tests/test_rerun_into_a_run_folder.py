"""The same command run again into a folder that holds a run (issue 51, item 1): it is continued
(checkpoint.resume = auto) or refused in one sentence naming the key, never restarted at step 1
over the earlier run; `latest` never moves back to an older step; the last step is saved whenever
checkpoints are on; every save is one console line (step, folder, size, seconds)."""

from __future__ import annotations

import json
import re

from outside_the_run import Untouched, refused, succeeded, train

RUN = ["--train.steps", "3", "--checkpoint.every", "2"]
SAVED = re.compile(r"saved step (\d+) to (\S+) \(([\d.,]+) MiB in ([\d.]+) s\)")


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_same_command_again_is_refused_and_auto_continues(tmp_path):
    run = tmp_path / "run"
    first = succeeded(train(*RUN, "--log.dir", run))
    saves = SAVED.findall(first.stdout)
    assert [(int(s), folder) for s, folder, *_ in saves] == [(2, str(run / "checkpoints" / "step_00000002")),
                                                             (3, str(run / "checkpoints" / "step_00000003"))]
    assert all(float(size.replace(",", "")) > 0 for *_, size, _ in saves)  # the last step (3) is saved too
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"

    watch = Untouched(run)  # the earlier run's files: refused means untouched
    said = refused(train(*RUN, "--log.dir", run))
    assert said == (f"{run / 'checkpoints'} already holds the checkpoints of a run, and checkpoint.resume = none would "
                    "start over at step 1 on top of them; continue it with checkpoint.resume = auto, or give this run "
                    "another folder (log.dir or checkpoint.dir)")
    watch.check()

    succeeded(train("--train.steps", "5", "--checkpoint.every", "2", "--log.dir", run, "--checkpoint.resume", "auto"))
    assert _steps(run) == [1, 2, 3, 4, 5]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000005"


def test_latest_never_moves_back(tmp_path):
    run = tmp_path / "run"
    succeeded(train("--train.steps", "4", "--checkpoint.every", "1", "--log.dir", run))
    older = run / "checkpoints" / "step_00000002"
    again = succeeded(train("--train.steps", "3", "--checkpoint.every", "1", "--log.dir", run,
                            "--checkpoint.resume", older))
    assert f"{run / 'checkpoints' / 'latest'} stays at the newer step_00000004" in again.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_a_run_folder_with_metrics_and_no_checkpoint_is_refused(tmp_path):
    run = tmp_path / "run"
    succeeded(train("--train.steps", "2", "--log.dir", run))
    watch = Untouched(run, but=("metrics.jsonl",))  # its last step is read to say it; unchanged: below
    for resume in ("none", "auto"):
        said = refused(train("--train.steps", "2", "--log.dir", run, "--checkpoint.resume", resume))
        assert said == (f"log.dir {run} already holds a run (metrics.jsonl up to step 2) and no checkpoint to continue "
                        "it from, so this run would log steps 1, 2, ... after it; give this run another log.dir, or "
                        f"delete {run / 'metrics.jsonl'} to start over in that folder")
    watch.check()
    assert _steps(run) == [1, 2]
