"""`validate(config, world_size)`: every check that can be made before a process group exists.

Each failure is one sentence naming the key(s) and the fix. Checks run in a fixed order so the
first problem reported is the most basic one (a bad value before a bad combination).
"""

from __future__ import annotations

from pathlib import Path

from fivefold.config import Config, ConfigError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb", "zbv", "dualpipev")
CP_METHODS = ("ring", "allgather", "ulysses")
BACKENDS = ("auto", "nccl", "gloo", "cpu:gloo,cuda:nccl")  # torch.distributed names; auto: runtime.py
DIMS = ("pp", "dp", "cp", "tp")


def _divisors(n: int) -> str:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
                "rope_theta", "norm_eps"):
        _positive(f"model.{key}", getattr(m, key))
    from fivefold.models.registry import FAMILIES

    _one_of("model.family", m.family, FAMILIES)
    _check_latent_attention(m)  # first: its head_dim sentence is more precise than the generic one
    if m.head_dim == m.dim // m.n_heads:  # head_dim left to default: the heads must split dim exactly
        _divides("model.n_heads", m.n_heads, "model.dim", m.dim)
    _divides("model.n_kv_heads", m.n_kv_heads, "model.n_heads", m.n_heads)
    _positive("model.head_dim", m.head_dim)
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for RoPE; set model.head_dim "
             "(or change model.dim or model.n_heads)")
    _require(m.rope_scaling >= 0, f"model.rope_scaling must be >= 0 (0 = off), got {m.rope_scaling}")
    e = m.moe
    if e.n_experts < 0:
        raise ConfigError(f"model.moe.n_experts must be >= 0 (0 = dense), got {e.n_experts}")
    if e.n_experts > 0:
        _require(1 <= e.top_k <= e.n_experts,
                 f"model.moe.top_k={e.top_k} must be between 1 and model.moe.n_experts={e.n_experts}")
        _one_of("model.moe.score", e.score, ("softmax", "sigmoid"))
        _one_of("model.moe.balance", e.balance, ("aux_loss", "bias", "none"))
        _require(e.capacity_factor >= 0, "model.moe.capacity_factor must be > 0, or 0 for dropless; "
                 f"got {e.capacity_factor}")
        _positive("model.moe.every", e.every)
        _require(0 <= e.first_dense < m.n_layers, f"model.moe.first_dense={e.first_dense} must be "
                 f"between 0 and model.n_layers-1={m.n_layers - 1}")
        _check_dense_layers(e.dense_layers, m.n_layers)
        _check_group_routing(e)


def _check_group_routing(e) -> None:
    _positive("model.moe.n_group", e.n_group)
    _divides("model.moe.n_group", e.n_group, "model.moe.n_experts", e.n_experts)
    _require(1 <= e.topk_group <= e.n_group, f"model.moe.topk_group={e.topk_group} must be between 1 and "
             f"model.moe.n_group={e.n_group}")
    reachable = e.n_experts // e.n_group * e.topk_group
    _require(e.top_k <= reachable, f"model.moe.top_k={e.top_k} exceeds the {reachable} experts of "
             f"model.moe.topk_group={e.topk_group} groups of model.moe.n_experts/n_group="
             f"{e.n_experts // e.n_group}; raise model.moe.topk_group or lower model.moe.top_k")
    _require(e.routed_scaling_factor > 0, f"model.moe.routed_scaling_factor must be > 0, got "
             f"{e.routed_scaling_factor}")


def _check_latent_attention(m) -> None:
    """Multi-head latent attention and YaRN exist in the deepseek_v3 family only, and it needs both
    latent-attention head dims and a kv latent."""
    mla = {"kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
           "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}
    if m.family != "deepseek_v3":
        for key, value in {**mla, "rope_yarn_factor": m.rope_yarn_factor}.items():
            _require(not value, f"model.{key}={value} is a latent-attention / YaRN key, which only "
                     f"model.family=deepseek_v3 implements (model.family={m.family}); remove it")
        return
    for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        _positive(f"model.{key}", mla[key])
    for key in ("q_lora_rank", "qk_nope_head_dim"):
        _require(mla[key] >= 0, f"model.{key} must be >= 0, got {mla[key]}")
    _require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE")
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    _require(m.head_dim == qk, f"model.head_dim={m.head_dim} must be the q/k head dim model.qk_nope_head_dim"
             f"+qk_rope_head_dim={qk} under latent attention; leave model.head_dim unset (0)")
    _require(m.n_kv_heads == m.n_heads, f"model.n_kv_heads={m.n_kv_heads} must equal model.n_heads={m.n_heads}: "
             "latent attention expands keys and values for every head")
    _require(m.rope_scaling == 0, f"model.rope_scaling={m.rope_scaling} (Llama 3.1 RoPE) is not available in "
             "model.family=deepseek_v3; use model.rope_yarn_factor, or set model.rope_scaling=0")
    _require(m.rope_yarn_factor >= 0, f"model.rope_yarn_factor must be >= 0 (0 = off), got {m.rope_yarn_factor}")
    if m.rope_yarn_factor > 0:
        _positive("model.rope_original_max_seq_len", m.rope_original_max_seq_len)
        _require(m.rope_yarn_beta_fast > m.rope_yarn_beta_slow > 0, "model.rope_yarn_beta_fast="
                 f"{m.rope_yarn_beta_fast} must exceed model.rope_yarn_beta_slow={m.rope_yarn_beta_slow} > 0")


def _check_dense_layers(text: str, n_layers: int) -> None:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    _require(all(p.isdigit() and int(p) < n_layers for p in parts),
             f"model.moe.dense_layers='{text}' must list layer indices below model.n_layers={n_layers}, "
             "separated by commas (e.g. '0,5')")


def _check_train(cfg: Config) -> None:
    t, m = cfg.train, cfg.model
    for key in ("steps", "seq_len", "global_batch", "lr"):
        _positive(f"train.{key}", getattr(t, key))
    _require(t.micro_batch >= 0, f"train.micro_batch must be >= 0 (0 = whole per-rank batch), got {t.micro_batch}")
    _require(t.warmup >= 0, f"train.warmup must be >= 0, got {t.warmup}")
    _require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be between 0 and 1, got {t.min_lr_ratio}")
    _require(0 < t.decay_fraction <= 1, f"train.decay_fraction must be in (0, 1], got {t.decay_fraction}")
    _require(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = off), got {t.grad_clip}")
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0 (0 = off), got {t.eval_every}")
    _one_of("train.schedule", t.schedule, ("cosine", "wsd", "constant"))
    _one_of("train.dtype", t.dtype, ("fp32", "bf16"))
    _one_of("train.recompute", t.recompute, ("none", "selective", "full"))
    _require(t.seq_len <= m.max_seq_len, f"train.seq_len={t.seq_len} exceeds model.max_seq_len="
             f"{m.max_seq_len}; lower train.seq_len or raise model.max_seq_len")


def _check_parallel(cfg: Config, world_size: int | None) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for key in ("dp", "tp", "pp", "cp", "ep", "pp_virtual", "timeout_s", "gpus_per_node"):
        _positive(f"parallel.{key}", getattr(p, key))
    _require(p.zero in (0, 1, 2, 3), f"parallel.zero={p.zero} is outside 0-3 (0 replicate, 1 shard "
             "optimizer state, 2 also gradients, 3 also parameters)")
    _require(p.dp_shard >= 0, f"parallel.dp_shard must be >= 0 (0 = all of dp), got {p.dp_shard}")
    if p.dp_shard:
        _divides("parallel.dp_shard", p.dp_shard, "parallel.dp", p.dp)
        _require(p.dp_shard == p.dp or p.zero > 0, "parallel.dp_shard < parallel.dp (HSDP) needs "
                 "parallel.zero >= 1: there is nothing to shard at zero 0")
    _one_of("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES)
    _one_of("parallel.cp_method", p.cp_method, CP_METHODS)
    _one_of("parallel.backend", p.backend, BACKENDS)
    order = [d.strip() for d in p.order.split(",")]
    _require(sorted(order) == sorted(DIMS), f"parallel.order='{p.order}' must name each of "
             f"{', '.join(DIMS)} once, outermost first (e.g. 'pp,dp,cp,tp')")
    # dp and cp form one flattened mesh view (the ranks reducing gradients), which DeviceMesh can
    # only take in mesh order.
    _require(order.index("dp") < order.index("cp"), f"parallel.order='{p.order}' puts cp outside dp, "
             "which the data-parallel mesh cannot flatten; put dp before cp (e.g. 'pp,dp,cp,tp')")

    if world_size is not None:
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

    # Batch arithmetic (DESIGN.md): global_batch = dp * micro_batch * micro-batches per step.
    _divides("parallel.dp", p.dp, "train.global_batch", t.global_batch)
    if t.micro_batch:
        per_rank = t.global_batch // p.dp
        _require(per_rank % t.micro_batch == 0, f"train.micro_batch={t.micro_batch} does not divide the "
                 f"per-rank batch train.global_batch/parallel.dp = {per_rank}; choose a divisor of {per_rank}")

    if p.ep > 1:
        _require(m.moe.n_experts > 0, f"parallel.ep={p.ep} needs an MoE model; set model.moe.n_experts "
                 "(or a preset such as 'tiny-moe'), or parallel.ep=1")
        _divides("parallel.ep", p.ep, "model.moe.n_experts", m.moe.n_experts)
        if world_size is not None:  # a launch: the degrees are final (`config show` may set ep alone)
            # ep borrows its ranks from dp·cp, and may borrow tp.
            _divides("parallel.ep", p.ep, "parallel.dp*cp*tp", p.dp * p.cp * p.tp)



def _check_pipeline(cfg: Config) -> None:
    """Stages, virtual stages, the layer split and what each schedule needs (torch.distributed.
    pipelining's own requirements, said in our terms before any process starts)."""
    from fivefold.config import micro_batches
    from fivefold.parallel.pipeline_split import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, parse_layer_counts

    p, m, t = cfg.parallel, cfg.model, cfg.train
    name, v = p.pp_schedule, p.pp_virtual
    if p.pp == 1:
        return  # no pipeline: its keys are ignored, and reported so (ignored_options)
    if name in SINGLE_STAGE_SCHEDULES:
        _require(v == 1, f"parallel.pp_schedule='{name}' runs one stage per rank, so parallel.pp_virtual "
                 f"must be 1, got {v}; use 'interleaved_1f1b' or 'zb' for virtual stages")
    elif name in V_SCHEDULES:
        _require(v == 2, f"parallel.pp_schedule='{name}' runs two stages per rank in a V, so "
                 f"parallel.pp_virtual must be 2, got {v}")
    else:
        _require(v >= 2, f"parallel.pp_schedule='{name}' interleaves virtual stages: set "
                 f"parallel.pp_virtual >= 2 (got {v}), or use '1f1b'")
    n_stages = p.pp * v
    _require(n_stages <= m.n_layers, f"parallel.pp*pp_virtual = {n_stages} stages exceed model.n_layers="
             f"{m.n_layers}; every stage needs at least one layer")
    if p.pp_layers:
        try:
            counts = parse_layer_counts(p.pp_layers)
        except ValueError:
            raise ConfigError(f"parallel.pp_layers='{p.pp_layers}' must be comma-separated layer counts, "
                              "e.g. '3,5'") from None
        _require(len(counts) == n_stages, f"parallel.pp_layers='{p.pp_layers}' has {len(counts)} entries "
                 f"but there are parallel.pp*pp_virtual = {n_stages} stages")
        _require(sum(counts) == m.n_layers, f"parallel.pp_layers='{p.pp_layers}' adds up to {sum(counts)} "
                 f"layers but model.n_layers={m.n_layers}")
        _require(min(counts) >= 1, f"parallel.pp_layers='{p.pp_layers}' gives a stage no layer; every "
                 "stage needs at least one")
    if t.global_batch % p.dp or (t.micro_batch and (t.global_batch // p.dp) % t.micro_batch):
        return  # the batch arithmetic check below names that problem
    n_micro = micro_batches(cfg)
    fix = (f"lower train.micro_batch (now {t.micro_batch or t.global_batch // p.dp} sequences) or raise "
           "train.global_batch")
    if name in ("1f1b", "dualpipev"):
        _require(n_micro >= n_stages, f"parallel.pp_schedule='{name}' needs at least as many micro-batches "
                 f"as stages ({n_stages}) but a step has {n_micro}; {fix}")
    if name in ("interleaved_1f1b", "zb"):
        rounds = max(1, n_micro // p.pp)
        _require(n_micro % rounds == 0, f"parallel.pp_schedule='{name}' runs micro-batches in rounds of "
                 f"parallel.pp={p.pp}: {n_micro} micro-batches per step must be fewer than pp or a "
                 f"multiple of pp; {fix}")


def _check_data(cfg: Config) -> None:
    d, m = cfg.data, cfg.model
    _require(0 <= d.val_fraction < 0.5, f"data.val_fraction must be in [0, 0.5), got {d.val_fraction}")
    if d.mix or (Path(d.source) / "manifest.json").is_file():  # a prepared folder (token_shards.py)
        _check_prepared_data(cfg)
        return
    if d.source != "builtin":
        _require(Path(d.source).exists(), f"data.source '{d.source}' does not exist; give a text/jsonl/"
                 "parquet file or folder, or 'builtin'")
    if d.tokenizer == "byte":
        _require(m.vocab_size >= 256, f"model.vocab_size={m.vocab_size} is too small for the byte "
                 "tokenizer; it needs at least 256")
    else:
        _require(Path(d.tokenizer).is_file(), f"data.tokenizer '{d.tokenizer}' is not a file; give a "
                 "Hugging Face tokenizer.json or 'byte'")
        from tokenizers import Tokenizer

        n_tokens = Tokenizer.from_file(d.tokenizer).get_vocab_size()
        _require(n_tokens <= m.vocab_size, f"the tokenizer has {n_tokens} tokens but model.vocab_size="
                 f"{m.vocab_size}; raise model.vocab_size to at least {n_tokens}")


def _check_prepared_data(cfg: Config) -> None:
    """data.source = a prepared folder, or data.mix = several: the tokenizer is the manifest's."""
    from fivefold.train.mixture import parse_mix
    from fivefold.train.token_shards import read_manifest

    d, m = cfg.data, cfg.model
    _require(not d.mix or d.source == "builtin", f"data.mix and data.source='{d.source}' are both set; "
             "give the folders and their weights in data.mix alone")
    folders = [folder for folder, _ in parse_mix(d.mix)] if d.mix else [d.source]
    tokenizers = {}
    for folder in folders:
        key = "data.mix" if d.mix else "data.source"
        _require(Path(folder).is_dir(), f"{key} folder '{folder}' does not exist; make it with "
                 f"`fivefold prepare SRC --out {folder}`")
        tokenizer = read_manifest(folder)["tokenizer"]
        _require(tokenizer["vocab_size"] <= m.vocab_size, f"'{folder}' was prepared with a tokenizer of "
                 f"{tokenizer['vocab_size']} tokens but model.vocab_size={m.vocab_size}; raise model.vocab_size "
                 f"to at least {tokenizer['vocab_size']}")
        tokenizers[folder] = tokenizer
    labels = {f: t["name"] + (f" sha256 {t['sha256'][:12]}" if "sha256" in t else "") for f, t in tokenizers.items()}
    _require(len(set(labels.values())) == 1, "data.mix folders were prepared with different tokenizers (" +
             ", ".join(f"{f}: {label}" for f, label in labels.items()) + "); prepare them all with the same one")


def _check_checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    _require(c.every >= 0, f"checkpoint.every must be >= 0 (0 = never), got {c.every}")
    _require(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    _require(c.resume in ("none", "auto") or Path(c.resume).exists(),
             f"checkpoint.resume='{c.resume}' must be none, auto, or an existing checkpoint folder")
    _require(c.every == 0 or c.dir or cfg.log.dir, "checkpoint.every > 0 needs checkpoint.dir or log.dir "
             "to say where checkpoints go")
    _require(cfg.train.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {cfg.train.max_bad_steps}")


def ignored_options(p) -> dict[str, str]:
    """Parallel keys set away from their default that do nothing for this layout: key -> why.
    `p` is a ParallelConfig or a planner Layout (the same key names and defaults)."""
    from fivefold.config import ParallelConfig

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


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise ConfigError on the first problem; return the config unchanged when it is sound."""
    _check_model(cfg)
    _check_train(cfg)
    _check_parallel(cfg, world_size)
    _check_data(cfg)
    _check_checkpoint(cfg)
    return cfg


def check_supported(cfg: Config) -> None:
    """Training-only refusals of what the config language has but the trainer does not do yet, or
    this machine cannot run (parallel.backend).

    The planner evaluates these layouts; the trainer refuses them instead of ignoring them.
    """
    import torch

    from fivefold.models.registry import model_spec

    p, m = cfg.parallel, cfg.model
    model_spec(m).check(m)
    check_backend(p.backend, torch.cuda.is_available())
    if p.ep > 1:
        _require(p.dp * p.cp % p.ep == 0, f"parallel.ep={p.ep} must divide parallel.dp*cp={p.dp * p.cp} "
                 "for training (experts borrowing tensor-parallel ranks is not available yet); choose "
                 f"parallel.ep among {_divisors(p.dp * p.cp)}")


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
