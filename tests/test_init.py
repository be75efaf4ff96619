"""Initial weights tile by tile (models/init.py): any box equals the same box of the whole tensor,
and materialising a layout's pieces on the meta-device path gives each rank exactly its slices of
the single-device initialisation."""

import pytest
import torch

from fivefold.models import init


@pytest.fixture
def small_tiles(monkeypatch):
    # Tiles of 4 x 3 so that tiny tensors cross many tile edges.
    monkeypatch.setattr(init, "TILE_ROWS", 4)
    monkeypatch.setattr(init, "TILE_COLS", 3)


@pytest.mark.parametrize("shape", [(10,), (9, 7), (3, 9, 7), (1, 1), (16, 12)])
def test_every_box_is_the_same_box_of_the_whole_tensor(small_tiles, shape):
    whole = init.seeded_normal(5, "w", shape, 0.02)
    boxes = [((0,) * len(shape), shape),
             tuple(zip(*[(n // 3, n - n // 3 - (n > 2)) for n in shape])),
             tuple(zip(*[(n - 1, 1) for n in shape]))]
    for offsets, sizes in boxes:
        got = init.seeded_normal(5, "w", shape, 0.02, offsets, sizes)
        want = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert torch.equal(got, want), (offsets, sizes)


def test_tiles_are_independent_draws(small_tiles):
    whole = init.seeded_normal(5, "w", (8, 6), 1.0)
    tiles = [whole[r:r + 4, c:c + 3] for r in (0, 4) for c in (0, 3)]
    assert all(not torch.equal(a, b) for i, a in enumerate(tiles) for b in tiles[i + 1:])
    assert not torch.equal(whole, init.seeded_normal(6, "w", (8, 6), 1.0))  # the seed matters
    assert not torch.equal(whole, init.seeded_normal(5, "v", (8, 6), 1.0))  # and the name


def test_a_tensor_within_one_tile_keeps_its_pre_tiling_values():
    """One generator per tensor, as before tiling: small models keep their initial weights."""
    import zlib

    generator = torch.Generator().manual_seed((3 * 1_000_003 + zlib.crc32(b"layers.0.wq")) % 2**63)
    assert torch.equal(init.seeded_normal(3, "layers.0.wq", (64, 32), 0.02),
                       torch.randn((64, 32), generator=generator) * 0.02)


def _pieces_equal_single_device(overrides: dict, world: int, rank: int) -> list[str]:
    """Build `rank` of the layout under a fake group; names whose local piece differs from the
    same box of the single-device model (empty: all equal)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fivefold.mesh import ParallelDims
    from fivefold.models import build_meta_model, build_model, initial_values
    from fivefold.parallel.grad_norm import local_tensor
    from fivefold.parallel.parallelize import parallelize
    from fivefold.parallel.pieces import piece_origin
    from layouts import tiny_config

    cfg = tiny_config({**overrides, "train": {"micro_batch": 1}})  # enough micro-batches for pp
    whole = build_model(cfg.model, cfg.train.seed).state_dict()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = ParallelDims.from_config(cfg.parallel)
        par = parallelize(build_meta_model(cfg.model), dims, cfg, torch.device("cpu"),
                          initial_values(cfg.model, cfg.train.seed))
        wrong = []
        for part in par.parts:
            for name, param in part.named_parameters():
                offsets, _ = piece_origin(name, param, par.ep_mesh)
                local = local_tensor(param).detach()
                box = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
                source = "tok_embeddings.weight" if name == "output.weight" and cfg.model.tie_embeddings else name
                if not torch.equal(local, whole[source][box]):
                    wrong.append(name)
        return wrong
    finally:
        dist.destroy_process_group()


MOE = {"n_layers": 2, "moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}


@pytest.mark.parametrize("model, parallel, rank", [
    ({}, {"tp": 2}, 1),
    ({"n_layers": 4}, {"dp": 2, "zero": 3, "tp": 2, "pp": 2}, 7),  # FSDP2 rows of tp rows, last stage
    ({"n_layers": 4}, {"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}, 1),  # tied copies on one rank
    (MOE, {"dp": 2, "ep": 2, "zero": 1}, 1),  # the second half of the experts
    (MOE, {"dp": 4, "ep": 2, "zero": 3, "tp": 2}, 5),
], ids=["tp2", "dp2-zero3-tp2-pp2", "pp2-zbv", "moe-ep2", "moe-dp4-ep2-zero3-tp2"])
def test_each_rank_materialises_its_slices_of_the_single_device_init(model, parallel, rank):
    world = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1)
    assert _pieces_equal_single_device({"model": model, "parallel": parallel}, world, rank) == []
