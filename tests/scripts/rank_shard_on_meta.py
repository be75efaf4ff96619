"""Build the model shard that one rank of a huge layout holds, on the meta device, under a fake
process group of the full world size (no memory, no network), and print its parameter count.

    python tests/scripts/rank_shard_on_meta.py PRESET DP TP PP PP_LAYERS   (PP_LAYERS '' = balanced)

Used by tests/test_plan_at_scale.py to check the planner's per-rank parameter prediction against
the real pipeline split and tensor-parallel sharding code.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from fivefold.configure import load_config
from fivefold.mesh import ParallelDims
from fivefold.models import build_meta_model
from fivefold.models.registry import model_spec
from fivefold.parallel.pipeline.stages import Pipeline
from fivefold.parallel.tensor.apply import apply_tensor_parallel


def main() -> None:
    preset, dp, tp, pp, pp_layers = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    cfg = load_config(None, {"model": {"preset": preset}, "train": {"seq_len": 8192},
                             "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero": 1, "pp_layers": pp_layers}})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp * pp)
    meshes = ParallelDims.from_config(cfg.parallel).build_mesh("cpu")
    model, spec = build_meta_model(cfg.model), model_spec(cfg.model)
    pipeline = Pipeline(model, cfg, spec, meshes["pp"], torch.device("meta"))
    for part in pipeline.parts:
        apply_tensor_parallel(part, spec, cfg.model, meshes["tp"], sequence_parallel=True)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                for part in pipeline.parts for p in part.parameters())
    print(local)


if __name__ == "__main__":
    main()
