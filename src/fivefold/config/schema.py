"""Configuration: one dataclass per TOML section, each key with its default, its accepted values
(`checked(...)`, config/checks.py) and a comment that `fivefold train --help` shows.

Loading (TOML, `--section.key value` overrides, presets) lives in config/load.py and validation
across keys in config/validate.py (callers use both through fivefold.configure). Every problem is reported as a `ConfigError`
holding one sentence that names the key and the fix; the CLI prints that sentence and exits, so no
traceback reaches the user for a bad config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fivefold.config.checks import checked
from fivefold.config.schedules import PP_SCHEDULES


# Choices of the parallel keys.
CP_METHODS = ("ring", "allgather", "ulysses")
BACKENDS = ("auto", "nccl", "gloo", "cpu:gloo,cuda:nccl")  # torch.distributed names; auto: runtime.py
FABRICS = ("full_bisection", "tapered")  # cluster.fabric
MLP_ACTIVATIONS = ("swiglu", "gelu", "relu2")  # model.mlp_activation
ZERO_STAGES = "0 replicate, 1 shard optimizer state, 2 also gradients, 3 also parameters"


@dataclass
class MoEConfig:
    n_experts: int = checked(0, ge=0, note="0 = dense")  # 0 = dense model
    top_k: int = checked(2, gt=0)  # experts each token is routed to (at most n_experts)
    n_shared_experts: int = checked(0, ge=0)
    every: int = checked(1, gt=0)  # an MoE layer every `every` layers (after the first `first_dense`)
    first_dense: int = checked(0, ge=0)
    expert_ffn_dim: int = checked(0, ge=0, note="0 = model.ffn_dim")  # 0 = model.ffn_dim
    score: str = checked("softmax", choices=("softmax", "sigmoid"))  # softmax | sigmoid
    balance: str = checked("aux_loss", choices=("aux_loss", "bias", "none"))  # aux_loss | bias | none
    aux_loss_coeff: float = checked(0.01, ge=0)
    bias_update_rate: float = checked(0.001, ge=0)
    capacity_factor: float = checked(0.0, ge=0, note="0 = dropless")  # 0 = dropless
    norm_topk_prob: bool = True  # renormalise the top-k combine weights to sum to 1 (when top_k > 1)
    dense_layers: str = ""  # e.g. "0,5": layers kept dense whatever `every`/`first_dense` say (Qwen's mlp_only_layers)
    # Group-limited routing (DeepSeek-V3): experts in n_group equal groups, each token choosing among the
    # topk_group groups whose two best (biased) scores sum highest; 1 and 1 = no grouping.
    n_group: int = checked(1, gt=0)
    topk_group: int = checked(1, gt=0)
    routed_scaling_factor: float = checked(1.0, gt=0)  # multiplies the routed experts' combine weights (after renormalising)
    # gpt-oss's router and experts (model.family=gpt_oss; config/families.py says who implements what).
    router_bias: bool = False  # a learned bias on the router's logits
    projection_bias: bool = False  # a learned bias on every expert's gate, up and down projections
    # swiglu: silu(gate)·up; clamped_swiglu (gpt-oss): gate clamped above and up on both sides at
    # swiglu_limit, then gate·sigmoid(swiglu_alpha·gate)·(up + 1)
    activation: str = checked("swiglu", choices=("swiglu", "clamped_swiglu"))
    swiglu_alpha: float = checked(1.702, gt=0)  # clamped_swiglu's sigmoid gain (gpt-oss: 1.702)
    swiglu_limit: float = checked(7.0, gt=0)  # clamped_swiglu's clamp (gpt-oss: 7.0)


@dataclass
class ModelConfig:
    preset: str = "tiny"
    # The ModelSpec (models/registry.py): llama, mixtral, qwen3, qwen3_moe, deepseek_v3, gpt_oss. Empty = from the preset,
    # or llama for a dense model and mixtral for an MoE one.
    family: str = ""
    dim: int = checked(128, gt=0)
    n_layers: int = checked(4, gt=0)
    n_heads: int = checked(4, gt=0)
    n_kv_heads: int = checked(2, gt=0)
    head_dim: int = checked(0, ge=0, note="0 = dim // n_heads")  # 0 = dim // n_heads (Qwen3 sets it explicitly: its heads need not add up to dim)
    ffn_dim: int = checked(384, gt=0)
    # The dense feed-forward: swiglu w2(silu(w1 x) · w3 x), three matrices (Llama, Qwen); gelu
    # w2(gelu(w1 x)) (GPT-3, BLOOM); relu2 w2(relu(w1 x)²) (Nemotron-4): two matrices.
    mlp_activation: str = checked("swiglu", choices=MLP_ACTIVATIONS)
    vocab_size: int = checked(256, gt=0)
    tie_embeddings: bool = True
    rope_theta: float = checked(10000.0, gt=0)
    norm_eps: float = checked(1e-5, gt=0)
    max_seq_len: int = checked(1024, gt=0)
    # Llama 3.1 RoPE frequency scaling; rope_scaling = 0 turns it off.
    rope_scaling: float = checked(0.0, ge=0, note="0 = off")
    rope_low_freq_factor: float = checked(1.0, gt=0)
    rope_high_freq_factor: float = checked(4.0, gt=0)
    rope_original_max_seq_len: int = checked(8192, gt=0)  # also YaRN's original context
    # YaRN RoPE scaling (deepseek_v3, gpt_oss), as Hugging Face's config writes it; rope_yarn_factor = 0 turns it off.
    rope_yarn_factor: float = checked(0.0, ge=0, note="0 = off")
    rope_yarn_beta_fast: float = checked(32.0, gt=0)
    rope_yarn_beta_slow: float = checked(1.0, gt=0)
    rope_yarn_mscale: float = checked(0.0, ge=0, note="0 = unset")  # 0 = unset (Hugging Face's null)
    rope_yarn_mscale_all_dim: float = checked(0.0, ge=0, note="0 = unset")  # 0 = unset; set, it also scales the softmax by its mscale squared
    rope_yarn_truncate: bool = True  # YaRN: round the ramp's ends to whole channel pairs (DeepSeek); gpt-oss: false
    # Multi-head latent attention (deepseek_v3; kv_lora_rank = 0 elsewhere): keys and values expanded
    # per head from a kv_lora_rank latent, plus one qk_rope_head_dim RoPE key shared by all heads;
    # queries through a q_lora_rank latent (0 = one direct projection, as in DeepSeek-V2-Lite).
    # head_dim is then the q/k head dim, qk_nope_head_dim + qk_rope_head_dim.
    q_lora_rank: int = checked(0, ge=0)
    kv_lora_rank: int = checked(0, ge=0)
    qk_nope_head_dim: int = checked(0, ge=0)
    qk_rope_head_dim: int = checked(0, ge=0)
    v_head_dim: int = checked(0, ge=0)
    # Attention variants (model.family=gpt_oss; config/families.py says who implements what).
    sliding_window: int = checked(0, ge=0, note="0 = off")  # keys a query of a sliding layer sees, itself included; 0 = full causal attention everywhere
    full_attention_every: int = checked(0, ge=0, note="0 = none")  # with sliding_window: layers N-1, 2N-1, ... see every earlier key (gpt-oss: 2); 0 = every layer slides
    attention_sinks: bool = False  # one learned logit per head joins each query's softmax denominator (a key whose value is 0)
    attention_bias: bool = False  # learned biases on the q, k, v and output projections
    moe: MoEConfig = field(default_factory=MoEConfig)
    # Multi-token prediction (deepseek_v3, models/mtp.py): mtp_depth extra blocks after the last
    # layer, block k predicting the token k+1 places ahead; their mean loss, times mtp_loss_weight,
    # joins the LM loss in the gradients (DeepSeek-V3 trained with 0.3, then 0.1; `loss` stays the LM loss).
    mtp_depth: int = checked(0, ge=0, note="0 = off")
    mtp_loss_weight: float = checked(0.1, ge=0)
    # A Hugging Face folder (config.json + safetensors): the model's shape comes from its config.json
    # and a fresh run starts from its weights, each rank reading only the slices it holds.
    init_from: str = ""

    def __post_init__(self):
        # Derived defaults, fixed once the other keys are known (a config resolves in one go).
        if not self.head_dim and self.kv_lora_rank > 0:
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if not self.head_dim and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if not self.family:
            self.family = "mixtral" if self.moe.n_experts > 0 else "llama"


@dataclass
class ParallelConfig:
    # data-parallel degree (elastic when 0: the same config on fewer or more ranks, the global batch
    # kept by the number of micro-batches; config.validate.resolve_dp sets it at launch)
    dp: int = checked(1, ge=0, note="0 = the world size / (tp*pp*cp)")
    zero: int = checked(0, choices=(0, 1, 2, 3), note=ZERO_STAGES)  # 0 replicate, 1 shard optimizer, 2 + gradients, 3 + parameters (FSDP)
    dp_shard: int = checked(0, ge=0, note="0 = all of dp")  # HSDP: size of the sharded sub-group; 0 = all of dp
    tp: int = checked(1, gt=0)
    sp: bool = True  # sequence parallelism (only meaningful when tp > 1)
    # with sp and no recomputation: keep the gathered inputs of column-parallel layers for backward
    # (tp x their shard's memory; one all-gather less per sub-layer in backward) instead of the shard
    sp_keep_gathered: bool = False
    pp: int = checked(1, gt=0)
    pp_schedule: str = checked("1f1b", choices=PP_SCHEDULES)
    pp_virtual: int = checked(1, gt=0)
    pp_layers: str = ""  # e.g. "7,9,9,7"; empty = balance by estimated cost
    cp: int = checked(1, gt=0)
    cp_method: str = checked("ring", choices=CP_METHODS)
    ep: int = checked(1, gt=0)
    # Hot-expert replicas (parallel/expert/replicas.py): copies of the most loaded experts on the least
    # loaded ep ranks, re-planned from the measured load; derived state, never saved.
    ep_replicas: int = checked(0, ge=0, note="0 = off")  # replica slots per ep rank per MoE layer; 0 = off
    ep_rebalance_every: int = checked(100, gt=0)  # optimizer steps between replica re-plans
    order: str = "pp,dp,cp,tp"  # outermost to innermost
    timeout_s: float = checked(300.0, gt=0, le=1e9)  # every collective; a lost rank becomes an error, not a hang
    backend: str = checked("auto", choices=BACKENDS)  # auto | nccl | gloo | cpu:gloo,cuda:nccl (auto: the last on CUDA, gloo on CPU)
    gpus_per_node: int = checked(8, gt=0)

    def __post_init__(self):
        # The V schedules run exactly two stages per rank: pp_virtual left at its default 1 means
        # that (another explicit value is refused by fivefold.configure.validate).
        if self.pp > 1 and self.pp_schedule in ("zbv", "dualpipev") and self.pp_virtual == 1:
            self.pp_virtual = 2


@dataclass
class TrainConfig:
    steps: int = checked(300, gt=0)
    seed: int = checked(0, ge=0, lt=2**63)
    seq_len: int = checked(128, gt=0)
    global_batch: int = checked(16, gt=0)  # sequences per optimizer step
    micro_batch: int = checked(0, ge=0, note="0 = whole per-rank batch")  # sequences per micro-batch per dp rank; 0 = global_batch / dp
    lr: float = checked(3e-3, gt=0)
    min_lr_ratio: float = checked(0.1, ge=0, le=1)
    warmup: int = checked(20, ge=0)
    schedule: str = checked("cosine", choices=("cosine", "wsd", "constant"))  # cosine | wsd | constant
    decay_fraction: float = checked(0.2, gt=0, le=1)  # wsd: share of steps spent decaying
    weight_decay: float = checked(0.1, ge=0)
    # adamw | muon (Muon on the matrices inside the blocks, AdamW on the rest; docs/optimizers.md)
    optimizer: str = checked("adamw", choices=("adamw", "muon"))
    muon_momentum: float = checked(0.95, ge=0, lt=1)  # Muon's Nesterov momentum
    # original (sqrt(max(1, rows/cols))) | match_rms_adamw (0.2·sqrt(max(rows, cols)): AdamW's lr and decay carry over)
    muon_adjust_lr: str = checked("original", choices=("original", "match_rms_adamw"))
    # Newton–Schulz precision: bf16 is torch.optim.Muon's (and Moonlight's); fp32 removes bf16's
    # rounding from the orthogonalisation (its iteration amplifies a flipped bf16 rounding of its
    # input ~500x), what the layout-equality tests run to compare layouts exactly
    muon_ns_dtype: str = checked("bf16", choices=("bf16", "fp32"))
    # Per-group settings, 'SELECTOR: key=value, ...' separated by ';' (config/param_groups.py, docs/optimizers.md);
    # the default exempts norms, biases and embeddings from weight decay
    param_groups: str = "norm|bias|embedding:weight_decay=0"
    # QK-clip (Kimi K2's MuonClip): after each step, a head whose largest attention logit passed
    # this threshold has its query and key rows rescaled to bring it back (docs/optimizers.md)
    qk_clip: float = checked(0.0, ge=0, note="0 = off")
    beta1: float = checked(0.9, ge=0, lt=1)
    beta2: float = checked(0.95, ge=0, lt=1)
    # AdamW's epsilon: the update g/(sqrt(v) + eps) is most sensitive to a gradient's rounding,
    # by lr/eps, where the gradient is near eps (Megatron's --adam-eps, torchtitan's eps)
    adam_eps: float = checked(1e-8, gt=0)
    grad_clip: float = checked(1.0, ge=0, note="0 = off")  # 0 = off
    dtype: str = checked("fp32", choices=("fp32", "bf16"))  # fp32 | bf16 (bf16 compute, fp32 master weights and reductions)
    fp8: str = checked("", choices=("", "tensorwise", "rowwise"), note='"" = off')  # "" (off) | tensorwise | rowwise: dense projections in FP8 via torchao (needs dtype bf16)
    recompute: str = checked("none", choices=("none", "selective", "full"))  # none | selective | full
    # false | true (Inductor per block) | auto (true where the planner expects the run to win back
    # the compile time, plan/compile_choice.py); TOML's true/false are accepted too
    compile: str = checked("false", choices=("false", "true", "auto"))
    eval_every: int = checked(0, ge=0, note="0 = off")  # 0 = no evaluation
    eval_batches: int = checked(4, gt=0, when="eval_every")
    max_bad_steps: int = checked(3, ge=1)  # steps in a row with a non-finite loss/grad norm (skipped) before stopping


@dataclass
class DataConfig:
    source: str = "builtin"  # builtin | a prepared folder (fivefold prepare) | a .txt/.jsonl/.parquet file or folder
    mix: str = ""  # weighted prepared folders, "DIR_A:0.7,DIR_B:0.3" (instead of source)
    text_field: str = "text"  # jsonl/parquet column holding the text
    # byte | path to a Hugging Face tokenizer.json; unset under model.init_from: the folder's tokenizer.json
    tokenizer: str = "byte"
    val_fraction: float = checked(0.05, ge=0, lt=0.5)
    builtin_max_bytes: int = checked(4_000_000, gt=0)
    document_mask: bool = False  # attention block-diagonal-causal: no token attends across a document boundary
    document_positions: bool = True  # with document_mask: RoPE positions restart at each document


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty = <log.dir>/checkpoints
    every: int = checked(0, ge=0, note="0 = never")  # 0 = never
    keep: int = checked(3, ge=1)
    resume: str = "none"  # none | auto | path
    async_save: bool = False  # rank 0 writes in a background thread while training continues
    # After SIGTERM/SIGUSR1/SIGINT (train/preemption.py): seconds to end the step and save it before
    # the rank exits anyway; keep it under the scheduler's kill delay (SLURM KillWait, 30 s by default).
    stop_grace_s: float = checked(25.0, gt=0)
    # On load: "sizes" checks every file's size and the small files' CRC-32 (free); "full" also reads
    # every data file's CRC-32 (a flipped bit), 41-57% of a warm load of 1 GB (benchmarks/checkpoint_verify.py)
    verify: str = checked("sizes", choices=("sizes", "full"))
    # A folder: at the end of the run the final step is saved and written there as a Hugging Face
    # folder (config.json, safetensors, the run's tokenizer files with its chat template); empty = none.
    export_hf: str = ""


@dataclass
class DebugConfig:
    """Test-only fault injection (step 0 = off). Crashes, errors and hangs fire only in a job's first attempt."""
    crash_at_step: int = checked(0, ge=0)  # rank `crash_rank` exits abruptly as step N begins
    crash_rank: int = checked(0, ge=0)
    hang_at_step: int = checked(0, ge=0)  # rank `crash_rank` stops answering as step N begins (collective timeout)
    error_at_step: int = checked(0, ge=0)  # rank `crash_rank` raises an exception as step N begins (a bug or OOM)
    nan_at_step: int = checked(0, ge=0)  # step N's gradient norm is treated as NaN (exercises the skip path)
    nan_steps: int = checked(1, gt=0)  # ... and this many steps from N on
    slow_step_s: float = checked(0.0, ge=0)  # rank `crash_rank` spends this much longer on every step (a straggler)
    slow_save_step: int = checked(0, ge=0)  # rank 0 pauses half-way through writing this step's checkpoint...
    slow_save_s: float = checked(60.0, ge=0)  # ... for this long (a window in which to kill the job mid-save)
    stop_at_step: int = checked(0, ge=0)  # rank `crash_rank` sends itself `stop_signal` as step N ends (preemption)
    stop_signal: str = checked("SIGTERM", choices=("SIGTERM", "SIGUSR1", "SIGINT"))  # the signal stop_at_step sends
    # "R:STEP": every rank of replica group R (ft.replicas) kills itself with SIGKILL inside step STEP
    # (after its forward and backward, before the gradients cross the groups; a group that healed past STEP: at
    # its first step after), once; the group is started again
    kill_replica: str = ""
    # a replica group started again (ft.replicas) waits this long before it joins the quorum, so the live groups
    # train steps without it first (with ft.min_replicas below ft.replicas)
    rejoin_delay_s: float = checked(0.0, ge=0)


@dataclass
class LogConfig:
    dir: str = ""  # run directory for metrics.jsonl (and TensorBoard); empty = none
    every: int = checked(10, ge=0)  # console line every N steps
    # Steps whose communication the ledger measures (`comm_bytes` in metrics.jsonl): the first, the
    # last and every N-th; 0 = every log.every-th. Measuring costs a dispatch hook per operator.
    comm_every: int = checked(0, ge=0)
    tensorboard: bool = False
    progress: bool = True
    # MoE: warn (once per expert) when an expert has received no tokens for this many steps in a
    # row, a sign of router collapse; 0 = off.
    dead_expert_steps: int = checked(100, ge=0, note="0 = off")
    # Steps torch.profiler records, one Chrome trace per rank and step under <log.dir>/traces (open
    # in Perfetto or chrome://tracing), e.g. "3" or "3,10-12"; empty = none.
    profile_steps: str = ""
    # CUDA: record the allocator's history and write a snapshot per rank under <log.dir>/memory at the
    # end of the run and on out-of-memory (drag it onto pytorch.org/memory_viz).
    memory_snapshot: bool = False
    wandb: bool = False  # also log every step to Weights & Biases (pip install 'fivefold[wandb]')
    wandb_project: str = "fivefold"  # the W&B project the run is logged to
    # offline: the run is written under <log.dir>/wandb and uploaded later with `wandb sync`
    wandb_mode: str = checked("online", choices=("online", "offline"))


@dataclass
class ClusterConfig:
    """The planner's cluster; the trainer reads only `peak_tflops` (for MFU, where set)."""
    gpus: int = checked(0, ge=0)
    gpu: str = "h100"
    gpus_per_node: int = checked(8, gt=0)
    # Overrides of the GPU profile's figures; 0 = the profile's own.
    peak_tflops: float = checked(0.0, ge=0)
    memory_gb: float = checked(0.0, ge=0)
    intra_gbps: float = checked(0.0, ge=0)  # NVLink-class bandwidth inside a node, GB/s
    inter_gbps: float = checked(0.0, ge=0)  # network bandwidth between nodes per GPU, GB/s
    # The network between nodes: a rail-optimised full-bisection fat tree (H100/B200 clusters), or an
    # oversubscribed one whose per-GPU bandwidth falls with the nodes a collective spans (docs/planner.md).
    fabric: str = checked("full_bisection", choices=FABRICS)  # full_bisection | tapered
    # Goodput and cost (plan/goodput.py, docs/planner.md); 0 = the documented default.
    mtbf_gpu_hours: float = checked(0.0, ge=0, note="0 = 50,700, the Llama 3 report's")  # mean hours between failures of one GPU
    restart_s: float = checked(0.0, ge=0, note="0 = 600")  # from a failure to training again, checkpoint load excluded
    storage_gbps: float = checked(0.0, ge=0, note="0 = 1.0")  # checkpoint write and read bandwidth per node, GB/s
    usd_per_gpu_hour: float = checked(0.0, ge=0, note="0 = 2.0")  # price of one GPU-hour
    watts_per_gpu: float = checked(0.0, ge=0, note="0 = the GPU's board power")  # power drawn per GPU


@dataclass
class LoraConfig:
    """LoRA: low-rank adapters trained beside frozen base weights (docs/fine-tuning.md#lora).

    Beside each targeted linear layer, y = W x + (alpha / rank) · B A dropout(x), with A random and
    B zero at the start; only A and B are trained, reduced and saved with their optimizer state."""
    rank: int = checked(0, ge=0, note="0 = off")  # the adapters' rank r; 0 = off (every weight trained)
    alpha: float = checked(16.0, gt=0)  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = checked(0.0, ge=0, lt=1)  # dropout on the adapters' input (PEFT's lora_dropout)
    # Which linear layers get adapters: kinds (attention, mlp, experts) joined by '|', or re:PATTERN
    # searched in the single-device weight name (e.g. 're:attention\\.w[qv]'), as train.param_groups selects
    targets: str = "attention|mlp"


FT_MODES = ("same_batch", "shrink")  # ft.mode


@dataclass
class FtConfig:
    """In-place healing (docs/operations.md#in-place-healing): torchft replica groups, each a whole
    copy of the layout, that drop out of a step when they fail and heal from a live peer."""
    replicas: int = checked(0, ge=0, note="0 = off")  # replica groups `fivefold train --nproc N` starts here, each of N ranks; 0 = off
    # host:port of a running torchft lighthouse; empty = `fivefold train` starts one and the groups
    lighthouse: str = ""
    group: int = checked(0, ge=0)  # this process's replica group (the launcher sets it; give it under torchrun/SLURM)
    min_replicas: int = checked(1, gt=0)  # live groups a step needs to commit
    # same_batch: the live groups split the fixed global batch (the same gradient through a failure);
    # shrink: each group keeps its own share and the missing groups' shares are dropped (torchft's way)
    mode: str = checked("same_batch", choices=FT_MODES)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ft: FtConfig = field(default_factory=FtConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def micro_batches(cfg: Config) -> int:
    """Micro-batches per step on each data-parallel rank: global_batch / (dp · micro_batch), where
    micro_batch = 0 means the rank's whole share at once (docs/design.md batch arithmetic)."""
    per_rank = cfg.train.global_batch // cfg.parallel.dp
    return per_rank // (cfg.train.micro_batch or per_rank)


def ft_micro_batch(cfg: Config) -> int:
    """Sequences per micro-batch under ft.replicas: train.micro_batch, or 0's meaning at full
    strength, each rank of every replica group's whole share at once."""
    return cfg.train.micro_batch or cfg.train.global_batch // (cfg.ft.replicas * cfg.parallel.dp)
