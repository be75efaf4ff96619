"""The gate's machine stage: what this machine cannot run of a config the keys and model stages
accepted (parallel.backend, FP8 kernels and the sizes its GPU multiplies, log.memory_snapshot without
CUDA). The only stage a plan skips, since a plan is for another machine; every command that runs on
this one (train, its dry run, `layout --build`, the auto layout's choice) takes it through
`fivefold.configure.validate(..., on_this_machine=True)`. torch is imported here, inside the calls,
so that the keys and model stages stay torch-free for the planner.
"""

from __future__ import annotations

import logging
import warnings

from fivefold.config import Config, ConfigError
from fivefold.config.validate import check_backend


def check_machine(cfg: Config) -> None:
    """One sentence if this machine cannot run the config."""
    import torch

    check_backend(cfg.parallel.backend, torch.cuda.is_available())
    if cfg.train.fp8:
        check_float8(cfg)
    if cfg.log.memory_snapshot and not torch.cuda.is_available():
        raise ConfigError("log.memory_snapshot records the CUDA allocator's history, and this machine has no "
                          "CUDA device; unset log.memory_snapshot (log.profile_steps traces CPU runs too)")


def check_float8(cfg: Config) -> None:
    """train.fp8 needs torchao's float8 training, and on CUDA a GPU with FP8 matmuls and sizes its
    kernel takes."""
    import torch

    recipe = cfg.train.fp8
    try:
        import_torchao()
    except ImportError:
        raise ConfigError(f"train.fp8='{recipe}' needs torchao: pip install 'fivefold[fp8]'") from None
    if not torch.cuda.is_available():
        return  # the CPU kernel of torch._scaled_mm takes any size
    if torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(f"train.fp8='{recipe}' needs FP8 matrix multiplies (CUDA compute capability 8.9 or "
                          f"newer: L4, L40, H100, ...), and {torch.cuda.get_device_name()} has {major}.{minor}; "
                          "unset train.fp8")
    _check_float8_sizes(cfg)


def import_torchao():
    """torchao's float8 package, imported without the start-up noise of its CUDA-only libraries
    (logged as warnings on a CPU machine). Raises ImportError when torchao is not installed."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8 as float8
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return float8


def _check_float8_sizes(cfg: Config) -> None:
    """CUDA's torch._scaled_mm multiplies sizes that are multiples of 16: each dense projection's
    input and output features on a tp rank, and a micro-batch's tokens (the weight gradient's
    contraction)."""
    from fivefold.models import build_meta_model
    from fivefold.models.dense_projections import dense_projection_paths
    from fivefold.models.registry import model_spec
    from fivefold.models.spec import TP

    p, t = cfg.parallel, cfg.train
    tokens = (t.micro_batch or t.global_batch // max(1, p.dp)) * t.seq_len // p.cp
    if tokens % 16:
        raise ConfigError(f"train.fp8 on CUDA needs each micro-batch's tokens per rank (train.micro_batch x "
                          f"train.seq_len / parallel.cp = {tokens}) to be a multiple of 16; change train.seq_len "
                          "or train.micro_batch")
    spec, model = model_spec(cfg.model), build_meta_model(cfg.model)
    for index, paths in dense_projection_paths(spec, cfg.model, model).items():
        plan = spec.block_plan(cfg.model, int(index))
        for path in paths:
            linear = model.layers[index].get_submodule(path)
            split_out = plan[path] == TP.COLUMN
            out = linear.out_features // (p.tp if split_out else 1)
            inp = linear.in_features // (1 if split_out else p.tp)
            if out % 16 or inp % 16:
                raise ConfigError(f"train.fp8 on CUDA needs the dense projections' sizes per tp rank to be "
                                  f"multiples of 16, and layers.{index}.{path} multiplies {inp} -> {out} at "
                                  f"parallel.tp={p.tp}; change the model's sizes or parallel.tp, or unset train.fp8")
