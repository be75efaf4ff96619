"""Every shipped config (src/fivefold/configs/) validates (what `fivefold config show` checks), passes the trainer's
own refusals, and its layout's world size is the one its comment promises (`# gpus: N` for the
real-model configs, whose [cluster] the planner reads too; `# ranks: N` for the local ones)."""

import re
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.configure import load_config
from fivefold.config.shipped import CONFIG_DIR
from fivefold.configure import validate

CONFIGS = sorted(CONFIG_DIR.glob("*.toml"))
REAL_MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3-style",
               "qwen3-8b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b")


def promised_world(path: Path) -> tuple[str, int]:
    match = re.search(r"^# (gpus|ranks): (\d+)", path.read_text(), re.MULTILINE)
    assert match, f"{path.name}: no '# gpus: N' or '# ranks: N' comment saying its world size"
    return match.group(1), int(match.group(2))


def test_the_expected_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {*REAL_MODELS, "tiny", "demo"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_validates_and_world_matches_comment(path, capsys, in_config_folder):
    in_config_folder(path)
    assert main(["config", "show", str(path)]) == 0, capsys.readouterr().err
    cfg = load_config(str(path), [])
    kind, world = promised_world(path)
    p = cfg.parallel
    assert p.dp * p.tp * p.pp * p.cp == world, f"{path.name}: layout is {p.dp * p.tp * p.pp * p.cp} ranks"
    validate(cfg, world, on_this_machine=True)  # as a launch on that many ranks would
    if kind == "gpus":
        assert cfg.cluster.gpus == world, f"{path.name}: [cluster] gpus={cfg.cluster.gpus} != {world}"
        # The comment's node count is the world over 8-GPU nodes (the configs' unit).
        nodes = re.search(r"^# gpus: \d+ \((\d+) nodes? x 8 H100\)", path.read_text(), re.MULTILINE)
        assert nodes and int(nodes.group(1)) * 8 == world, f"{path.name}: node count in the comment"


def test_demo_uses_all_five_dimensions():
    cfg = load_config(str(Path(CONFIGS[0]).parent / "demo.toml"), [])
    p = cfg.parallel
    assert min(p.dp, p.tp, p.pp, p.cp, p.ep) > 1 and cfg.model.moe.n_experts > 0


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_config_fits_and_its_comment_quotes_the_planner(name):
    """Each real model's layout is one the planner says fits its cluster, and the tokens/s and MFU
    its comment quotes are the planner's (a change to the planner or the config updates both)."""
    from fivefold.plan import plan_layout
    from fivefold.plan.layout import layout_from_config

    path = CONFIGS[0].parent / f"{name}.toml"
    cfg = load_config(str(path), [])
    estimate = plan_layout(cfg, layout_from_config(cfg))
    assert estimate.fits, f"{name}: needs {estimate.memory.total / 1e9:.1f} GB per GPU"
    quoted = re.search(r"([\d,]+) tokens/s/GPU, MFU ([\d.]+)%", path.read_text())
    assert quoted, f"{name}: the comment quotes no 'N tokens/s/GPU, MFU X%'"
    tokens, mfu = float(quoted.group(1).replace(",", "")), float(quoted.group(2))
    assert abs(tokens - estimate.tokens_per_sec_per_gpu) <= 0.01 * tokens, (name, estimate.tokens_per_sec_per_gpu)
    assert abs(mfu - 100 * estimate.mfu) <= 0.1, (name, estimate.mfu)
