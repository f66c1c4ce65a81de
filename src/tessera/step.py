"""The step executor: the one place a training step runs, for every layout.

Every layout is a pipeline schedule (``tessera.parallel_model.training_schedule``; pp = 1 is the
one-rank schedule F0 B0 F1 B1 …), and ``Executor.forward_backward`` runs it with the pipeline
runtime. One step:

1. **micro-batches through the schedule** (``pipeline.runtime``): each loss is scaled by 1/m,
   so the m micro-batches' gradients accumulate to the gradient of the whole batch's mean loss.
   The loss is the reference cross-entropy, or its vocabulary-parallel form under tp; with
   ``train.loss_chunk_tokens`` the last chunk returns the head's input and the loss applies the
   head a chunk of tokens at a time (``parallel.chunked_loss``). With ``train.compile`` the
   reference cross-entropy is compiled (``parallel.compile.compiled_loss``).
2. **data-parallel reduction, overlapped**: each chunk's backwards run under its wrapper's
   ``no_sync()`` except the chunk's last one of the step (B, or W where the schedule splits
   the backward: its I accumulates no weight gradient), during which the reduction starts
   (DDP buckets launch from gradient hooks as they fill; ZeRO-1 all-reduces and ZeRO-2/3
   reduce-scatters each unit as its backward ends). A chunk that finishes early (the last
   chunks, and breadth-first's early chunks) thus reduces while the pipeline computes the rest.
   Then every reduction is waited for (``finish_gradient_sync``). ZeRO-3 under a breadth-first
   schedule is the exception: the schedule itself carries the collectives
   (``ParallelModel.sharded_schedule``: UNSHARD before a chunk's run of micro-batches, RESHARD
   after it, REDUCE_GRAD after its last backward), which the runtime executes.
3. **model-parallel gradient sums** (``ParallelModel.sync_model_parallel_grads``): partial
   TP gradients over tp, a split tied embedding over its (first, last) rank pair.
4. **the loss**: the last chunk's rank holds the micro-batches' scaled losses; summed over pp,
   averaged over dp × cp (context parallelism: each cp rank's loss is the mean over its T/cp
   tokens, so the mean of the cp ranks' is the mean over the whole sequence): the same value on
   every rank. Micro-batches arrive already cut to this cp rank's tokens (``BatchLoader``).

``clip_grad_norm_`` then takes the global norm of the single-device model's gradient, each
element counted once: each rank sums the squares it owns (``ParallelModel.local_grad_sq``:
TP-sharded pieces everywhere, TP-replicated ones on their first holder, a tied copy never,
ZeRO's dp slice) and the sum is all-reduced over tp and pp (and dp where ZeRO shards). With
``train.noise_scale`` under dp >= 2, the same all-reduce also carries the squares of the local
gradients the wrappers read before their reductions (summed over dp with the loss, or over dp
in the norm's own all-reduce under ZeRO) and of the gradients left out of that measurement: one
step's gradient noise scale (``tessera.noise_scale``) at no extra collective.

Timing: the runtime stamps every compute action and wait, and the data-parallel wrappers every
collective's start and every wait on one (``tessera.parallel.comm_timing``; their sum is
``last_comm_wait_s``, the measured exposed DP communication); the last step's record gives the
measured bubble and the timeline picture (``write_timeline``, called after training, outside
any timed step).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.config import Config
from tessera.model import cross_entropy
from tessera.moe import set_loss_scale, update_router_bias
from tessera.noise_scale import NoiseScale, noise_scale_unsupported, small_batch_sq
from tessera.parallel.chunked_loss import chunked_head_cross_entropy
from tessera.parallel.compile import compiled_loss
from tessera.parallel.vocab_parallel_loss import vocab_parallel_cross_entropy
from tessera.parallel_model import ParallelModel, training_schedule
from tessera.parallelize import sync_context
from tessera.pipeline.runtime import PipelineRuntime, StepRecord, measured_bubble
from tessera.pipeline.scatter_gather import StageBoundary
from tessera.pipeline.schedule import Action, F, Schedule, forward_only
from tessera.pipeline.simulator import StageCosts, TimelineEvent, simulate

MicroBatch = tuple[torch.Tensor, torch.Tensor]


def all_reduce_sum(values: Sequence[float], group: dist.ProcessGroup | None,
                   device: torch.device) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


def forward_pass(chunk_rank: Sequence[int], n_microbatches: int) -> Schedule:
    """Evaluation order: micro-batch by micro-batch, each rank's chunks in model order (the
    globally first unfinished forward can always run, so this never deadlocks)."""
    n_ranks = max(chunk_rank) + 1
    orders = [[F(c, mb) for mb in range(n_microbatches)
               for c in range(len(chunk_rank)) if chunk_rank[c] == r] for r in range(n_ranks)]
    return forward_only(Schedule("forward", orders, len(chunk_rank), n_microbatches,
                                 tuple(chunk_rank)))


@dataclass
class StepResult:
    """What ``Executor.train_step`` measured of one step."""

    loss: float
    """The step's mean loss (the same on every rank)."""
    grad_norm: float | None
    """The gradient's global norm before clipping; None for a step without the update."""
    seconds: float
    """The step's time on the step's clock, from before its ``zero_grad`` (with `barrier`:
    from after the barrier) to after its last action (and the device's synchronize)."""
    comm_wait_s: float
    """This rank's measured exposed data-parallel communication (``last_comm_wait_s``)."""
    compute_s: float
    """This rank's compute actions' seconds (the runtime's record of the step)."""
    noise: dict | None = None
    """The gradient noise scale's record after this step (``NoiseScale.update``), if
    measured."""


def last_backwards(schedule: Schedule, rank: int) -> set[Action]:
    """The action of each chunk of `rank` that accumulates weight gradients (B, or W of a
    split backward; never I) last in its order: where the chunk's data-parallel reduction
    starts."""
    last: dict[int, Action] = {}
    for a in schedule.actions[rank]:
        if a.kind.ends_weight_grad:
            last[a.chunk] = a
    return set(last.values())


class Executor:
    """Runs steps of a ParallelModel (see the module doc)."""

    def __init__(self, model: ParallelModel, measure_memory: bool = False):
        self.model, self.cfg, self.topo = model, model.cfg, model.topo
        self.device = model.device
        self.pp_rank = self.topo.coords()["pp"]
        # losses are averaged over every replica: dp, and cp (each cp rank's loss is the mean
        # over its T/cp tokens of each sequence, the same count on every cp rank)
        self.pp_group, self.dp_group = self.topo.group("pp"), self.topo.group("dpcp")
        self._schedules: dict[int, Schedule] = {
            model.schedule.n_microbatches: model.sharded_schedule(model.schedule)}
        tp = model.tp
        self.runtime = PipelineRuntime(
            model.wrappers, self.pp_rank, self.topo.ranks("pp"), self.pp_group, self.device,
            self.cfg.model.d_model, measure_memory=measure_memory,
            activation_dtype=model.compute_dtype,
            seq_divisor=tp.size if tp.sequence_parallel else 1,
            boundary=StageBoundary.over_tp(tp.group, tp.sequence_parallel,
                                           self.cfg.parallel.scatter_gather, tp.stats))
        self.head_chunk = None  # the last chunk, on its rank, when the loss applies the head
        if self.cfg.train.loss_chunk_tokens:
            for chunk in model.chunks.values():
                if chunk.spec.has_head:
                    chunk.head_in_loss, self.head_chunk = True, chunk
        self.cross_entropy = cross_entropy  # the loss of tp = 1 without chunks
        if self.cfg.train.compile:
            self.cross_entropy = compiled_loss(cross_entropy)
        self.last_record: StepRecord | None = None
        self.last_comm_wait_s = 0.0
        """The last step's measured exposed data-parallel communication: seconds this rank
        blocked on its wrappers' collectives (``tessera.parallel.comm_timing``)."""
        self.noise: NoiseScale | None = None
        """The gradient noise scale's moving averages (``tessera.noise_scale``), if measured:
        ``train.noise_scale`` on a layout ``noise_scale_unsupported`` accepts."""
        p = self.cfg.parallel
        if self.cfg.train.noise_scale and noise_scale_unsupported(
                self.topo.dp, self.topo.cp, p.ep, p.dp_mode) is None:
            model.measure_pre_reduction()
            self.noise = NoiseScale()
        self.last_noise: dict | None = None
        self._pre_reduction: tuple[float, bool, int, int] = (0.0, False, 1, 1)
        """This step's (Σ g² of local gradients before their reduction, read per micro-batch,
        micro-batches, sequences per micro-batch); the sum is over dp once the loss is."""
        self.last_sync_s = 0.0
        """Wall seconds of the last step's scalar all-reduces (its loss; the gradient norm's
        squares where the norm is taken), the wait for the last rank to reach them included:
        what the planner prices on their own (``planner.comm.scalar_sync_times``)."""

    # -- what the trainer and checkpoints use --------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        return self.model.parameters()

    def optimizer(self, cfg=None) -> torch.optim.Optimizer:
        return self.model.optimizer(cfg or self.cfg.train)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.full_state_dict()

    def after_parameters_loaded(self) -> None:
        self.model.after_parameters_loaded()

    def schedule_for(self, microbatches: int) -> Schedule:
        if microbatches not in self._schedules:
            self._schedules[microbatches] = self.model.sharded_schedule(
                training_schedule(self.cfg, microbatches))
        return self._schedules[microbatches]

    # -- the step ------------------------------------------------------------------------------
    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of the last chunk's logits (vocabulary-split under tp); with
        ``train.loss_chunk_tokens`` the last chunk's output is the head's input, and the head
        and the loss run that many tokens at a time."""
        if self.head_chunk is not None:
            return chunked_head_cross_entropy(
                logits, self.head_chunk.head_weight(), targets, self.cfg.model.vocab_size,
                self.cfg.train.loss_chunk_tokens, self.model.tp)
        if self.model.tp.size > 1:
            return vocab_parallel_cross_entropy(logits, targets, self.cfg.model.vocab_size,
                                                self.model.tp)
        return self.cross_entropy(logits, targets)

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> float:
        """One step's forward and backward over this rank's micro-batches; leaves synchronized
        gradients; returns the step's mean loss (the same on every rank)."""
        for chunk in self.model.chunks.values():
            chunk.train()
            set_loss_scale(chunk, 1.0 / len(micro_batches))  # MoE auxiliary losses
        schedule = self.schedule_for(len(micro_batches))
        reduce_at = last_backwards(schedule, self.pp_rank)
        wrappers = self.model.wrappers
        logs = [w.comm_log for w in wrappers.values() if hasattr(w, "comm_log")]
        for log in logs:
            log.clear()
        self.last_sync_s = 0.0
        if self.noise is not None:
            self.model.reset_pre_reduction()

        def around(a: Action) -> contextlib.AbstractContextManager:
            if not a.kind.ends_weight_grad:  # F, and I (no gradient hook fires)
                return contextlib.nullcontext()
            return sync_context(wrappers[a.chunk], a in reduce_at)

        record = self.runtime.run(schedule, micro_batches, self.loss_fn,
                                  scale=1.0 / len(micro_batches), around=around)
        self.last_record = record
        server = self.model.server
        if server is not None:  # push/pull instead of a collective reduction
            return server.exchange(float(record.loss), self.model)
        for c in sorted(wrappers):
            wrappers[c].finish_gradient_sync()
        self.last_comm_wait_s = sum(log.exposed() for log in logs)
        self.model.sync_model_parallel_grads()
        start = time.perf_counter()
        (loss,) = all_reduce_sum([float(record.loss)], self.pp_group, self.device)
        if self.noise is None:
            (loss,) = all_reduce_sum([loss], self.dp_group, self.device)
        else:  # the local gradients' squares ride along (under ZeRO, with the norm's instead)
            local, per_microbatch = self.model.pre_reduction_sq()
            values = [loss] if self.model.sharded else [loss, float(local)]
            loss, *summed = all_reduce_sum(values, self.dp_group, self.device)
            self._pre_reduction = (summed[0] if summed else float(local), per_microbatch,
                                   len(micro_batches), micro_batches[0][0].shape[0])
        self.last_sync_s += time.perf_counter() - start
        return loss / (self.topo.dp * self.topo.cp)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm of the step's gradient (every element of the model once); with the
        noise scale measured, its step record too (``last_noise``)."""
        sq = self.model.local_grad_sq()
        if self.noise is not None:  # [all, left out of the noise scale, local before reduction]
            sq = torch.stack([sq, self.model.local_grad_sq(self.model.partial_before_reduction),
                              sq.new_tensor(self._pre_reduction[0])])
        start = time.perf_counter()
        for group in self.model.norm_groups():
            dist.all_reduce(sq, group=group)
        self.last_sync_s += time.perf_counter() - start
        if self.noise is not None:
            self.last_noise = self._noise_record(float(sq[0] - sq[1]), float(sq[2]))
            sq = sq[0]
        return float(sq.sqrt())

    def _noise_record(self, big_sq: float, small_sum: float) -> dict:
        """Fold one step into the noise scale: `big_sq` = |G_big|² of the reduced gradient
        (the global batch), `small_sum` = Σ over dp of the local gradients' squares."""
        _, per_microbatch, m, b = self._pre_reduction
        small_sq, b_small = small_batch_sq(small_sum, per_microbatch, m, b, self.topo.dp)
        return self.noise.update(small_sq, big_sq, b_small, m * b * self.topo.dp,
                                 self.cfg.data.seq_len)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global norm; gradients scaled to max_norm when above it (0: only measure)."""
        server = self.model.server
        if server is not None:
            return server.clip_grad_norm_(self, max_norm)
        norm = self.grad_norm()
        if max_norm > 0 and norm > max_norm:
            self.model.scale_grads(max_norm / (norm + 1e-6))
        return norm

    def train_step(self, batch: Sequence[MicroBatch] | Iterator[Sequence[MicroBatch]],
                   optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                   grad_clip: float = 0.0, *, update: bool = True, barrier: bool = False,
                   clock: Callable[[], float] = time.perf_counter) -> StepResult:
        """One training step, in this order: the previous gradients freed (``zero_grad``), the
        micro-batches forward and backward (gradients synchronized, ``forward_backward``), the
        global norm and clipping to `grad_clip` (0: only measured), the optimizer's step, the
        scheduler's (if any), the MoE routing bias moved from this step's load over the
        data-parallel ranks (a model with experts), and on a GPU a synchronize, so that the
        step's seconds hold its device work.

        `batch`: this step's micro-batches, or an iterator (a ``BatchLoader``) that gives them
        inside the timed step. `update=False` stops after the backward (the gradient's time: no
        norm, no optimizer or scheduler step). `barrier`: the ranks of the default group start
        the clock together, after ``zero_grad`` (which the seconds then leave out). `clock`:
        what the seconds are read on."""
        if barrier:
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
        start = clock()
        if not barrier:
            optimizer.zero_grad(set_to_none=True)
        micro_batches = batch if isinstance(batch, Sequence) else next(batch)
        loss = self.forward_backward(micro_batches)
        grad_norm = None
        if update:
            grad_norm = self.clip_grad_norm_(grad_clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            if self.cfg.model.moe_experts:  # DeepSeek-V3's routing bias, from this step's load
                update_router_bias(list(self.model.chunks.values()), self.dp_group)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = clock() - start
        return StepResult(loss, grad_norm, seconds, self.last_comm_wait_s,
                          self.last_record.busy if self.last_record else 0.0,
                          self.last_noise if update else None)

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[MicroBatch]) -> tuple[float, int]:
        """Token-summed validation loss and token count over all data-parallel ranks."""
        if self.model.server is not None:
            self.model.server.sync_replicas()
        for chunk in self.model.chunks.values():
            chunk.eval()
        if self.model.schedule_driven:  # breadth-first forwards: each chunk gathered once
            schedule = self.model.sharded_schedule(
                forward_only(training_schedule(self.cfg, len(batches))))
        else:
            schedule = forward_pass(self.model.schedule.chunk_rank, len(batches))
        record = self.runtime.run(schedule, batches,
                                  lambda logits, y: self.loss_fn(logits, y) * y.numel())
        (loss_sum,) = all_reduce_sum([float(record.loss)], self.pp_group, self.device)
        count = sum(y.numel() for _, y in batches)
        loss_sum, count = all_reduce_sum([loss_sum, count], self.dp_group, self.device)
        return loss_sum, int(count)

    # -- measured timeline ---------------------------------------------------------------------
    def gather_events(self) -> list[TimelineEvent]:
        """The last step's measured events of every pipeline rank (times from the first
        start)."""
        record = self.last_record
        mine = (record.start, record.end, record.events) if record else (0.0, 0.0, [])
        parts = [mine]
        if self.pp_group is not None and self.topo.pp > 1:
            parts = [None] * self.topo.pp
            dist.all_gather_object(parts, mine, group=self.pp_group)
        t0 = min(p[0] for p in parts)
        return [TimelineEvent(e.rank, e.kind, e.microbatch, e.chunk, e.start - t0, e.end - t0)
                for p in parts for e in p[2]]

    def measured_bubble(self, events: Sequence[TimelineEvent]) -> float:
        records = [StepRecord(loss=torch.zeros(()), events=[e for e in events if e.rank == r],
                              start=0.0, end=max((e.end for e in events if e.rank == r),
                                                 default=0.0))
                   for r in range(self.topo.pp)]
        return measured_bubble(records)

    def write_timeline(self, out: Path) -> dict | None:
        """Draw the last step's measured timeline (PNG + trace JSON) on rank 0; every pipeline
        rank takes part in gathering the events. Returns what rank 0 wrote."""
        from tessera.pipeline.timeline import write_chrome_trace, write_png

        events = self.gather_events()
        if self.topo.rank != 0:
            return None
        bubble = self.measured_bubble(events)
        schedule = self.model.schedule
        sim = simulate(schedule, StageCosts(forward=1.0, backward=2.0))
        out.mkdir(parents=True, exist_ok=True)
        title = (f"{schedule.name} measured: pp={self.topo.pp} v={schedule.virtual} "
                 f"m={schedule.n_microbatches}, bubble {bubble:.3f}")
        write_png(events, out / "pipeline_timeline.png", title=title)
        write_chrome_trace(events, out / "pipeline_trace.json")
        info = {"schedule": schedule.name, "pp": self.topo.pp, "virtual": schedule.virtual,
                "microbatches": schedule.n_microbatches, "measured_bubble": bubble,
                "simulated_bubble_equal_costs": sim.bubble_fraction,
                "png": str(out / "pipeline_timeline.png")}
        (out / "pipeline.json").write_text(json.dumps(info, indent=1))
        return info


def build_executor(cfg: Config, topo, device: torch.device, schedule: Schedule | None = None,
                   *, measure_memory: bool = False, **parallelize_kw) -> Executor:
    """parallelize + Executor: what the trainer, tests and benchmarks start from.
    `schedule` and `parallelize_kw` (regather, tp_stats) go to ``parallelize``."""
    from tessera.parallelize import parallelize

    return Executor(parallelize(cfg, topo, device, schedule, **parallelize_kw),
                    measure_memory=measure_memory)
