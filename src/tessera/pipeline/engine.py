"""The pipeline engine: what the trainer drives when parallel.pp > 1.

Each pipeline rank holds the chunks the schedule places on it (``partition.Chunk``, reference
parameter names), wrapped chunk by chunk in ``DataParallel`` over the dp group. A step runs the
schedule with ``PipelineRuntime`` (gradients accumulate over the m micro-batches with the loss
scaled by 1/m), then

1. averages every chunk's gradients over dp (``finish_gradient_sync``);
2. with tied embeddings split across ranks, sums the embedding-matrix gradient of the first and
   last chunks over their rank pair, so both copies see the full gradient and stay equal;
3. sums the loss over the pp group (only the last chunk's rank has it) and averages over dp.

Collectives: pipeline p2p inside the runtime; all-reduce over dp per chunk; one all-reduce of
the tied weight's gradient over the (first, last) pair; scalar all-reduces of loss and grad norm.
Invariant: after ``forward_backward`` every parameter's gradient equals the single-device
model's gradient of the full batch's mean loss (the copy of a tied weight included).

The global gradient norm sums squares over the pp group, counting the tied weight once (on the
first chunk's rank); dp replicas hold identical gradients after averaging.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config, ConfigError
from tessera.engine import Engine, MicroBatch, all_reduce_sum
from tessera.model import Transformer, cross_entropy
from tessera.parallel.ddp import DataParallel
from tessera.parallel.recompute import apply_recompute
from tessera.pipeline.partition import Chunk, partition
from tessera.pipeline.runtime import PipelineRuntime, StepRecord, measured_bubble
from tessera.pipeline.schedule import F, Schedule, forward_only, validate
from tessera.pipeline.schedules import build_schedule
from tessera.pipeline.simulator import StageCosts, TimelineEvent, simulate
from tessera.topology import Topology


def check_pipeline(cfg: Config) -> None:
    """Refuse, before any process group exists, pipeline layouts this engine cannot run."""
    p = cfg.parallel
    for name, value in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep)):
        if value != 1:
            raise ConfigError(f"parallel.{name}", value, f"pipeline parallelism (pp={p.pp}) "
                              f"composes only with data parallelism here (must be 1)")
    if p.zero_stage != 0:
        raise ConfigError("parallel.zero_stage", p.zero_stage,
                          f"pipeline parallelism (pp={p.pp}) runs with plain data parallelism")
    if p.dp_mode != "allreduce":
        raise ConfigError("parallel.dp_mode", p.dp_mode,
                          f"pipeline parallelism (pp={p.pp}) needs 'allreduce'")
    partition(cfg.model, p.pp * p.virtual_stages, cfg.data.seq_len)
    try:
        build_schedule(p.schedule, p.pp, cfg.train.grad_accum, p.virtual_stages)
    except ConfigError as e:
        field = {"microbatches": "train.grad_accum", "virtual": "parallel.virtual_stages",
                 "schedule": "parallel.schedule", "pp": "parallel.pp"}.get(e.field_name,
                                                                            e.field_name)
        raise ConfigError(field, e.value, e.rule) from None


def forward_pass(chunk_rank: Sequence[int], n_microbatches: int) -> Schedule:
    """Evaluation order: micro-batch by micro-batch, each rank's chunks in model order (the
    globally first unfinished forward can always run, so this never deadlocks)."""
    n_ranks = max(chunk_rank) + 1
    orders = [[F(c, mb) for mb in range(n_microbatches)
               for c in range(len(chunk_rank)) if chunk_rank[c] == r] for r in range(n_ranks)]
    return forward_only(Schedule("forward", orders, len(chunk_rank), n_microbatches,
                                 tuple(chunk_rank)))


class PipelineEngine(Engine):
    """Pipeline parallel over the pp axis, data parallel over dp (see module doc)."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device,
                 split: Sequence[int] | None = None, measure_memory: bool = False,
                 schedule: Schedule | None = None):
        """`split`: blocks per chunk (default: cost-balanced). `schedule`: a custom schedule
        (any placement of chunks on ranks) instead of parallel.schedule; it is validated here,
        before any communication."""
        super().__init__(cfg, topo, device)
        self.pp_rank = topo.coords()["pp"]
        self.pp_group = topo.group("pp")
        self.dp_group = topo.group("dp")
        self._schedules: dict[int, Schedule] = {}
        self.custom = schedule is not None
        if schedule is not None:
            validate(schedule)
            if schedule.n_ranks != topo.pp:
                raise ConfigError("schedule", schedule.name, f"is for {schedule.n_ranks} "
                                  f"ranks, but parallel.pp={topo.pp}")
            self._schedules[schedule.n_microbatches] = schedule
            cfg.train.grad_accum = schedule.n_microbatches
        schedule = self.schedule_for(cfg.train.grad_accum)
        owner = schedule.chunk_rank
        specs = partition(cfg.model, len(owner), cfg.data.seq_len, split)
        self.chunks: dict[int, Chunk] = {}
        for c in schedule.chunks_of(self.pp_rank):
            shared = self.chunks[0].tok_embeddings if 0 in self.chunks else None
            self.chunks[c] = Chunk(cfg.model, specs[c], cfg.train.seed, device, shared)
            apply_recompute(self.chunks[c], cfg.parallel.recompute)
        self.ddp = {c: DataParallel(m, self.dp_group) for c, m in self.chunks.items()}
        self.tie_group = self._tie_group(topo, owner) if cfg.model.tie_embeddings else None
        self.runtime = PipelineRuntime(self.chunks, self.pp_rank, topo.ranks("pp"),
                                       self.pp_group, device, cfg.model.d_model,
                                       autocast=self.autocast_ctx, measure_memory=measure_memory)
        self.last_record: StepRecord | None = None
        self.steps_done = 0

    def schedule_for(self, microbatches: int) -> Schedule:
        p = self.cfg.parallel
        if self.custom and microbatches not in self._schedules:
            raise ConfigError("micro-batches", microbatches, "the custom schedule is for "
                              f"{next(iter(self._schedules))}")
        if microbatches not in self._schedules:
            self._schedules[microbatches] = build_schedule(p.schedule, p.pp, microbatches,
                                                           p.virtual_stages)
        return self._schedules[microbatches]

    def _tie_group(self, topo: Topology, owner: Sequence[int]) -> dist.ProcessGroup | None:
        """The (first chunk, last chunk) rank pair of every pipeline, when they differ."""
        first, last = owner[0], owner[-1]
        if first == last or not dist.is_initialized():
            return None
        mine = None
        for ranks in topo.all_groups("pp"):  # every rank creates every group, in order
            pair = [ranks[first], ranks[last]]
            group = dist.new_group(pair)
            if topo.rank in pair:
                mine = group
        return mine

    def _tied_weight(self) -> nn.Parameter | None:
        if self.tie_group is None:
            return None
        if 0 in self.chunks:
            return self.chunks[0].tok_embeddings.weight
        last = max(self.chunks)
        return self.chunks[last].output.weight if self.chunks[last].spec.has_head else None

    # -- Engine interface ----------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        return [p for c in sorted(self.chunks) for p in self.chunks[c].parameters()]

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> float:
        for chunk in self.chunks.values():
            chunk.train()
        schedule = self.schedule_for(len(micro_batches))
        with contextlib.ExitStack() as stack:
            for wrapper in self.ddp.values():
                stack.enter_context(wrapper.no_sync())
            record = self.runtime.run(schedule, micro_batches, cross_entropy,
                                      scale=1.0 / len(micro_batches))
        for c in sorted(self.ddp):
            self.ddp[c].finish_gradient_sync()
        tied = self._tied_weight()
        if tied is not None and tied.grad is not None:
            dist.all_reduce(tied.grad, group=self.tie_group)
        (loss,) = all_reduce_sum([float(record.loss)], self.pp_group, self.device)
        (loss,) = all_reduce_sum([loss], self.dp_group, self.device)
        self.last_record = record
        self.steps_done += 1
        if self.steps_done == self.cfg.train.steps:
            self.write_timeline(Path(self.cfg.train.out_dir))
        return loss / self.topo.dp

    def local_grad_sq(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for chunk in self.chunks.values():
            for name, p in chunk.named_parameters():
                if p.grad is not None and not (chunk.tied_copy and name == "output.weight"):
                    sq += p.grad.detach().double().pow(2).sum()
        return sq

    def grad_norm_groups(self) -> list[dist.ProcessGroup]:
        return [self.pp_group] if self.pp_group is not None else []

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[MicroBatch]) -> tuple[float, int]:
        for chunk in self.chunks.values():
            chunk.eval()
        schedule = forward_pass(self.schedule_for(self.cfg.train.grad_accum).chunk_rank,
                                len(batches))
        record = self.runtime.run(schedule, batches,
                                  lambda logits, y: cross_entropy(logits, y) * y.numel())
        (loss_sum,) = all_reduce_sum([float(record.loss)], self.pp_group, self.device)
        count = sum(y.numel() for _, y in batches)
        loss_sum, count = all_reduce_sum([loss_sum, count], self.dp_group, self.device)
        return loss_sum, int(count)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        local = {chunk.reference_name(name): p.detach().cpu().clone()
                 for chunk in self.chunks.values() for name, p in chunk.named_parameters()
                 if not (chunk.tied_copy and name == "output.weight")}
        parts = [local]
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            parts = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(parts, local, group=self.pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        if self.cfg.model.tie_embeddings:
            merged["output.weight"] = merged["tok_embeddings.weight"]
        with torch.device("meta"):
            order = list(Transformer(self.cfg.model).state_dict())
        return {k: merged[k].to(self.device) for k in order}

    # -- measured timeline ---------------------------------------------------------------------
    def gather_events(self) -> list[TimelineEvent]:
        """This step's measured events of every pipeline rank (times from the first start)."""
        record = self.last_record
        mine = (record.start, record.end, record.events) if record else (0.0, 0.0, [])
        parts = [mine]
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            parts = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(parts, mine, group=self.pp_group)
        t0 = min(p[0] for p in parts)
        return [TimelineEvent(e.rank, e.kind, e.microbatch, e.chunk, e.start - t0, e.end - t0)
                for p in parts for e in p[2]]

    def write_timeline(self, out: Path) -> None:
        """Draw the last step's measured timeline (PNG + trace JSON) from the first dp replica."""
        from tessera.pipeline.timeline import write_chrome_trace, write_png

        events = self.gather_events()
        if self.topo.rank != 0:
            return
        records = [StepRecord(loss=torch.zeros(()), events=[e for e in events if e.rank == r],
                              start=0.0, end=max((e.end for e in events if e.rank == r),
                                                 default=0.0))
                   for r in range(self.topo.pp)]
        bubble = measured_bubble(records)
        schedule = self.schedule_for(self.cfg.train.grad_accum)
        sim = simulate(schedule, StageCosts(forward=1.0, backward=2.0))
        out.mkdir(parents=True, exist_ok=True)
        title = (f"{schedule.name} measured: pp={self.topo.pp} v={schedule.virtual} "
                 f"m={schedule.n_microbatches}, bubble {bubble:.3f}")
        write_png(events, out / "pipeline_timeline.png", title=title)
        write_chrome_trace(events, out / "pipeline_trace.json")
        (out / "pipeline.json").write_text(json.dumps({
            "schedule": schedule.name, "pp": self.topo.pp, "virtual": schedule.virtual,
            "microbatches": schedule.n_microbatches, "measured_bubble": bubble,
            "simulated_bubble_equal_costs": sim.bubble_fraction}, indent=1))
        print(f"pipeline: {schedule.name} measured bubble {bubble:.3f} (simulated with B=2F: "
              f"{sim.bubble_fraction:.3f}); timeline in {out / 'pipeline_timeline.png'}",
              flush=True)
