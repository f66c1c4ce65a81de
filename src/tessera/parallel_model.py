"""What one rank holds after :func:`tessera.parallelize.parallelize`: its chunks, their
data-parallel wrappers and groups (:class:`ParallelModel`), and how they are read back:
optimizer tensors, gradient ownership for the global norm, gradient synchronization across
model-parallel ranks, full state dicts in reference names; and the schedule a step runs
(:func:`training_schedule`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config, TrainConfig
from tessera.model import Transformer
from tessera.optim import adamw, add_sums_of_squares, scale_all_
from tessera.parallel.context_parallel import CPContext
from tessera.parallel.expert_parallel import (
    EPContext,
    gather_experts,
    is_expert_param,
)
from tessera.parallel.tensor_parallel import (
    ShardSpec,
    TPContext,
    gather_full,
    sum_partial_pieces,
    sync_partial_grads,
)
from tessera.parallel.zero import ZeroModel, publish_unit_parameters, scale_unit_grads
from tessera.parallel.zero_state import (
    ShardedAdamW,
    gather_owned,
    memory_report,
    storage_bytes,
    unflatten,
)
from tessera.parallel.zero_units import FlatUnit
from tessera.pipeline.partition import Chunk
from tessera.pipeline.schedule import Schedule, add_sharding_actions
from tessera.pipeline.schedules import build_schedule, is_breadth_first
from tessera.topology import Topology


def training_schedule(cfg: Config, microbatches: int | None = None) -> Schedule:
    """The schedule a step runs: parallel.schedule over pp ranks and m = train.grad_accum
    micro-batches (pp = 1: the one-rank schedule F0 B0 F1 B1 ...)."""
    p = cfg.parallel
    m = cfg.train.grad_accum if microbatches is None else microbatches
    if p.pp == 1 and p.virtual_stages == 1:
        return build_schedule("1f1b", 1, m)
    return build_schedule(p.schedule, p.pp, m, p.virtual_stages, p.microbatch_group)


def schedule_driven_zero3(cfg: Config, schedule: Schedule) -> bool:
    """ZeRO-3 run by the schedule's sharding actions: breadth-first schedules only (their
    chunks' micro-batches are consecutive, so one gather serves them all)."""
    p = cfg.parallel
    return (p.zero_stage == 3 and p.dp_mode == "allreduce"
            and is_breadth_first(schedule.name))


@dataclass
class ParallelModel:
    """What one rank holds: its chunks, their wrappers, and the groups they use."""

    cfg: Config
    topo: Topology
    device: torch.device
    schedule: Schedule
    chunks: dict[int, Chunk]
    """Chunk index -> the chunk (TP-split, recomputing) this rank runs."""
    tp: TPContext
    specs: dict[int, dict[str, ShardSpec]]
    """Chunk index -> tensor-parallel layout of each parameter (by name in the chunk)."""
    wrappers: dict[int, nn.Module] = field(default_factory=dict)
    """Chunk index -> the data-parallel wrapper the runtime calls (DataParallel, ZeroModel, or
    the chunk itself under the parameter server)."""
    tie_group: dist.ProcessGroup | None = None
    """The (first chunk's rank, last chunk's rank) pair when a tied embedding is split."""
    server: object | None = None
    """The parameter server (``dp_mode='ps'|'ps-async'``), else None."""
    cp: CPContext | None = None
    """The context-parallel attention context (cp > 1), else None."""
    ep: EPContext | None = None
    """The expert-parallel context (ep > 1), else None."""

    # -- what the rank holds -------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Parameters live in ZeRO's flat units (any stage, or bf16)."""
        return isinstance(next(iter(self.wrappers.values())), ZeroModel)

    @property
    def schedule_driven(self) -> bool:
        """ZeRO-3 gathers and reductions come from the schedule's sharding actions."""
        return any(z.schedule_driven for z in self.zeros)

    def sharded_schedule(self, schedule: Schedule) -> Schedule:
        """`schedule` as this model runs it: with the sharding actions when schedule-driven."""
        return add_sharding_actions(schedule) if self.schedule_driven else schedule

    @property
    def zeros(self) -> list[ZeroModel]:
        return [self.wrappers[c] for c in sorted(self.wrappers)] if self.sharded else []

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.train.precision == "bf16" else torch.float32

    def named_chunk_parameters(self) -> Iterator[tuple[int, str, nn.Parameter]]:
        for c in sorted(self.chunks):
            for name, p in self.chunks[c].named_parameters():
                yield c, name, p

    def parameters(self) -> list[torch.Tensor]:
        """The tensors this rank's optimizer steps: parameters (or TP shards) of its chunks,
        or, sharded, ZeRO's fp32 master shards."""
        if self.sharded:
            return [u.master for z in self.zeros for u in z.units]
        return [p for _, _, p in self.named_chunk_parameters()]

    def optimizer(self, cfg: TrainConfig) -> torch.optim.Optimizer:
        if self.sharded:
            return ShardedAdamW(self.zeros, cfg)
        if self.server is not None:
            return self.server.optimizer(self.parameters(), cfg)
        return adamw(self.parameters(), cfg)

    def after_parameters_loaded(self) -> None:
        """parameters() were overwritten (a checkpoint): refresh what derives from them."""
        publish_unit_parameters(self.zeros)

    # -- gradient ownership --------------------------------------------------------------------
    def _owned(self, c: int, name: str) -> bool:
        """Does this rank count parameter `name` of chunk `c` in the global norm? TP-sharded
        pieces on every tp rank, replicated ones on their first holder, a tied copy never."""
        chunk = self.chunks[c]
        if chunk.tied_copy and name == "output.weight":
            return False
        return self.specs[c][name].owns(self.tp.rank, self.tp.size)

    def norm_groups(self) -> list[dist.ProcessGroup]:
        """Groups over which the owned squares are summed (dp only where ZeRO shards)."""
        # cp replicas hold identical reduced gradients: counted once (ZeRO shards over dp × cp)
        axes = ("dpcp", "tp", "pp") if self.sharded else ("tp", "pp")
        return [self.topo.group(a) for a in axes
                if self.topo.group(a) is not None and self.topo.size(a) > 1]

    @torch.no_grad()
    def local_grad_sq(self, counts: Callable[[int, str], bool] | None = None) -> torch.Tensor:
        """Σ grad² over the gradient elements this rank owns (fp64); summed over norm_groups()
        it is the squared norm of the single-device model's gradient, every element once.
        `counts(chunk, name)`: only those of the owned parameters (default: all of them)."""
        owns = self._owned if counts is None else (
            lambda c, name: self._owned(c, name) and counts(c, name))
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if not self.sharded:
            experts = torch.zeros((), dtype=torch.float64, device=self.device)
            grads: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # expert or not
            for c, name, p in self.named_chunk_parameters():
                if p.grad is not None and owns(c, name):
                    grads[self.ep is not None and is_expert_param(name)].append(p.grad)
            add_sums_of_squares(sq, grads[False])
            add_sums_of_squares(experts, grads[True])
            if self.ep is not None:  # each ep rank holds other experts: their squares add up
                dist.all_reduce(experts, group=self.ep.group)
            return sq + experts
        owned: list[torch.Tensor] = []
        for c, z in zip(sorted(self.wrappers), self.zeros, strict=True):
            for u in z.units:
                grad, base = u.dp_grad_slice(), u.lo
                owned += [grad[a - base:b - base]
                          for a, b in self._slot_runs(c, u, base, base + grad.numel(), owns)]
        add_sums_of_squares(sq, owned)
        return sq

    def _slot_runs(self, c: int, u: FlatUnit, lo: int, hi: int,
                   owns: Callable[[int, str], bool]) -> list[tuple[int, int]]:
        """Ranges [a, b) of unit u's flat layout inside [lo, hi) held by slots `owns` accepts,
        adjacent ones merged."""
        runs: list[tuple[int, int]] = []
        for s in u.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b and owns(c, s.name):
                if runs and runs[-1][1] == a:
                    runs[-1] = (runs[-1][0], b)
                else:
                    runs.append((a, b))
        return runs

    # -- the gradient noise scale (tessera.noise_scale) ----------------------------------------
    def partial_before_reduction(self, c: int, name: str) -> bool:
        """Is this gradient still partial when the dp reduction reads it (summed over
        model-parallel ranks only after it, by ``sync_model_parallel_grads``)? TP partial
        pieces, and the first chunk's embedding when a tied head on another rank adds to it."""
        if self.tie_group is not None and c == 0 and name == "tok_embeddings.weight":
            return True
        return self.specs[c][name].partial_grad

    def measure_pre_reduction(self) -> None:
        """Have every data-parallel wrapper sum the squares of the local gradient it is about
        to reduce (``pre_reduce_sq``), over the elements this rank owns in the global norm
        except the partial ones (``partial_before_reduction``)."""
        def counts(c: int, name: str) -> bool:
            return self._owned(c, name) and not self.partial_before_reduction(c, name)

        for c, w in self.wrappers.items():
            if isinstance(w, ZeroModel):
                w.measure_pre_reduction({u.name: self._slot_runs(c, u, 0, u.numel, counts)
                                         for u in w.units})
            else:
                w.measure_pre_reduction({p for name, p in self.chunks[c].named_parameters()
                                         if counts(c, name)})

    def pre_reduction_sq(self) -> tuple[torch.Tensor, bool]:
        """This rank's Σ g² of its local gradients, as its wrappers read them this step, and
        whether they were read once per micro-batch (ZeRO-2/3 with hooks) rather than once per
        step (the micro-batches' sum)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for w in self.wrappers.values():
            sq += w.pre_reduce_sq
        return sq, any(z.reduces_per_microbatch for z in self.zeros)

    def reset_pre_reduction(self) -> None:
        for w in self.wrappers.values():
            if getattr(w, "pre_reduce_sq", None) is not None:
                w.pre_reduce_sq.zero_()

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient this rank holds by `factor` (the clipping) with one
        multi-tensor op: the units' buffers where ZeRO's flat units hold them, else each
        parameter's gradient where it has one."""
        if self.sharded:
            scale_unit_grads(self.zeros, factor)
            return
        scale_all_([p.grad for _, _, p in self.named_chunk_parameters() if p.grad is not None],
                   factor)

    # -- after the data-parallel reduction -----------------------------------------------------
    @torch.no_grad()
    def sync_model_parallel_grads(self) -> None:
        """Sum the gradients that are partial over model-parallel ranks: TP-replicated pieces
        (norm gains under SP, replicated kv heads) over tp, and a split tied embedding over its
        (first, last) rank pair. Linear, so it commutes with the dp mean done before it."""
        if self.tp.size > 1:
            if self.sharded:
                self._sync_partial_unit_grads()
            else:
                for c in sorted(self.chunks):
                    sync_partial_grads(self.chunks[c], self.tp)
        if self.tie_group is not None:
            grad = self._tied_grad()
            dist.all_reduce(grad, group=self.tie_group)

    def _tied_grad(self) -> torch.Tensor:
        first, last = 0, self.schedule.n_chunks - 1
        if self.sharded:
            c, unit = (first, "tok_embeddings") if first in self.chunks else (last, "output")
            return next(u for u in self.wrappers[c].units if u.name == unit).grad
        if first in self.chunks:
            return self.chunks[first].tok_embeddings.weight.grad
        return self.chunks[last].output.weight.grad

    def _held_slot_ranges(self, u: FlatUnit) -> Iterator[tuple[int, int, int]]:
        """(slot index, start, end) of each slot's part inside the gradient this rank holds
        for unit u (the whole unit at stages 0-1, the dp shard at 2-3), in u.grad's indices."""
        base = 0 if u.stage < 2 else u.lo
        for j, s in enumerate(u.slots):
            a, b = max(s.offset, base), min(s.offset + s.numel, base + u.grad.numel())
            if a < b:
                yield j, a - base, b - base

    def _sync_partial_unit_grads(self) -> None:
        """sync_partial_grads on ZeRO's gradient buffers: every tp rank at one dp position has
        the same unit layout and shard bounds, so slot ranges line up across the tp group."""
        items = []
        for c, z in zip(sorted(self.wrappers), self.zeros, strict=True):
            for u in z.units:
                for j, a, b in self._held_slot_ranges(u):
                    spec = self.specs[c][u.slots[j].name]
                    if spec.partial_grad:
                        items.append((u.grad[a:b], spec))
        sum_partial_pieces(items, self.tp)

    # -- reading the model back in reference names ---------------------------------------------
    @torch.no_grad()
    def _chunk_tensors(self, grads: bool) -> dict[int, dict[str, torch.Tensor]]:
        """Per chunk, {name in chunk: full-over-dp tensor} of weights (fp32 masters when
        sharded) or reduced gradients."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for c in sorted(self.chunks):
            if not self.sharded:
                out[c] = {n: (p.grad if grads else p).detach().float().clone()
                          for n, p in self.chunks[c].named_parameters()
                          if not grads or p.grad is not None}
                continue
            z, out[c] = self.wrappers[c], {}
            for u in z.units:
                if grads:
                    flat = u.grad if u.stage < 2 else gather_owned(z, u, u.grad)
                    tensors = unflatten(u, flat.float())
                else:
                    tensors = unflatten(u, gather_owned(z, u, u.master))
                out[c].update(tensors)
        if not grads:  # persistent buffers too (MoE routing biases), replicated everywhere
            for c in sorted(self.chunks):
                out[c].update({n: b.detach().float().clone()
                               for n, b in self.chunks[c].state_dict(keep_vars=True).items()
                               if not isinstance(b, nn.Parameter)})
        return out

    @torch.no_grad()
    def _reference_named(self, per_chunk: dict[int, dict[str, torch.Tensor]]
                         ) -> dict[str, torch.Tensor]:
        """Gather TP shards over tp and chunks over pp; reference names, on every rank."""
        local: dict[str, torch.Tensor] = {}
        for c, tensors in per_chunk.items():
            chunk = self.chunks[c]
            for name in sorted(tensors):
                if chunk.tied_copy and name == "output.weight":
                    continue
                spec = self.specs[c].get(name, ShardSpec())  # a buffer: replicated
                full = gather_full(tensors[name], spec, self.tp)
                if self.ep is not None and is_expert_param(name):
                    full = gather_experts(full, self.ep.group)
                local[chunk.reference_name(name)] = full.cpu()
        parts = [local]
        pp_group = self.topo.group("pp")
        if pp_group is not None and self.topo.pp > 1:
            parts = [None] * self.topo.pp
            dist.all_gather_object(parts, local, group=pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        if self.cfg.model.tie_embeddings and "tok_embeddings.weight" in merged:
            merged["output.weight"] = merged["tok_embeddings.weight"]
        with torch.device("meta"):
            order = list(Transformer(self.cfg.model).state_dict())
        return {k: merged[k].to(self.device) for k in order if k in merged}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference model's state dict (fp32), gathered from every shard, on every rank."""
        if self.server is not None:
            self.server.sync_replicas()
        return self._reference_named(self._chunk_tensors(grads=False))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The step's synchronized gradients by reference name, gathered, on every rank
        (tests: compared with the single-device model's)."""
        return self._reference_named(self._chunk_tensors(grads=True))

    # -- memory ---------------------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Parameter, gradient and optimizer-state bytes this rank holds between steps."""
        if self.sharded:
            total = {"params": 0, "grads": 0, "optimizer": 0}
            for z in self.zeros:
                for k, v in memory_report(z).items():
                    total[k] += v
            return total
        n = sum(p.numel() for p in self.parameters())
        return {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}

    def allocated_model_state(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of the storages actually allocated for parameters, gradients and optimizer
        state, each storage counted once under the first of these it appears in: the chunks'
        parameters and ZeRO's parameter shards; .grad, ZeRO's gradient buffers and DDP's bucket
        buffers (which also hold one used-flag per parameter); the optimizer's parameters (ZeRO's
        fp32 masters) and state (Adam's moments; torch AdamW's step counts)."""
        seen: set[int] = set()
        params = [p for _, _, p in self.named_chunk_parameters()]
        units = [u for z in self.zeros for u in z.units]
        buckets = [b.flat for w in self.wrappers.values() for b in getattr(w, "buckets", ())]
        opt = [p for g in optimizer.param_groups for p in g["params"]]
        opt += [v for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
        return {"params": storage_bytes([*params, *(u.shard for u in units)], seen),
                "grads": storage_bytes([*(p.grad for p in params), *(u.grad for u in units),
                                        *buckets], seen),
                "optimizer": storage_bytes(opt, seen)}
