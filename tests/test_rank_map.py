"""The rank map (`fivefold layout`): groups partition the ranks the way the mesh does, each rank
holds the layers/experts its pipeline stage and ep position say, node crossings are flagged, and
bad input gets one sentence. That the map is what a run really does is checked inside the
16-rank composition spawn (tests/test_composition.py)."""


from fivefold.cli import main
from fivefold.configure import load_config
from fivefold.mesh import ParallelDims
from fivefold.tools.rank_map import crosses_nodes, format_rank_map, rank_groups, rank_infos
from fivefold.config.shipped import CONFIG_DIR

DEMO = str(CONFIG_DIR / "demo.toml")


def demo(*overrides: str):
    return load_config(DEMO, list(overrides))


def test_groups_partition_the_world():
    cfg = demo()
    dims = ParallelDims.from_config(cfg.parallel)
    # edp: the ranks holding the same experts, dp·cp·tp / ep (the tp ranks route different tokens)
    sizes = {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "ep": 2, "edp": 4}
    for name, groups in rank_groups(dims).items():
        assert sorted(r for g in groups for r in g) == list(range(16)), name
        assert {len(g) for g in groups} == {sizes[name]}, name
    groups = rank_groups(dims)
    assert groups["tp"][0] == [0, 1]  # tp innermost: neighbours
    assert groups["pp"][0] == [0, 8]  # pp outermost
    # ep borrows from dp x cp: every ep group lies inside one tp/pp slice.
    dp_cp = [set(g) for g in dims.groups("dp_replicate", "dp_shard", "cp")]
    assert all(any(set(g) <= row for row in dp_cp) for g in groups["ep"])


def test_each_rank_holds_its_stage_and_experts():
    cfg = demo()
    infos = rank_infos(cfg, ParallelDims.from_config(cfg.parallel))
    assert [i.layers for i in infos[:8]] == [[0, 1]] * 8 and [i.layers for i in infos[8:]] == [[2, 3]] * 8
    assert all(i.embedding for i in infos[:8]) and all(i.output for i in infos[8:])
    assert {i.experts for i in infos} == {(0, 2), (2, 4)}
    dims = ParallelDims.from_config(cfg.parallel)
    for group in rank_groups(dims)["ep"]:  # an ep group holds every expert once
        assert sorted(e for r in group for e in range(*infos[r].experts)) == [0, 1, 2, 3]


def test_v_schedule_puts_first_and_last_stage_on_one_rank():
    cfg = demo("--parallel.pp_schedule", "zbv", "--parallel.pp_virtual", "2", "--model.n_layers", "8")
    infos = rank_infos(cfg, ParallelDims.from_config(cfg.parallel))
    assert infos[0].stages == [0, 3] and infos[0].embedding and infos[0].output
    assert infos[8].stages == [1, 2] and infos[8].layers == [2, 3, 4, 5]


def test_node_crossings_are_marked():
    text = format_rank_map(demo("--parallel.gpus_per_node", "4"))
    assert "tp    2 ranks, all inside one node" in text
    assert "pp    2 ranks, 8 of 8 cross nodes: *[0,8]" in text
    assert "dp    2 ranks, 8 of 8 cross nodes: *[0,4]" in text  # 4 ranks per node: dp steps by 4
    assert "-> 4 node(s)" in text and "rank  15 node 3" in text
    assert crosses_nodes([3, 4], 4) and not crosses_nodes([4, 7], 4)


def test_layout_command(capsys):
    assert main(["layout", DEMO]) == 0
    out = capsys.readouterr().out
    assert out.startswith("layout: dp=2 (zero 1) x tp=2 +sp x pp=2 (1f1b, 2 stages) x cp=2 (ring) x ep=2 = 16 ranks")
    assert "rank   3 node 0: pp0 dp0 cp1 tp1 ep1 | layers 0-1 +embedding; heads 2-3 of 4; experts 2-3 of 4" in out


def test_layout_command_cuts_long_listings(capsys):
    cfg = CONFIG_DIR / "llama3-405b.toml"
    assert main(["layout", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "... (512 ranks; --all prints every one)" in out and "(64 groups)" in out  # tp8 groups
    assert main(["layout", str(cfg), "--all"]) == 0
    assert "rank 511 node 63" in capsys.readouterr().out


def test_layout_wrong_world_is_one_sentence(capsys):
    assert main(["layout", DEMO, "--nproc", "8"]) == 2
    err = capsys.readouterr().err
    assert "but the job has 8 ranks" in err and err.count("\n") == 1
