"""The layout search and validation refuse the same layouts: over every layout the search enumerates
for each shipped config on 4 GPUs, the search's quick check (plan/search.py layout_problem, which
reads config/pipeline_rules.py) passes
exactly the layouts fivefold.configure.validate accepts, so the search never proposes a layout the
trainer refuses, nor skips one it runs."""

import dataclasses

import pytest

from fivefold.config import CheckpointConfig, ConfigError, DataConfig, shipped
from fivefold.configure import load_config
from fivefold.configure import validate
from fivefold.plan.layout import config_with_layout
from fivefold.plan.search import candidate_layouts, layout_problem
from fivefold.plan.workload import workload_from_config

GPUS = 4
# finetune.toml takes its model from the folder a run of chat-demo-base.toml writes: that
# config's layouts are checked, and finetune's model is the same one.
NEEDS_A_RUN_FIRST = {"finetune"}
# Every shipped config trains AdamW. Muon runs on every layout too (tests/test_muon_compositions.py),
# and a few configs are also checked with it so that no rule of its own creeps into one side only:
# fp32 and bf16, a large dense model, an MoE, and Muon chosen by a parameter group rather than by
# train.optimizer. The MoE is demo's small one: validation builds a meta-device model for each
# layout Muon runs on, which for qwen3-30b-a3b's 128 experts x 48 layers alone takes ~7 s on one core.
MUON = {"train": {"optimizer": "muon"}}
MUON_VARIANTS = [
    ("tiny", MUON),
    ("tiny", {"train": {"optimizer": "muon", "dtype": "bf16"}}),
    ("tiny", {"train": {"param_groups": "attention|mlp: optimizer=muon"}}),
    ("llama3-8b", MUON),
    ("demo", MUON),
]


def _disagreements(name: str, overrides: dict) -> tuple[list[str], int]:
    cfg = load_config(shipped.resolve(name), {"cluster": {"gpus": GPUS}, **overrides})
    # The planner plans the model and the layout: the data and checkpoint paths are the run's.
    cfg = dataclasses.replace(cfg, data=DataConfig(), checkpoint=CheckpointConfig())
    workload = workload_from_config(cfg)
    disagreements, checked = [], 0
    for grid in candidate_layouts(cfg, workload, GPUS, cfg.cluster.gpus_per_node):
        for layout in (layout for by_zero in grid for layout in by_zero):
            checked += 1
            search_says = layout_problem(cfg, workload, layout, GPUS, full_check=False)
            try:
                validate(config_with_layout(cfg, layout), GPUS)
                validation_says = None
            except ConfigError as err:
                validation_says = str(err)
            if (search_says is None) != (validation_says is None):
                disagreements.append(f"{layout}: search {search_says or 'accepts'}; "
                                     f"validation {validation_says or 'accepts'}")
    return disagreements, checked


@pytest.mark.parametrize("name", [n for n in shipped.names() if n not in NEEDS_A_RUN_FIRST])
def test_search_and_validation_refuse_the_same_layouts(name):
    disagreements, checked = _disagreements(name, {})
    assert checked > 0
    assert not disagreements, f"{len(disagreements)} of {checked}, e.g. {disagreements[:3]}"


@pytest.mark.parametrize("name,overrides", MUON_VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={x}" for k, x in v["train"].items()))
def test_search_and_validation_refuse_the_same_muon_layouts(name, overrides):
    disagreements, checked = _disagreements(name, overrides)
    assert checked > 0
    assert not disagreements, f"{len(disagreements)} of {checked}, e.g. {disagreements[:3]}"


# The model stage of the gate: rules of the family and of the export, which `plan` once skipped
# (it priced a Llama with multi-token prediction, or a gpt-oss without experts, that `train`
# then refused). Each command runs as its own process, as a user types it.
MODEL_REFUSALS = [
    (["--model.preset", "tiny", "--model.mtp_depth", "1"],
     "model.mtp_depth=1 needs a family with multi-token prediction (deepseek_v3)"),
    (["--model.preset", "tiny-gpt-oss", "--model.moe.n_experts", "0"],
     "model.family=gpt_oss needs model.moe.n_experts > 0"),
    (["--model.preset", "tiny-deepseek-v3", "--model.moe.n_experts", "0"],
     "model.family=deepseek_v3 needs model.moe.n_experts > 0"),
]


@pytest.mark.parametrize("keys,sentence", MODEL_REFUSALS, ids=["mtp-on-llama", "gpt-oss-dense", "deepseek-dense"])
def test_plan_refuses_what_train_refuses_with_the_same_sentence(keys, sentence):
    import subprocess
    import sys

    said = {}
    for command in (["plan", "--cluster.gpus", "8"], ["train", "--dry-run"]):
        out = subprocess.run([sys.executable, "-m", "fivefold", *command, *keys], capture_output=True, text=True,
                             timeout=300)
        lines = [line for line in (out.stdout + out.stderr).splitlines() if sentence in line]
        assert out.returncode != 0 and len(lines) == 1, (command, out.returncode, out.stdout[-800:], out.stderr[-800:])
        said[command[0]] = lines[0].split(": ", 1)[1]  # the sentence after the command's prefix
        assert "Traceback" not in out.stderr
    assert said["plan"] == said["train"]
