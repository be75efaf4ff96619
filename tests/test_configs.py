"""Every config in configs/ validates (what `fivefold config show` checks), passes the trainer's
own refusals, and its layout's world size is the one its comment promises (`# gpus: N` for the
real-model configs, whose [cluster] the planner reads too; `# ranks: N` for the local ones)."""

import re
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import load_config
from fivefold.validate import check_supported, validate

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
REAL_MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3-style")


def promised_world(path: Path) -> tuple[str, int]:
    match = re.search(r"^# (gpus|ranks): (\d+)", path.read_text(), re.MULTILINE)
    assert match, f"{path.name}: no '# gpus: N' or '# ranks: N' comment saying its world size"
    return match.group(1), int(match.group(2))


def test_the_expected_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {*REAL_MODELS, "tiny", "demo"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_validates_and_world_matches_comment(path, capsys):
    assert main(["config", "show", str(path)]) == 0, capsys.readouterr().err
    cfg = load_config(str(path), [])
    kind, world = promised_world(path)
    p = cfg.parallel
    assert p.dp * p.tp * p.pp * p.cp == world, f"{path.name}: layout is {p.dp * p.tp * p.pp * p.cp} ranks"
    validate(cfg, world)  # as a launch on that many ranks would
    check_supported(cfg)
    if kind == "gpus":
        assert cfg.cluster.gpus == world, f"{path.name}: [cluster] gpus={cfg.cluster.gpus} != {world}"
        # The comment's node count is the world over 8-GPU nodes (the configs' unit).
        nodes = re.search(r"^# gpus: \d+ \((\d+) nodes? x 8 H100\)", path.read_text(), re.MULTILINE)
        assert nodes and int(nodes.group(1)) * 8 == world, f"{path.name}: node count in the comment"


def test_demo_uses_all_five_dimensions():
    cfg = load_config(str(Path(CONFIGS[0]).parent / "demo.toml"), [])
    p = cfg.parallel
    assert min(p.dp, p.tp, p.pp, p.cp, p.ep) > 1 and cfg.model.moe.n_experts > 0
