"""`validate(config, world_size)`: every check that can be made before a process group exists.

Each failure is one sentence naming the key(s) and the fix. A key's own range and choices are
declared beside it in config/schema.py (`checked(...)`) and checked first; the rules here tie keys
together, or look at files (run folders here; data and tokenizer in config/validate_data.py). Checks
run in a fixed order so the first problem reported is the most basic one (a bad value before a
bad combination).
"""

from __future__ import annotations

import dataclasses

from fivefold.config.checks import check_fields
from fivefold.config.errors import ConfigError, require as _require
from fivefold.config.families import FAMILIES
from fivefold.config.lora import check_lora
from fivefold.config.pipeline_rules import micro_batch_problem, pipeline_problem
from fivefold.config.schedules import SPLIT_BACKWARD_SCHEDULES
from fivefold.config.schema import Config, ParallelConfig, micro_batches
from fivefold.config.validate_data import check_data
from fivefold.config.validate_optimizer import check_optimizer
from fivefold.config.validate_attention import check_family_keys
from fivefold.config.validate_run import check_checkpoint, check_ft, check_log, check_run_folders

DIMS = ("pp", "dp", "cp", "tp")


def _divisors(n: int) -> str:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))


def _one_of(key: str, value: str, choices) -> None:
    _require(value in choices, f"{key}='{value}' is not one of {', '.join(choices)}")


def _positive(key: str, value) -> None:
    _require(value > 0, f"{key} must be > 0, got {value}")


def _divides(key: str, degree: int, what: str, amount: int) -> None:
    if amount % degree:  # the message lists divisors: build it only when it is needed
        raise ConfigError(f"{key}={degree} does not divide {what}={amount}; choose a value among "
                          f"{_divisors(amount)}")


def _check_model(cfg: Config) -> None:
    m = cfg.model
    _one_of("model.family", m.family, FAMILIES)
    check_family_keys(cfg)  # keys only some families implement; windows and sinks under cp
    _check_latent_attention(m)  # first: its head_dim sentence is more precise than the generic one
    if m.head_dim == m.dim // m.n_heads:  # head_dim left to default: the heads must split dim exactly
        _divides("model.n_heads", m.n_heads, "model.dim", m.dim)
    _divides("model.n_kv_heads", m.n_kv_heads, "model.n_heads", m.n_heads)
    _positive("model.head_dim", m.head_dim)
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for RoPE; set model.head_dim "
             "(or change model.dim or model.n_heads)")
    if m.rope_scaling > 0:  # Llama 3.1 interpolates between the two factors' wavelengths: they need an order
        _require(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor="
                 f"{m.rope_high_freq_factor} must exceed model.rope_low_freq_factor={m.rope_low_freq_factor} "
                 "(Llama 3.1 uses 4 and 1)")
    e = m.moe
    if e.n_experts > 0:
        _require(1 <= e.top_k <= e.n_experts,
                 f"model.moe.top_k={e.top_k} must be between 1 and model.moe.n_experts={e.n_experts}")
        _require(e.first_dense < m.n_layers, f"model.moe.first_dense={e.first_dense} must be "
                 f"between 0 and model.n_layers-1={m.n_layers - 1}")
        _check_dense_layers(e.dense_layers, m.n_layers)
        _check_group_routing(e)


def _check_group_routing(e) -> None:
    _divides("model.moe.n_group", e.n_group, "model.moe.n_experts", e.n_experts)
    _require(1 <= e.topk_group <= e.n_group, f"model.moe.topk_group={e.topk_group} must be between 1 and "
             f"model.moe.n_group={e.n_group}")
    reachable = e.n_experts // e.n_group * e.topk_group
    _require(e.top_k <= reachable, f"model.moe.top_k={e.top_k} exceeds the {reachable} experts of "
             f"model.moe.topk_group={e.topk_group} groups of model.moe.n_experts/n_group="
             f"{e.n_experts // e.n_group}; raise model.moe.topk_group or lower model.moe.top_k")


def _check_latent_attention(m) -> None:
    """Multi-head latent attention exists in the deepseek_v3 family only, and it needs both
    latent-attention head dims and a kv latent (YaRN's families: config/families.py)."""
    mla = {"kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
           "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}
    if m.family != "deepseek_v3":  # YaRN: config/validate_attention.py
        for key, value in mla.items():
            _require(not value, f"model.{key}={value} is a latent-attention / YaRN key, which only "
                     f"model.family=deepseek_v3 implements (model.family={m.family}); remove it")
        return
    for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        _positive(f"model.{key}", mla[key])
    _require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE")
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    _require(m.head_dim == qk, f"model.head_dim={m.head_dim} must be the q/k head dim model.qk_nope_head_dim"
             f"+qk_rope_head_dim={qk} under latent attention; leave model.head_dim unset (0)")
    _require(m.n_kv_heads == m.n_heads, f"model.n_kv_heads={m.n_kv_heads} must equal model.n_heads={m.n_heads}: "
             "latent attention expands keys and values for every head")


def _check_dense_layers(text: str, n_layers: int) -> None:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    _require(all(p.isdigit() and int(p) < n_layers for p in parts),
             f"model.moe.dense_layers='{text}' must list layer indices below model.n_layers={n_layers}, "
             "separated by commas (e.g. '0,5')")


def _check_train(cfg: Config) -> None:
    t, m = cfg.train, cfg.model
    _require(t.seq_len <= m.max_seq_len, f"train.seq_len={t.seq_len} exceeds model.max_seq_len="
             f"{m.max_seq_len}; lower train.seq_len or raise model.max_seq_len")
    if t.fp8:
        _require(t.dtype == "bf16", f"train.fp8='{t.fp8}' needs train.dtype = bf16 (FP8 matmuls inside bf16 "
                 f"compute over fp32 master weights, as torchtitan trains), got train.dtype = {t.dtype}; "
                 "set train.dtype = bf16")


def _check_parallel(cfg: Config, world_size: int | None) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.dp_shard and p.dp:
        _divides("parallel.dp_shard", p.dp_shard, "parallel.dp", p.dp)
        _require(p.dp_shard == p.dp or p.zero > 0, "parallel.dp_shard < parallel.dp (HSDP) needs "
                 "parallel.zero >= 1: there is nothing to shard at zero 0")
    order = [d.strip() for d in p.order.split(",")]
    _require(sorted(order) == sorted(DIMS), f"parallel.order='{p.order}' must name each of "
             f"{', '.join(DIMS)} once, outermost first (e.g. 'pp,dp,cp,tp')")
    # dp and cp form one flattened mesh view (the ranks reducing gradients), which DeviceMesh can
    # only take in mesh order.
    _require(order.index("dp") < order.index("cp"), f"parallel.order='{p.order}' puts cp outside dp, "
             "which the data-parallel mesh cannot flatten; put dp before cp (e.g. 'pp,dp,cp,tp')")

    if world_size is not None and p.dp:
        product = p.dp * p.tp * p.pp * p.cp
        _require(product == world_size, f"parallel.dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {product} "
                 f"but the job has {world_size} ranks; make the degrees multiply to {world_size}")

    _divides("parallel.tp", p.tp, "model.n_heads", m.n_heads)
    _divides("parallel.tp", p.tp, "model.n_kv_heads", m.n_kv_heads)
    _divides("parallel.tp", p.tp, "model.ffn_dim", m.ffn_dim)
    _divides("parallel.tp", p.tp, "model.vocab_size", m.vocab_size)  # vocab-parallel embedding/output
    if p.cp > 1:
        _require(t.seq_len % (2 * p.cp) == 0, f"train.seq_len={t.seq_len} is not divisible by "
                 f"2*parallel.cp={2 * p.cp} (context parallelism cuts each sequence into 2*cp equal "
                 "chunks); change train.seq_len or parallel.cp")
        if p.cp_method == "ulysses":  # tp divides n_heads: checked above
            heads = m.n_heads // p.tp
            _require(heads % p.cp == 0, f"parallel.cp_method='ulysses' splits the {heads} heads per "
                     f"tensor-parallel rank (model.n_heads/parallel.tp) over parallel.cp={p.cp}, which "
                     f"does not divide them; choose parallel.cp among {_divisors(heads)} or "
                     "cp_method 'ring' or 'allgather'")
    if p.tp > 1 and p.sp:
        _require(t.seq_len % (p.tp * p.cp) == 0, f"train.seq_len={t.seq_len} is not divisible by "
                 f"parallel.tp*cp={p.tp * p.cp}, which sequence parallelism needs; change train.seq_len "
                 "or set parallel.sp=false")

    _check_pipeline(cfg)

    # Batch arithmetic (docs/design.md): global_batch = dp * micro_batch * micro-batches per step.
    if p.dp:  # dp = 0 is resolved from the world size at launch (resolve_dp); until then nothing to check
        _check_batch(p, t)
    _check_experts(cfg, world_size)


def _check_batch(p, t) -> None:
    _divides("parallel.dp", p.dp, "train.global_batch", t.global_batch)
    if t.micro_batch:
        per_rank = t.global_batch // p.dp
        _require(per_rank % t.micro_batch == 0, f"train.micro_batch={t.micro_batch} does not divide the "
                 f"per-rank batch train.global_batch/parallel.dp = {per_rank}; choose a divisor of {per_rank}")


def _check_experts(cfg: Config, world_size: int | None) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.ep > 1:
        _require(m.moe.n_experts > 0, f"parallel.ep={p.ep} needs an MoE model; set model.moe.n_experts "
                 "(or a preset such as 'tiny-moe'), or parallel.ep=1")
        _divides("parallel.ep", p.ep, "model.moe.n_experts", m.moe.n_experts)
        if world_size is not None and p.dp:  # a launch: the degrees are final (`config show` may set ep alone)
            # ep borrows its ranks from dp·cp, and may borrow tp.
            _divides("parallel.ep", p.ep, "parallel.dp*cp*tp", p.dp * p.cp * p.tp)
    if p.ep_replicas > 0:  # hot-expert replicas (parallel/expert/replicas.py)
        _require(p.ep > 1, f"parallel.ep_replicas={p.ep_replicas} copies experts between expert-parallel "
                 "ranks and needs parallel.ep > 1; set parallel.ep or parallel.ep_replicas=0")
        _require(p.zero != 3, f"parallel.ep_replicas={p.ep_replicas} copies whole experts after each "
                 f"step, which parallel.zero={p.zero} shards; use parallel.zero 0, 1 or 2, or parallel.ep_replicas=0")
        # Replica gradients travel to their owners inside backward; a split weight pass is not tested.
        _require(not (p.pp > 1 and p.pp_schedule in SPLIT_BACKWARD_SCHEDULES),
                 f"parallel.ep_replicas={p.ep_replicas} is not available with parallel.pp_schedule="
                 f"'{p.pp_schedule}' (its split weight pass); use '1f1b' or 'interleaved_1f1b', or "
                 "parallel.ep_replicas=0")
    if m.moe.n_experts > 0 and p.tp > 1:
        # MoE layers route a 1/tp slice of each rank's sequence on each tp rank (parallel/tensor/apply.py);
        # with sequence parallelism that is the stream's own split, checked above.
        _require(t.seq_len % (p.tp * p.cp) == 0, f"train.seq_len={t.seq_len} is not divisible by "
                 f"parallel.tp*cp={p.tp * p.cp}: the MoE layers split each rank's sequence over the tp "
                 "ranks; change train.seq_len or parallel.tp")
        if p.cp > 1 and m.moe.capacity_factor > 0:
            # Capacity ranks assignments by position in the whole sequence, counted per piece:
            # each of the 2·cp context-parallel chunks cut into tp equal pieces (models/moe/layer.py).
            n = 2 * p.cp * p.tp
            _require(t.seq_len % n == 0, f"train.seq_len={t.seq_len} is not divisible by 2*parallel.cp*tp={n}, "
                     "which model.moe.capacity_factor > 0 needs under both context and tensor parallelism "
                     "(each of the 2*cp chunks is cut into tp pieces); change train.seq_len, or set "
                     "model.moe.capacity_factor=0 (dropless)")


def _check_pipeline(cfg: Config) -> None:
    """Stages, virtual stages, the layer split and what each schedule needs (config/pipeline_rules.py,
    which the planner's search reads too), said before any process starts."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    problem = pipeline_problem(p.pp, p.pp_virtual, p.pp_schedule, m.n_layers, p.pp_layers, t.recompute,
                               t.eval_every, m.mtp_depth, m.tie_embeddings)
    if problem:
        raise ConfigError(problem)
    if p.pp == 1 or not p.dp or t.global_batch % p.dp or (t.micro_batch and (t.global_batch // p.dp) % t.micro_batch):
        return  # the batch arithmetic check below names that problem (dp = 0: once resolved)
    fix = (f"lower train.micro_batch (now {t.micro_batch or t.global_batch // p.dp} sequences) or raise "
           "train.global_batch")
    problem = micro_batch_problem(p.pp, p.pp_virtual, p.pp_schedule, micro_batches(cfg), fix)
    if problem:
        raise ConfigError(problem)


def ignored_options(p) -> dict[str, str]:
    """Parallel keys set away from their default that do nothing for this layout: key -> why.
    `p` is a ParallelConfig or a planner Layout (the same key names and defaults)."""
    default = ParallelConfig()
    rules = [("zero", p.dp * p.cp == 1, "dp*cp=1: nothing to shard"),
             ("dp_shard", p.dp_shard == p.dp, "equal to parallel.dp: all of dp, the default"),
             ("sp", p.tp == 1, "tp=1"),
             ("pp_schedule", p.pp == 1, "pp=1"),
             ("pp_virtual", p.pp == 1, "pp=1"),
             ("pp_layers", p.pp == 1, "pp=1"),
             ("cp_method", p.cp == 1, "cp=1")]
    return {key: why for key, unused, why in rules if unused and getattr(p, key) != getattr(default, key)}


def ignored_note(cfg: Config) -> str | None:
    """One line naming the options this layout ignores (printed once before training), or None."""
    ignored = ignored_options(cfg.parallel)
    listed = ", ".join(f"parallel.{key}={getattr(cfg.parallel, key)!r} ({why})" for key, why in ignored.items())
    return f"ignored for this layout: {listed}" if ignored else None


def resolve_dp(cfg: Config, world_size: int | None) -> None:
    """parallel.dp = 0 takes the data-parallel degree the world size leaves after tp·pp·cp (set in
    place: from here on the config is the launched layout). Elastic restarts on fewer or more ranks
    keep the global batch: each rank's share, and so its micro-batches, follow dp."""
    p = cfg.parallel
    if p.dp or world_size is None:
        return
    fixed = p.tp * p.pp * p.cp
    _require(world_size % fixed == 0, f"parallel.dp=0 takes dp from the world size, but the job's {world_size} "
             f"ranks are not a multiple of parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {fixed}; launch a "
             f"multiple of {fixed} ranks or set parallel.dp")
    p.dp = world_size // fixed


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise ConfigError on the first problem; return the config when it is sound (unchanged, but
    for parallel.dp = 0, which becomes the degree the world size leaves: resolve_dp). The rules
    that need the model's classes follow in fivefold.configure.validate, which callers use."""
    for section in dataclasses.fields(cfg):  # each key's own range and choices (config/schema.py declares them)
        check_fields(getattr(cfg, section.name), section.name)
    resolve_dp(cfg, world_size)
    _check_model(cfg)
    _check_train(cfg)
    _check_parallel(cfg, world_size)
    check_optimizer(cfg)
    check_lora(cfg)
    check_data(cfg)
    check_checkpoint(cfg)
    check_log(cfg, world_size)
    check_ft(cfg)
    if world_size is not None:  # a launch writes there (`config show` and `plan` write nothing)
        check_run_folders(cfg)
    return cfg


def check_backend(backend: str, cuda: bool) -> None:
    """parallel.backend against this machine: the training tensors live on its GPUs when it has any."""
    if cuda:
        # gloo moves CUDA tensors for all-reduce and broadcast only (not send/recv, all-to-all, ...).
        _require(backend != "gloo", "parallel.backend=gloo cannot run the collectives of CUDA tensors "
                 "(point-to-point, all-to-all, reduce-scatter); use auto or nccl, or hide the GPUs "
                 "(CUDA_VISIBLE_DEVICES='') to train on CPU")
    else:
        _require(backend in ("auto", "gloo"), f"parallel.backend={backend} needs CUDA GPUs; this machine "
                 "has none: use gloo or auto")
