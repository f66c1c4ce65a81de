"""The training loop, read top to bottom: set up ranks, data, model; step; evaluate; sample.

One process per rank. The loop is the same for every layout: ``parallelize`` builds this rank's
part of the model with every mechanism applied, and the ``Executor`` (``step.py``) runs each
step, so this file never mentions a process group except to start one.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from tqdm import tqdm

from tessera import checkpoint
from tessera.checkpoint import CheckpointError
from tessera.config import Config
from tessera.data.loader import BatchLoader, DataError, TokenDataset, val_batch_size, val_windows
from tessera.data.tokenizer import load_tokenizer
from tessera.errors import ConfigError
from tessera.generate import generate
from tessera.host_memory import keep_freed_memory
from tessera.launch import loopback_store
from tessera.metrics import (
    JsonlLogger,
    MemorySnapshot,
    StepWork,
    device_peak_tflops,
    mfu,
    step_record,
)
from tessera.model import Transformer, flops_per_token
from tessera.moe import reduce_stats, summarize_load
from tessera.noise_scale import SETTLED_STEPS, critical_batch_line, noise_scale_unsupported
from tessera.optim import lr_lambda, scaled, scaling_line
from tessera.parallel.compile import compile_seconds
from tessera.parallelize import parallelize
from tessera.preflight import check_run
from tessera.report import gather_memory, step_line, summary_lines
from tessera.run_dir import RunStart, begin_out_dir, restart_count
from tessera.step import Executor
from tessera.topology import Topology
from tessera.watchdog import Watchdog, peer_loss_reason


def pick_device() -> tuple[torch.device, str]:
    """One GPU per rank with NCCL where GPUs exist, else the CPU with gloo."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(backend: str, device: torch.device | None = None,
                     timeout_s: float = 300.0) -> None:
    """Join the launcher's group (torchrun's env://), or make a group of one. On a GPU the
    group is bound to this rank's device (NCCL would otherwise guess it from the rank).

    Every collective of the run fails after `timeout_s` seconds: the default group's and, since
    torch gives groups made later (dist.new_group, DeviceMesh) its module default rather than
    the default group's, that default too, in this process."""
    if dist.is_initialized():
        return
    bind = {"device_id": device} if device is not None and device.type == "cuda" else {}
    timeout = timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    if "RANK" in os.environ:
        store = loopback_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, **bind)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
                                    **bind)
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout,
                                **bind)


@dataclass
class RunResult:
    """What a finished run reports (rank 0 holds the full picture)."""

    steps: int
    final_loss: float
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: str = ""
    median_step_s: float = 0.0
    tokens_per_s: float = 0.0
    timeline: dict[str, Any] | None = None
    """The last step's measured pipeline timeline (schedule, bubble, picture path)."""
    memory: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: parameter, gradient, optimizer and peak activation bytes."""
    moe: dict[str, Any] | None = None
    """Mixture of experts: the whole run's tokens per expert, busiest/mean, dropped share."""
    noise_scale: dict[str, Any] | None = None
    """The gradient noise scale's last record (``tessera.noise_scale``), if measured."""
    compile_s: float | None = None
    """train.compile: seconds this rank spent compiling; the steps that compiled are left out
    of median_step_s and tokens_per_s."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Position:
    """Where a rank's run is, for a message about a failure there: "start-up", "step 7" (the
    step being run), "the end after step 40"."""

    stage: str = "start-up"


class StepProfiler:
    """torch.profiler around steps A..B (1-based, inclusive); one Chrome trace per rank."""

    def __init__(self, steps: tuple[int, int] | None, out: Path, rank: int,
                 device: torch.device):
        self.steps, self.out, self.rank, self.device = steps, out, rank, device
        self.prof: torch.profiler.profile | None = None

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()

    def after(self, step: int) -> bool:
        """Whether `step` was profiled; the trace is written after step B."""
        if self.prof is None:
            return False
        if step == self.steps[1]:
            self.prof.__exit__(None, None, None)
            self.out.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.out / f"rank-{self.rank:05d}.trace.json"))
            self.prof = None
        return True


def evaluate(executor, cfg: Config, dataset: TokenDataset, topo: Topology) -> float:
    """Mean validation loss in nats per token over data.val_tokens held-out tokens."""
    batches = val_windows(dataset.val, cfg.data.seq_len, cfg.data.val_tokens,
                          val_batch_size(cfg.train.micro_batch_size), topo.coords()["dp"], topo.dp,
                          topo.coords()["cp"], topo.cp)
    loss_sum, count = executor.eval_loss(batches)
    return loss_sum / count


@dataclass
class Run:
    """This rank's run once set up (``open_run``): what its steps and its end use."""

    cfg: Config
    topo: Topology
    device: torch.device
    dataset: TokenDataset
    executor: Executor
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: BatchLoader
    out: Path
    logger: JsonlLogger
    saver: checkpoint.AsyncSaver | None
    """Background checkpoint saves (train.async_checkpoint), on a gloo group of their own."""
    origin: RunStart
    watchdog: Watchdog | None
    start: int
    """The step the run starts after: a resumed run's restored step, else 0."""
    lr_scaling: dict | None = None
    """How train.lr_scaling changed lr and warm-up (``optim.scaled``), None if it did not;
    written in the step-0 record."""


def open_run(cfg: Config) -> Run:
    """Set this rank up: every rule checked and the data opened before the first collective
    (the launching command already checked memory against this machine), the process group,
    the model, its optimizer, schedule and data, a resumed run's state, the metrics log; rank 0
    writes config.json and prints the layout."""
    device, backend = pick_device()
    world = int(os.environ.get("WORLD_SIZE", 1))
    checked = check_run(cfg, world, device.type, memory=False)
    cfg, origin = checked.cfg, checked.start
    if checked.new_out:
        cfg = begin_out_dir(cfg)

    if device.type == "cpu" and cfg.train.keep_host_memory:
        keep_freed_memory()
    init_distributed(backend, device, cfg.train.collective_timeout_s)
    watchdog = Watchdog.start_for_run(dist.get_rank(), dist.get_world_size(),
                                      cfg.train.collective_timeout_s)
    topo = Topology.build(cfg.parallel, device.type)
    rank0 = topo.rank == 0
    torch.manual_seed(cfg.train.seed)

    model = parallelize(cfg, topo, device)
    executor = Executor(model)
    # The optimizer and schedule use lr and warm-up as train.lr_scaling sets them.
    schedule, lr_scaling = scaled(cfg.train, checkpoint.global_batch(cfg))
    optimizer = model.optimizer(schedule)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule))
    loader = BatchLoader(checked.dataset.train, cfg.data.seq_len, cfg.train.micro_batch_size,
                         cfg.train.grad_accum, topo.coords()["dp"], topo.dp, cfg.data.seed,
                         cp_rank=topo.coords()["cp"], cp_size=topo.cp)

    # Background saves run their collectives on a gloo group of their own (every rank makes it).
    saver = (checkpoint.AsyncSaver(dist.new_group(backend="gloo"))
             if cfg.train.async_checkpoint and cfg.train.checkpoint_interval else None)
    start = 0
    if origin.resume_from is not None:  # from any layout: each rank reads the boxes it holds
        start = checkpoint.restore(origin.resume_from, cfg, executor, optimizer, scheduler,
                                   loader)
    if rank0 and origin.others:  # train.overwrite: gone before this run's first save
        checkpoint.remove(origin.others)
        print(f"overwrite: deleted {len(origin.others)} checkpoint(s) of another run from "
              f"{cfg.train.checkpoint_root}", flush=True)

    out = Path(cfg.train.out_dir)
    # A resumed run continues the log after a restart marker (metrics.read_metrics).
    logger = JsonlLogger(out / "metrics.jsonl" if rank0 else None,
                         resumed_from=start if origin.resume_from is not None else None,
                         tensorboard=out / "tensorboard" if cfg.train.tensorboard else None,
                         restart=restart_count(), checkpoint=origin.resume_from)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        print(f"tessera: {topo.describe()} device={device} backend={backend}", flush=True)
        if lr_scaling is not None:
            print(scaling_line(cfg.train, checkpoint.global_batch(cfg), lr_scaling), flush=True)
        p = cfg.parallel
        unsupported = noise_scale_unsupported(p.dp, p.cp, p.ep, p.dp_mode)
        if cfg.train.noise_scale and unsupported:
            print(f"noise scale: {unsupported}", flush=True)
        elif executor.noise is not None and start and not executor.noise.steps:
            print(f"noise scale: {origin.resume_from} holds no moving averages (not measured "
                  f"there, or saved before they were): they start over at step {start + 1}",
                  flush=True)
    return Run(cfg, topo, device, checked.dataset, executor, optimizer, scheduler, loader, out,
               logger, saver, origin, watchdog, start, lr_scaling)


def every(step: int, interval: int) -> bool:
    """Whether `step` is a multiple of `interval` (0: never)."""
    return bool(interval) and step % interval == 0


def train(cfg: Config, progress: bool = True, position: Position | None = None) -> RunResult:
    """Run training on this rank. Every rank calls this with the same config; `position`, if
    given, follows the step being run."""
    position = position if position is not None else Position()
    run = open_run(cfg)
    cfg, topo, executor = run.cfg, run.topo, run.executor
    rank0 = topo.rank == 0
    tokens_per_step = run.loader.global_batch_size * cfg.data.seq_len
    work = StepWork(tokens_per_step, flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step,
                    topo.world_size, cfg.train.peak_tflops or device_peak_tflops(run.device))
    result = RunResult(steps=cfg.train.steps, final_loss=float("nan"))
    step_times: list[float] = []
    compiling: set[int] = set()  # indices in step_times of steps that compiled
    compile_start = compile_seconds()  # what this process compiled before (train.compile)
    chunks = list(executor.model.chunks.values())
    moe_groups = [topo.group("dpcp"), topo.group("pp")]
    moe_total: dict[str, torch.Tensor] = {}
    warned = False  # the critical-batch warning, printed once

    if run.start == 0:
        first_validation(run, result)
    elif rank0:
        restarted = f" (restart {restart_count()})" if restart_count() else ""
        print(f"resumed from {run.origin.resume_from} at step {run.start}{restarted}",
              flush=True)

    profiler = StepProfiler(cfg.train.profile_range, run.out / "profile", topo.rank, run.device)
    snapshot = (MemorySnapshot(run.out / "memory" / f"rank-{topo.rank:05d}.pickle")
                if cfg.train.memory_snapshot else None)
    if snapshot is not None:
        snapshot.start()
    # The bar only on a terminal: in a log file its redraws bury the metric lines.
    show_bar = rank0 and progress and sys.stderr.isatty()
    bar = tqdm(range(run.start, cfg.train.steps), disable=not show_bar, unit="step",
               dynamic_ncols=True, initial=run.start, total=cfg.train.steps)
    for done_before in bar:
        step = done_before + 1
        position.stage = f"step {step}"
        last = step == cfg.train.steps
        # The last step also counts the activations saved for backward (the summary's memory).
        executor.runtime.measure_memory = last
        profiler.before(step)
        compile_before = compile_seconds()
        done = executor.train_step(run.loader, run.optimizer, run.scheduler, cfg.train.grad_clip)
        step_times.append(done.seconds)
        result.final_loss = done.loss
        profiled = profiler.after(step)

        record = step_record(step, done, run.scheduler.get_last_lr()[0], work, run.device)
        if done.noise is not None:
            warned = critical_batch_warning(run, done.noise, warned)
            result.noise_scale = done.noise
        if cfg.train.compile:  # this step's compile seconds, kept out of the summary's rates
            record["compile_s"] = compile_seconds() - compile_before
            if record["compile_s"] > 0:
                compiling.add(len(step_times) - 1)
        if profiled:
            record["profiled"] = True
        if cfg.model.moe_experts:  # this step's routing, summed over dp and layers
            moe = reduce_stats(chunks, moe_groups, cfg.model.moe_experts)
            record.update(summarize_load(moe))
            moe_total = {k: moe[k] + moe_total.get(k, 0) for k in moe}
        if last or every(step, cfg.train.eval_interval):
            record["val_loss"] = evaluate(executor, cfg, run.dataset, topo)
            result.val_losses.append((step, record["val_loss"]))
        run.logger.log(record)
        bar.set_postfix(loss=f"{done.loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if rank0 and (last or every(step, cfg.train.log_interval) or "val_loss" in record):
            bar.write(step_line(record))
        if cfg.train.checkpoint_interval and (last or every(step, cfg.train.checkpoint_interval)):
            save_checkpoint(run, step, bar)
    position.stage = f"the end after step {cfg.train.steps}"
    if run.saver is not None:
        run.saver.close()  # the last checkpoint is complete before the run reports
    if cfg.train.compile:
        result.compile_s = compile_seconds() - compile_start
    return finish(run, result, step_times, work, snapshot,
                  summarize_load(moe_total) if moe_total else None, compiling)


def critical_batch_warning(run: Run, noise: dict[str, Any], warned: bool) -> bool:
    """Rank 0 prints ``critical_batch_line`` once, when the settled noise scale (after
    SETTLED_STEPS steps of averaging) is below the global batch; returns whether it has."""
    batch = checkpoint.global_batch(run.cfg)
    scale = noise["noise_scale"]
    if (not warned and run.executor.noise.steps >= SETTLED_STEPS and scale is not None
            and batch > scale):
        if run.topo.rank == 0:
            print(critical_batch_line(batch, scale), flush=True)
        return True
    return warned


def first_validation(run: Run, result: RunResult) -> None:
    """Validation before the first step: where the loss starts (~ln V for a fresh model)."""
    val0 = evaluate(run.executor, run.cfg, run.dataset, run.topo)
    result.val_losses.append((0, val0))
    run.logger.log({"step": 0, "val_loss": val0} | (run.lr_scaling or {}))
    if run.topo.rank == 0:
        print(f"step     0 | val {val0:.4f} (uniform would be ln V = "
              f"{math.log(run.cfg.model.vocab_size):.4f})", flush=True)


def save_checkpoint(run: Run, step: int, bar: tqdm) -> None:
    """Every rank saves its part of the checkpoint after `step`; rank 0 prints where."""
    cfg, topo = run.cfg, run.topo
    saved = checkpoint.save(cfg.train.checkpoint_root, step, cfg, run.executor, run.optimizer,
                            run.scheduler, run.loader, topo.rank, topo.world_size,
                            keep=cfg.train.keep_checkpoints, saver=run.saver,
                            run_id=run.origin.run_id)
    if topo.rank == 0:
        bar.write(f"step {step:5d} | checkpoint {saved}"
                  + (" (writing in the background)" if run.saver else ""))


def finish(run: Run, result: RunResult, step_times: list[float], work: StepWork,
           snapshot: MemorySnapshot | None, moe: dict[str, Any] | None,
           compiling: set[int] | None = None) -> RunResult:
    """After the last step: the memory snapshot, the median step and its rates, the last
    step's timeline, memory per rank, the summary, the sample, summary.json; then every rank
    meets at a barrier. `moe`: the whole run's expert load (``summarize_load``), if any.
    `compiling`: indices of the steps that compiled (train.compile), left out of the median
    step like the first two."""
    cfg, topo, executor, out = run.cfg, run.topo, run.executor, run.out
    rank0 = topo.rank == 0
    if snapshot is not None:
        written = snapshot.dump()
        if rank0:
            print(f"memory snapshot: {written.parent}/rank-*.pickle (https://pytorch.org/"
                  "memory_viz)", flush=True)
    if not step_times:  # resumed at the last step: nothing left to run
        step_times.append(float("nan"))
    warm = step_times[min(len(step_times) - 1, 2):]
    steady = [t for i, t in enumerate(step_times) if i >= 2 and i not in (compiling or ())]
    warm = steady or warm
    result.median_step_s = sorted(warm)[len(warm) // 2]
    result.tokens_per_s = work.tokens / result.median_step_s

    # Outside any timed step: the last step's timeline, memory per rank, the summary.
    timeline = executor.write_timeline(out)
    memory = gather_memory(executor)
    result.moe = moe
    if rank0:
        flops_per_s = work.flops / result.median_step_s
        lines = summary_lines(cfg, topo.world_size, run.device, result.median_step_s,
                              result.tokens_per_s, flops_per_s,
                              mfu(flops_per_s, work.peak_tflops, topo.world_size),
                              timeline, memory, moe=result.moe, noise=result.noise_scale)
        if result.compile_s is not None:
            steps = ", ".join(str(i + run.start + 1) for i in sorted(compiling or ()))
            lines.insert(3, f"compile     {result.compile_s:.1f} s on rank 0 (step {steps}), "
                            "left out of the step time and tokens/s")
        print("\n".join(lines), flush=True)
        result.timeline = timeline
        result.memory = memory

    state = executor.full_state_dict()
    if rank0 and cfg.train.sample_tokens:
        result.sample = sample_text(cfg, state, run.dataset, run.device)
        (out / "sample.txt").write_text(result.sample)
        print(f"--- sample ({cfg.train.sample_tokens} tokens) ---\n"
              f"{cfg.train.sample_prompt}{result.sample}\n--- end sample ---", flush=True)
    if rank0:
        (out / "summary.json").write_text(json.dumps(result.to_dict(), indent=1))
    if run.watchdog is not None:
        # Before the last barrier, while rank 0 (which may serve the store) is surely there.
        run.watchdog.stop()
    dist.barrier()
    return result


def sample_text(cfg: Config, state: dict[str, torch.Tensor], dataset: TokenDataset,
                device: torch.device) -> str:
    model = Transformer(cfg.model).to(device)
    model.load_state_dict(state)
    tokenizer = load_tokenizer(dataset.tokenizer)
    ids = generate(model, tokenizer.encode(cfg.train.sample_prompt), cfg.train.sample_tokens,
                   seed=cfg.train.seed)
    return tokenizer.decode(ids)


class PeerLostError(RuntimeError):
    """A collective of this rank failed because another rank's process went away; the message
    is the one line to print (``lost_peer_line``)."""


def run(cfg: Config, progress: bool = True) -> RunResult:
    """train() with the process group torn down afterwards, errors on every rank kept short:
    a collective that fails because a peer died raises PeerLostError with one line to print
    (the dead rank's own output, or the launcher, says why it died)."""
    position = Position()
    try:
        return train(cfg, progress, position)
    except RuntimeError as e:
        reason = peer_loss_reason(e)
        if reason is None:
            raise
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        raise PeerLostError(lost_peer_line(cfg, rank, position.stage, reason)) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def lost_peer_line(cfg: Config, rank: int, stage: str, reason: str) -> str:
    """``rank R lost a peer during STAGE (REASON): the job stops; ...`` and what comes next:
    the launcher's restart, or how to continue by hand."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restart_count() < restarts:
        where = ("the newest checkpoint" if cfg.train.checkpoint_interval else
                 "where this run began")
        then = (f"the launcher restarts it from {where} (restart {restart_count() + 1} of "
                f"{restarts})")
    elif cfg.train.checkpoint_interval:
        then = ("the launcher's summary names the rank that failed; --resume latest goes on "
                "from the newest checkpoint")
    else:
        then = ("the launcher's summary names the rank that failed; with no checkpoints "
                "(--checkpoint-interval) a new run starts over")
    return f"rank {rank} lost a peer during {stage} ({reason}): the job stops; {then}"


__all__ = ["train", "run", "RunResult", "DataError", "ConfigError", "CheckpointError",
           "PeerLostError"]
