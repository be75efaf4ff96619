"""The training loop: the same code for one process and for any layout.

Step k: draw the global batch of step k, keep this data-parallel rank's share, run its micro-batches
(gradient accumulation), reduce gradients once, clip by the global norm, update, log. The loss
logged is the mean cross-entropy over every token of the global batch, whatever the layout.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fivefold.config import Config, micro_batches
from fivefold.mesh import ParallelDims
from fivefold.models import build_meta_model, initial_values
from fivefold.models.block_weights import adapter_params_per_token
from fivefold.models.lora.adapters import adapter_initial_values, describe_adapters
from fivefold.parallel.parallelize import parallelize
from fivefold.parallel.parallelized import Parallelized
from fivefold.plan.model_stats import model_stats
from fivefold.runtime import Runtime, init_process_group, runtime_from_env
from fivefold.train import export, faults, hangs, observe, preemption
from fivefold.checkpoint import save_load as checkpoint
from fivefold.checkpoint import folder_lock
from fivefold.checkpoint.space import space_warning
from fivefold.data.batches import load_training_data
from fivefold.train.metrics import DeadExpertWatch, MetricsWriter, NonFiniteSteps, cuda_memory, peak_flops
from fivefold.data.mixture import GlobalBatches
from fivefold.train.optim import build_optimizer, lr_multiplier, lr_scheduler, muon_tensors
from fivefold.data.prefetch import BatchPrefetcher
from fivefold.train.startup import StartupPhases, describe_data, model_phase
from fivefold.config.validate import ignored_note
from fivefold.config.validate_data import check_data_is_set
from fivefold.configure import validate


@dataclass
class TrainResult:
    """What a run returns to its caller (tests and benchmarks use it; users read metrics.jsonl)."""

    records: list[dict] = field(default_factory=list)
    parallel: Parallelized | None = None
    # Parameter / gradient / optimizer bytes on this rank, taken in the last step just before the
    # update (everything is resident then).
    state_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def autocast(cfg: Config, device: torch.device):
    """bf16 compute over fp32 parameters: the fp32 weights are the master copy, and gradients
    (of fp32 leaves) are fp32, so every reduction happens in fp32."""
    if cfg.train.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def setup(cfg: Config, rt: Runtime | None = None) -> tuple[Runtime, Parallelized]:
    """Validate, create the process group, build and parallelize the model."""
    rt = rt or runtime_from_env()
    validate(cfg, rt.world_size, on_this_machine=True)
    if rt.is_main:  # one job per folder (checkpoint/folder_lock.py), refused before any process group
        folder_lock.hold_run_folders(cfg)
    init_process_group(rt, cfg.parallel.timeout_s, cfg.parallel.backend)
    dims = ParallelDims.from_config(cfg.parallel)
    model = build_meta_model(cfg.model, cfg.lora)  # each rank materialises only its pieces, in parallelize
    fill = initial_weights(cfg)
    par = parallelize(model, dims, cfg, rt.device, adapter_initial_values(fill, cfg.train.seed) if cfg.lora.rank else fill)
    if hasattr(fill, "close"):  # a folder's memory maps: read pages would count in this rank's RSS
        fill.close()
        if rt.is_main and fill.dequantised:
            from fivefold.models.hf.stream import dequantised_note

            print(f"{cfg.model.init_from}: {dequantised_note(fill)}", flush=True)
    return rt, par


def initial_weights(cfg: Config):
    """Where a rank's pieces get their first values: the seeded initialisation, or slices of a
    Hugging Face folder (model.init_from) when the run does not resume from a checkpoint, or when it
    trains LoRA adapters (their checkpoints hold no base: it comes from the folder again)."""
    if cfg.model.init_from and (checkpoint.resolve(cfg) is None or cfg.lora.rank):  # LoRA saves no base
        from fivefold.models.hf.interop import hf_box_reader

        return hf_box_reader(cfg.model.init_from)[1]
    return initial_values(cfg.model, cfg.train.seed)


class CompileClock:
    """The seconds torch.compile spends between two calls of `spent()` (its graphs compile inside
    the first step: the forward when a block first runs, the backward when it first runs)."""

    def __init__(self):
        from fivefold.torch_internals import compile_seconds

        self._read = compile_seconds
        self._total, self.last, self.times = compile_seconds(), 0.0, 0

    def spent(self) -> bool:
        total = self._read()
        self.last, self._total = total - self._total, total
        self.times += self.last > 0
        return self.last > 0


@torch.no_grad()
def evaluate(par: Parallelized, held_out: GlobalBatches, cfg: Config, device: torch.device) -> float:
    """Mean loss over the first `eval_batches` global batches of the held-out split."""
    total = 0.0
    for step in range(cfg.train.eval_batches):
        local = held_out.rank_batch(step, par.dp_rank, cfg.parallel.dp).to(device)
        total += par.eval_loss(local, lambda: autocast(cfg, device))
    return par.mean_over_dp(total / cfg.train.eval_batches)


def train(cfg: Config, rt: Runtime | None = None) -> TrainResult:
    check_data_is_set(cfg)
    phases = StartupPhases()
    rt, par = setup(cfg, rt)
    phases.done(model_phase(cfg))
    t = cfg.train
    # `sampler` is the data position checkpoints save; step k's batch depends on (seed, data, k) only.
    sampler, held_out = load_training_data(cfg.data, t.seq_len, cfg.model.vocab_size, t.global_batch, t.seed)
    phases.done("data read")
    muon = par.muon_layout()
    optimizer = par.optimizer(lambda params: build_optimizer(params, par.settings_of, t, muon))
    scheduler = lr_scheduler(optimizer, t)
    writer = MetricsWriter(cfg.log.dir, rt.is_main, cfg.log.every, t.steps, cfg.log.tensorboard,
                           cfg.log.progress, wandb_run(cfg) if cfg.log.wandb and rt.is_main else None)
    say_once(cfg, rt, par, writer, optimizer, muon)
    writer.note(describe_data(cfg))
    resume_from = checkpoint.resolve(cfg)
    if resume_from is not None:  # any saving layout: each rank reads the pieces its layout needs
        checkpoint.load(cfg, resume_from, par, optimizer, scheduler, sampler)
        writer.note(f"resumed from {resume_from}: continuing at step {sampler.step + 1}")
    phases.done("optimizer" + (" and checkpoint" if resume_from is not None else ""))
    writer.note(phases.describe())
    result, first_step, n_micro = TrainResult(parallel=par), sampler.step, micro_batches(cfg)
    records = StepRecords(cfg, rt, par, writer, held_out, sampler)
    prefetcher = BatchPrefetcher(sampler, par.dp_rank, cfg.parallel.dp, rt.device, t.steps)
    watchdog = hangs.StackWatchdog(hangs.folder(cfg.log.dir), rt.rank, max(1.0, cfg.parallel.timeout_s / 2))
    stop_requests = preemption.StopRequests(cfg.checkpoint.stop_grace_s, rt.rank, faults.another_rank_failed)
    profiler = observe.StepProfiler(cfg, rt.rank, rt.device)
    try:
        with watchdog, stop_requests as stops, observe.MemorySnapshots(cfg, rt.rank):
            injected = faults.Injection(cfg, rt.rank, stops)
            for step in range(first_step, t.steps):
                faults.progress.step = step + 1  # named by the error if a collective times out
                watchdog.step_started()
                profiler.start(step + 1)
                start = time.perf_counter()
                injected.step_began(step + 1)
                batch = prefetcher.get(step)  # read in the background during the previous step
                sampler.step = step + 1
                measured = records.measures_comm(step, first_step)
                with par.measure_comm() if measured else contextlib.nullcontext():
                    loss_sum = par.forward_backward(batch, n_micro, lambda: autocast(cfg, rt.device))
                    # The straggler report compares this, not the step time: every rank ends a step together
                    # (the gradient sync waits for the slowest), but data-parallel replicas wait for nobody
                    # before it, so a slow one stands out in its batch, forward and backward.
                    work_time = time.perf_counter() - start
                    par.finish_grads()
                    grad_norm = injected.grad_norm(step + 1, par.clip_grad_norm(t.grad_clip))
                    if step == t.steps - 1:
                        result.state_bytes = par.state_bytes(optimizer)
                    if math.isfinite(grad_norm):  # the same number on every rank: all skip together
                        par.optimizer_step(optimizer)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                profiler.stop(step + 1)
                record = records.of_step(step, loss_sum, grad_norm, start, work_time, measured)
                result.records.append(record)
                writer.log(record)
                records.non_finite.stop_if_too_many(step + 1)
                saved = save_if_due(cfg, step + 1, par, optimizer, scheduler, sampler, rt)
                injected.step_ended(step + 1)
                stop_if_asked(cfg, step + 1, stops.agreed(rt.device), saved, par, optimizer, scheduler, sampler, rt)
        checkpoint.wait_for_save()  # an asynchronous write finishes before the run returns
        if cfg.checkpoint.export_hf and rt.is_main:
            # One process, one tensor at a time, from the checkpoint just written (any layout wrote it).
            export.checkpoint_to_hf(checkpoint_root_or_none(cfg, t.steps), cfg.checkpoint.export_hf,
                                    tokenizer=export.data_tokenizer(cfg.data.tokenizer, cfg.data.source))
            kind = "a PEFT adapter folder" if cfg.lora.rank else "a Hugging Face folder"
            print(f"exported step {t.steps} as {kind}: {cfg.checkpoint.export_hf}", flush=True)
    finally:  # every way out: the metrics flushed, the reader thread stopped, the folders let go
        prefetcher.close()
        writer.close()
        folder_lock.release_all()
    return result


def say_once(cfg: Config, rt: Runtime, par: Parallelized, writer: MetricsWriter, optimizer, muon) -> None:
    """What a run says before its first step: the layout, what trains, where work goes, options
    that do nothing here, a disk too small for the checkpoints."""
    writer.note(par.describe())
    if cfg.lora.rank:  # what trains
        writer.note(describe_adapters(build_meta_model(cfg.model, cfg.lora), cfg.lora))
    if muon_tensors(optimizer):  # where each rank's Newton–Schulz work goes
        writer.note(muon.describe(muon_tensors(optimizer)))
    if cfg.train.fp8:  # what runs in FP8 and what does not (parallel/float8.py)
        from fivefold.models.registry import model_spec
        from fivefold.parallel import float8

        writer.note(float8.describe(cfg, model_spec(cfg.model), float8.float8_all_gather(cfg, par.dims)))
    if ignored_note(cfg):
        writer.note(ignored_note(cfg))  # options this layout does nothing with
    room = space_warning(cfg, checkpoint.checkpoint_root(cfg)) if rt.is_main else None
    if room:  # before the first step, not at the first save hours later
        print(room, file=sys.stderr, flush=True)
    if par.compiling.reason:  # parallelize's choice for train.compile = auto, with its reason
        writer.note(par.compiling.reason)


class StepRecords:
    """Each step's record for metrics.jsonl: what the step measured, and what is due at that step
    (evaluation, the periodic per-rank figures, compile time, the measured bubble)."""

    def __init__(self, cfg: Config, rt: Runtime, par: Parallelized, writer: MetricsWriter, held_out, sampler):
        self.cfg, self.rt, self.par, self.writer = cfg, rt, par, writer
        self.held_out, self.sampler = held_out, sampler
        self.stats = model_stats(cfg.model)  # MFU: the planner's formula, active parameters for MoE
        self.peak = peak_flops(rt.device, cfg.train.dtype, cfg.cluster.peak_tflops)
        # LoRA: the frozen base makes no weight gradients (models/decoder_stats.py lora_flops_per_token).
        self.adapters = (adapter_params_per_token(self.stats, cfg.lora.rank, cfg.lora.targets)
                         if cfg.lora.rank else None)
        self.compile_clock = CompileClock() if par.compiling.compile else None
        self.non_finite = NonFiniteSteps(cfg.train.max_bad_steps, rt.is_main)
        self.dead_experts = DeadExpertWatch(cfg.log.dead_expert_steps)
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(rt.device)

    def measures_comm(self, step: int, first_step: int) -> bool:
        """Whether the ledger records this step's collectives: the first, the last, and every log.comm_every."""
        every = self.cfg.log.comm_every or self.cfg.log.every
        return step in (first_step, self.cfg.train.steps - 1) or bool(every and (step + 1) % every == 0)

    def of_step(self, step: int, loss_sum, grad_norm: float, start: float, work_time: float, measured: bool) -> dict:
        cfg, t, rt, par = self.cfg, self.cfg.train, self.rt, self.par
        loss_value = par.mean_over_dp(loss_sum.item())
        step_time = time.perf_counter() - start
        world_tokens_per_sec = t.global_batch * t.seq_len / step_time
        record = {
            "step": step + 1, "loss": loss_value, "grad_norm": grad_norm,
            "lr": t.lr * lr_multiplier(step, t),  # the base lr: groups may scale it (train.param_groups)
            "tokens_per_sec": world_tokens_per_sec, "tokens_per_sec_per_gpu": world_tokens_per_sec / rt.world_size,
            "mfu": (self.stats.mfu(t.seq_len, world_tokens_per_sec / rt.world_size, self.peak, self.adapters)
                    if self.peak else None),
            "step_time_s": step_time, "peak_mem_bytes": peak_memory_bytes(rt.device),
            "device_mem_bytes": device_memory_bytes(rt.device), **cuda_memory(rt.device),
            **({"comm_bytes": par.comm_bytes_last_step()} if measured else {}),
            # MoE: aux_loss (not in `loss`), tokens per expert, imbalance, drops; MTP: mtp_loss (not in `loss`)
            **par.step_metrics,
        }
        if self.compile_clock is not None and self.compile_clock.spent():
            record["compile_s"] = self.compile_clock.last
            self.writer.note(f"step {step + 1}: torch.compile took {self.compile_clock.last:.1f} s of the step's "
                             f"{step_time:.1f} s{' (a recompilation)' if self.compile_clock.times > 1 else ''}")
        bubble = par.bubble_fraction(step_time)
        if bubble is not None:
            record["bubble_fraction"] = bubble  # measured: idle share of the pipeline ranks
        if t.eval_every and (step + 1) % t.eval_every == 0 and self.held_out.num_windows:
            record["val_loss"] = evaluate(par, self.held_out, cfg, rt.device)
        if cfg.log.every and (step + 1) % cfg.log.every == 0:
            self._periodic(record, step, work_time)
        if self.non_finite.count(record):
            for line in self.dead_experts.update(record):  # a skipped step has no new router statistics
                if rt.is_main:
                    print(f"warning: {line}", file=sys.stderr, flush=True)
        return record

    def _periodic(self, record: dict, step: int, work_time: float) -> None:
        """Every log.every steps (collectives: every rank, the same steps)."""
        rt = self.rt
        # every rank's peak, for `fivefold report`
        record["peak_mem_bytes_per_rank"] = observe.per_rank(float(record["peak_mem_bytes"] or 0), rt.device)
        if len(self.sampler.names) > 1:  # a mixture: tokens each source has given the run so far
            record["source_tokens"] = self.sampler.source_tokens(step + 1)
        slow = faults.straggler(work_time, rt.device)
        if slow is not None:
            record["straggler"] = slow
            self.writer.note(f"straggler: rank {slow['rank']} took {slow['work_s']:.3f}s for its batch, forward "
                             f"and backward of step {step + 1}, the median rank {slow['median_work_s']:.3f}s")


def save_if_due(cfg: Config, step: int, par, optimizer, scheduler, sampler, rt: Runtime) -> bool:
    """Save at every checkpoint.every steps and at the last step (the run's result, and what the
    export reads); whether it saved."""
    due = bool(cfg.checkpoint.every) and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps)  # the last too
    due = due or (bool(cfg.checkpoint.export_hf) and step == cfg.train.steps)
    if due:
        checkpoint.save(cfg, step, par, optimizer, scheduler, sampler, rt.is_main)
    return due


def stop_if_asked(cfg: Config, step: int, signum: int, saved: bool, par, optimizer, scheduler, sampler,
                  rt: Runtime) -> None:
    """A stop signal every rank agreed on (preemption): save the step unless it was just saved,
    let the write finish, and end the run with one sentence (preemption.Stopped)."""
    if not signum or step >= cfg.train.steps:
        return
    path = checkpoint_root_or_none(cfg, step)
    if path is not None and not saved:
        checkpoint.save(cfg, step, par, optimizer, scheduler, sampler, rt.is_main)
    checkpoint.wait_for_save()
    raise preemption.Stopped(preemption.stopped_sentence(signum, step, path))


def wandb_run(cfg: Config):
    """Rank 0's Weights & Biases run (log.wandb): named after the run folder, with the whole config."""
    import wandb

    name = Path(cfg.log.dir).name if cfg.log.dir else None
    return wandb.init(project=cfg.log.wandb_project, name=name, dir=cfg.log.dir or None, mode=cfg.log.wandb_mode,
                      config=cfg.to_dict(), reinit="finish_previous")


def checkpoint_root_or_none(cfg: Config, step: int):
    """Where the checkpoint of `step` goes, or None when the run has no checkpoint folder."""
    root = checkpoint.checkpoint_root(cfg)
    return None if root is None else root / f"{checkpoint.PREFIX}{step:08d}"


def device_memory_bytes(device: torch.device) -> int | None:
    """What the device holds in all (the console's memory percentage); None on CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def peak_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource  # CPU: the process's peak resident set, the closest honest figure

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except ImportError:
        return None

