"""The console of a run (issue 51): before step 1 it names the data and its tokenizer and each
start-up phase with its seconds; each step line carries tokens/s in all and per GPU, the step
time, memory (peak RSS on CPU; peak and share of the device on GPUs) and the time elapsed and
left; metrics.jsonl has tokens_per_sec_per_gpu. The real command, as its own process."""

import json
import re
import subprocess
import sys

from fivefold.train.metrics import memory_text


def test_a_run_says_its_start_up_and_each_step_in_full(tmp_path):
    done = subprocess.run([sys.executable, "-m", "fivefold", "train", "tiny", "--nproc", "2", "--parallel.tp", "1",
                           "--train.steps", "4", "--log.every", "2", "--log.dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "data: the built-in corpus (Python's standard library), tokenized by byte (256 ids)" in lines
    startup = [line for line in lines if line.startswith("start-up: ")]
    assert len(startup) == 1 and re.fullmatch(
        r"start-up: model built \d+\.\d s, data read \d+\.\d s, optimizer \d+\.\d s", startup[0]), startup
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in steps] == ["1/4", "2/4", "4/4"]
    field = r"step +\d/4 \| loss [\d.]+ \| lr [\d.e+-]+ \| gnorm [\d.]+ \| [\d,]+ tok/s \(([\d,]+)/gpu\) \| (\d+) ms/step"
    for line in steps:
        matched = re.match(field + r" \| rss [\d.]+ GiB \| \d+s in, \d+s left$", line)
        assert matched, line
    assert steps[-1].endswith(", 0s left")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert record["tokens_per_sec_per_gpu"] == record["tokens_per_sec"] / 2


def test_memory_on_a_device_is_its_share_in_gib():
    assert memory_text(40 * 2**30, 80 * 2**30) == "mem 40.0 GiB (50%)"
    assert memory_text(3 * 2**29, None) == "rss 1.50 GiB"
