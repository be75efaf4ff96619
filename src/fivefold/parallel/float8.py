"""FP8 training of the dense projections (train.fp8) through torchao's float8 recipes.

Which modules: the block's dense projections (models/dense_projections.py: the ones the family's
tensor-parallel plan lays out as Megatron's dense projections, attention's four and a dense MLP's
three in the decoder families), by path in each block, so nothing here names a family's modules. The embedding, the output layer, norms, latent
down-projections (their tp gradient is a partial sum), multi-token prediction's eh_proj and the
MoE layers (router, routed and shared experts) stay in high precision: torchtitan's choice for
the first three, and torch 2.13 has no FP8 grouped matmul on CPU (`_scaled_grouped_mm` is
CUDA-only, SM90+, reached by torchao only through its prototype MoE training).

An `nn.Linear` becomes torchao's own `Float8Linear` (`convert_to_float8_training`). A
tensor-parallel layer (parallel/tensor/layers.py) multiplies its local shard, and quantising that
shard on its own would give every rank its own scale: the run would drift from the single
process. So its matmul becomes `Float8ShardMatmul`: the recipe torchao's `Float8Linear` computes (the
same six casts, through torchao's amax, scale, cast and scaled-mm functions and its config), with the
amax of every cast whose scale spans a split dimension all-reduced with MAX over the ranks
splitting it. Tensorwise: every cast of a split tensor. Rowwise: the casts whose rows run along
the split: a row-split layer's input and weight in forward, a column-split layer's output
gradient and its weight for the input gradient. Context parallelism splits every sequence's
tokens, so under cp the casts spanning tokens (tensorwise activations and gradients, rowwise
weight-gradient operands) are reduced over cp too, in Float8Linear's forward as well: a cp run
scales as the single process scales the same micro-batch. Data parallelism is not reduced over,
as in torchtitan: a dp rank scales its own micro-batches, as the single process accumulating the
same micro-batches does.

Applied per part after tensor and expert parallelism, before context parallelism, recomputation,
compile and FSDP (docs/design.md, the apply order). Under FSDP2 (zero 3) with tensorwise scaling
and tp = 1 the weights are all-gathered in FP8 (torchao's `enable_fsdp_float8_all_gather`: each
rank casts its shard with the amax reduced over the shard group). With tp > 1 or rowwise they are
gathered in fp32 as without FP8: torchao takes that amax over the FSDP group only, while a
tp-split weight needs it over tp too, and rowwise has no FP8 all-gather.

torchao's names used beyond `torchao.float8`'s own exports: `float8_utils.tensor_to_amax` and
`amax_to_scale`, `float8_training_tensor.hp_tensor_and_scale_to_float8`,
`float8_scaling_utils.get_maybe_axiswise_dim`, `distributed_utils.tensor_already_casted_to_fp8`
and `fsdp_utils.WeightWithDynamicFloat8CastTensor` (tests), as of torchao 0.18.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fivefold.configure.machine import import_torchao
from fivefold.models.dense_projections import DENSE_PROJECTION_STYLES, dense_projection_paths
from fivefold.models.spec import ModelSpec
from fivefold.torch_internals import c10d_functional as _c10d

RECIPES = ("tensorwise", "rowwise")


def float8_config(recipe: str, fsdp_all_gather: bool = False):
    """torchao's Float8LinearConfig of a recipe, with its FP8 FSDP all-gather when asked."""
    import dataclasses

    ao = import_torchao()
    config = ao.Float8LinearConfig.from_recipe_name(str(recipe))  # a plain str: torchao compares types
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True) if fsdp_all_gather else config


def float8_all_gather(cfg, dims) -> bool:
    """Whether FSDP2 gathers the FP8 projections' weights in FP8 (see the module's docstring)."""
    fsdp = cfg.parallel.zero == 3 and dims.dp * dims.cp > 1
    return fsdp and dims.tp == 1 and cfg.train.fp8 == "tensorwise"


def apply_float8(part: nn.Module, spec: ModelSpec, cfg_model, recipe: str, fsdp_all_gather: bool = False,
                 token_mesh=None) -> int:
    """Convert the dense projections of `part` (still on the meta device); returns how many.
    token_mesh: the cp group when context parallelism splits every sequence's tokens over it."""
    ao = import_torchao()
    config = float8_config(recipe, fsdp_all_gather)
    tokens = {"tokens": token_mesh} if token_mesh is not None else {}
    converted = 0
    for index, paths in dense_projection_paths(spec, cfg_model, part).items():
        block = part.layers[index]
        plain = set()
        for path in paths:
            module = block.get_submodule(path)
            if isinstance(module, nn.Linear):
                plain.add(path)
            elif hasattr(module, "sharded_dim"):  # a tensor-parallel layer computing on its shard
                module.matmul = Float8ShardMatmul(config, {module.sharded_dim: module.weight.device_mesh, **tokens})
                converted += 1
            else:
                raise ValueError(f"train.fp8: layers.{index}.{path} is a {type(module).__name__}, which has "
                                 "no FP8 matmul (the plan gives it a dense projection's style)")
        if plain:
            ao.convert_to_float8_training(block, config=config, module_filter_fn=lambda m, fqn: fqn in plain)
            converted += len(plain)
            for path in plain if tokens else ():  # torchao's layer, its tokens' scales taken over cp
                linear = block.get_submodule(path)
                linear.matmul = Float8ShardMatmul(config, tokens)
                linear.forward = functools.partial(_linear_forward, linear)
    return converted


def _linear_forward(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return linear.matmul(x, linear.weight, linear.bias)


def is_float8(module: nn.Module) -> bool:
    """Whether a module's matmul runs in FP8 (torchao's Float8Linear or a converted tp layer)."""
    return type(module).__name__ == "Float8Linear" or isinstance(getattr(module, "matmul", None), Float8ShardMatmul)


def describe(cfg, spec: ModelSpec, all_gather: bool) -> str:
    """The start-up line: what runs in FP8 and what does not, and why."""
    import importlib.metadata

    from fivefold.models.moe.layer import is_moe_layer

    m = cfg.model
    n_layers = m.n_layers + m.mtp_depth
    count = sum(sum(style in DENSE_PROJECTION_STYLES for style in spec.block_plan(m, i).values()) for i in range(n_layers))
    moe = any(is_moe_layer(m, i) for i in range(m.n_layers))
    kept = "embedding, output layer, norms" + (
        ", MoE layers (routers, routed and shared experts: no FP8 grouped-matmul kernel in torch 2.13 on CPU, "
        "and torchao reaches CUDA's only through its prototype)" if moe else "")
    gather = ("FSDP all-gathers them in FP8" if all_gather else
              "FSDP all-gathers fp32 weights" if cfg.parallel.zero == 3 else "")
    return (f"fp8: {cfg.train.fp8} scaling (torchao {importlib.metadata.version('torchao')}): {count} dense "
            f"projections in FP8; not in FP8: {kept}" + (f"; {gather}" if gather else ""))


class Float8ShardMatmul:
    """x Wᵀ (+ b) of a layer's local shard in FP8, scaled as the whole tensor is.

    `sharded` maps each matmul dimension split over ranks to the mesh splitting it: "out" (a
    column-split layer: its weight's rows, its output's columns) or "in" (a row-split layer: the
    contraction dimension of its input and weight) over tp, and "tokens" over cp. A cast reduces
    its amax with MAX over a mesh when the tensor holds that dimension and its scale spans it:
    always for tensorwise, and for rowwise when the rows it scales run along it (torchao's
    `axiswise_dim`)."""

    def __init__(self, config, sharded: dict):
        ao = import_torchao()
        from torchao.float8.config import ScalingGranularity

        self.config = config
        gemm = lambda g: ao.ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)  # noqa: E731
        # What torchao's Float8Linear builds from the same config.
        self.mm_config = ao.LinearMMConfig(gemm(config.gemm_config_output), gemm(config.gemm_config_grad_input),
                                           gemm(config.gemm_config_grad_weight))
        # (cast config, the dimensions of the tensor as cast, the dimension its axiswise rows run along)
        casts = {"input": (config.cast_config_input, ("tokens", "in"), "in"),
                 "weight": (config.cast_config_weight, ("in", "out"), "in"),
                 "grad_output": (config.cast_config_grad_output, ("tokens", "out"), "out"),
                 "weight_for_grad_input": (config.cast_config_weight_for_grad_input, ("in", "out"), "out"),
                 "grad_output_for_grad_weight": (config.cast_config_grad_output_for_grad_weight, ("tokens", "out"), "tokens"),
                 "input_for_grad_weight": (config.cast_config_input_for_grad_weight, ("tokens", "in"), "tokens")}
        self.reduce = {name: [mesh for dim, mesh in sharded.items() if dim in dims and (
                           cc.scaling_granularity is ScalingGranularity.TENSORWISE or along == dim)]
                       for name, (cc, dims, along) in casts.items()}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_autocast_enabled("cuda"):  # as Float8Linear.forward does
            x = x.to(torch.get_autocast_dtype("cuda"))
        out = _ShardMatmul.apply(x, weight.t(), self)
        return out if bias is None else out + bias.to(out.dtype)

    def cast(self, t: torch.Tensor, name: str, cast_config, axis: int, role):
        """torchao's dynamic cast of `t` for one gemm operand (`hp_tensor_to_float8_dynamic`, with
        the amax reduced over this cast's meshes), as is when already FP8 or disabled."""
        from torchao.float8.config import ScalingType
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        if tensor_already_casted_to_fp8(t) or cast_config.scaling_type is ScalingType.DISABLED:
            return t
        axiswise_dim = get_maybe_axiswise_dim(axis, cast_config.scaling_granularity)
        amax = tensor_to_amax(t, scaling_granularity=cast_config.scaling_granularity, axiswise_dim=axiswise_dim)
        for mesh in self.reduce[name]:
            amax = _max_over(amax, mesh)
        scale = amax_to_scale(amax, cast_config.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, self.mm_config, role, axiswise_dim)


@torch.no_grad()
def _max_over(amax: torch.Tensor, mesh) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(amax.contiguous(), "max", mesh.get_group().group_name))


class _ShardMatmul(torch.autograd.Function):
    """The gemms of torchao's float8 recipe (which operand is cast along which axis for the output,
    the input gradient and the weight gradient, as its Float8Linear does), each cast through
    `Float8ShardMatmul.cast`, which adds the amax reductions a shard needs."""

    @staticmethod
    def forward(ctx, x, weight_t, mm: Float8ShardMatmul):
        from torchao.float8 import GemmInputRole as Role

        ctx.save_for_backward(x, weight_t)
        ctx.mm = mm
        c = mm.config
        x8 = mm.cast(x, "input", c.cast_config_input, -1, Role.INPUT)
        w8 = mm.cast(weight_t, "weight", c.cast_config_weight, 0, Role.WEIGHT)
        shape = x8.shape
        out = torch.mm(x8.reshape(-1, shape[-1]), w8)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        from torchao.float8 import GemmInputRole as Role

        x, weight_t = ctx.saved_tensors
        mm = ctx.mm
        c = mm.config
        g = grad.reshape(-1, grad.shape[-1])
        g8 = mm.cast(g, "grad_output", c.cast_config_grad_output, -1, Role.GRAD_OUTPUT)
        w8 = mm.cast(weight_t, "weight_for_grad_input", c.cast_config_weight_for_grad_input, -1, Role.WEIGHT)
        grad_x = torch.mm(g8, w8.t()).reshape(*grad.shape[:-1], weight_t.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        g8 = mm.cast(g, "grad_output_for_grad_weight", c.cast_config_grad_output_for_grad_weight, 0, Role.GRAD_OUTPUT)
        x8 = mm.cast(x2, "input_for_grad_weight", c.cast_config_input_for_grad_weight, 0, Role.INPUT)
        grad_weight = torch.mm(g8.t(), x8)
        return grad_x, grad_weight.t(), None
