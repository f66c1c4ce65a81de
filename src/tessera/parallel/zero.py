"""ZeRO stages 0-3: shard optimizer state, gradients and parameters over the data-parallel group.

Rajbhandari, Rasley, Ruwase and He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020 (arXiv:1910.02054). Stage 1 is the paper's P_os, stage 2 P_os+g,
stage 3 P_os+g+p; stage 0 is plain data parallelism on the same flat buffers (the baseline).

Units (``zero_units.py``). The model is cut into units: the token embedding, each transformer
block, and the head (final norm + LM head); with tied embeddings the embedding and the head
share a weight and form one unit. A unit's parameters are flattened into one buffer padded to a
multiple of N (the dp world size); rank r owns elements [r*S, (r+1)*S), S = padded / N: its
shard. The model's parameters become views into the unit buffer
(``p.data = flat[offset:offset+n].view(shape)``), so the model code and autograd see ordinary
parameters.

Collectives, all on the dp group handed in (Psi = parameter count):

- stage 0: all-reduce each unit's gradient after the step's last backward (2 Psi per rank).
- stage 1: the same all-reduce; each rank steps only its fp32 master shard, then the unit's
  parameters are all-gathered (in place) after the optimizer step.
- stage 2: each unit's gradient is reduce-scattered as soon as its backward ends (every
  micro-batch), the full gradient is dropped and only the shard is kept; all-gather after the step.
  A reduction overlaps the next unit's backward until that unit's first gradient arrives.
- stage 3: parameters live only as shards. A unit is all-gathered just before its forward (the
  next unit is prefetched with an asynchronous all-gather so the transfer overlaps compute) and
  freed after it; gathered again just before its backward (prefetching the unit whose backward
  comes next) and freed when its backward ends. The unit whose backward runs
  first stays gathered from its forward into the backward, and an embedding-only unit is not
  gathered for backward (an embedding's gradient needs the indices, not the weight). No
  all-gather after the step: each rank's optimizer updates its parameter shard in place.

Schedule-driven stage 3 (``schedule_driven=True``, for breadth-first pipeline schedules; Lamy-
Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023). No hooks: the pipeline schedule's
sharding actions (``pipeline.schedule.add_sharding_actions``) call ``unshard()`` (start the
all-gather of every unit of this chunk), ``wait_unsharded()`` (before the chunk's next compute),
``reshard()`` (free them) and ``reduce_grad()`` (start the reduce-scatter of each unit's
gradient, accumulated in the parameters' ``.grad`` over all of the step's micro-batches while
the chunk was gathered). So a chunk is gathered once per run of its micro-batches instead of
once per micro-batch, and reduced once per step; the price is one chunk's full gradient held
from its first backward to its ``REDUCE_GRAD`` (breadth-first: the length of its backward run).

Mechanism. Freeing resizes the unit buffer's storage to 0 bytes; gathering resizes it back and
fills it. The parameter views, and the tensors autograd saved for backward, follow the storage,
and because the collective writes through the flat buffer (its own version counter) the saved
parameters do not look modified in place. Module forward pre-hooks gather, a forward hook on
the unit's last module frees; the autograd function ``GatherBeforeBackward`` sits on each
unit's output and gathers the unit when that output's gradient arrives, i.e. just before the
unit's backward; per-parameter post-accumulate-grad hooks tell when a unit's backward is done.

Invariants. After ``finish_gradient_sync()`` the gradient slice a rank owns is the mean over dp
ranks (stages 0-1 hold it in full, 2-3 only the shard); after the optimizer's step every rank's
compute parameters equal the cast of the fp32 masters (gathered, for stages 0-2). Mixed
precision keeps bf16 parameters and gradients and fp32 master weights and Adam moments.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tessera.collectives.algorithms import all_gather_single, reduce_scatter_single
from tessera.model import Transformer
from tessera.optim import add_sums_of_squares, scale_all_
from tessera.parallel.comm_timing import CommLog
from tessera.parallel.zero_units import FlatUnit, Slot, transformer_units


class GatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's output; its backward gathers the unit before the unit's backward."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], x: torch.Tensor) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.hook()
        return None, grad


class ZeroModel(nn.Module):
    """Wraps a model for ZeRO `stage` over `group`; see the module docstring.

    Every rank must start from the same weights (tessera's initialization depends only on the
    seed and the parameter's name); rank 0's are broadcast anyway. Parameters and gradients are
    kept in `dtype` (float32 or bfloat16), master weights in float32.
    """

    def __init__(self, module: Transformer, group: dist.ProcessGroup | None, *, stage: int,
                 dtype: torch.dtype = torch.float32,
                 units: list[tuple[str, list[nn.Module]]] | None = None,
                 schedule_driven: bool = False,
                 unit_groups: dict[str, tuple[dist.ProcessGroup | None, int]] | None = None):
        super().__init__()
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage={stage!r}: must be 0, 1, 2 or 3")
        if schedule_driven and stage != 3:
            raise ValueError(f"schedule_driven=True needs zero stage 3, got stage={stage}")
        self.module, self.group, self.stage, self.dtype = module, group, stage, dtype
        self.schedule_driven = schedule_driven
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.events: list[tuple[str, str]] = []
        """What the last forward and backward did, in order, as (what, unit name): "gather"
        (an all-gather started), "forward" (the unit's forward ended), "grad" (its first
        gradient arrived), "backward" (its last), "reduce" (its gradient reduction started),
        "reduced" (waited for), "free" (its gathered parameters released). For tests of the
        prefetching, overlap and freeing promised above."""
        self.comm_log = CommLog()
        """The same steps as `events`, timestamped, plus every wait on a gather or reduction
        handle (tessera.parallel.comm_timing); kept over the whole step (the executor clears
        it), unlike `events`, which restarts at each forward."""
        self.units: list[FlatUnit] = []
        self.unit_groups = unit_groups or {}
        names = {id(p): n for n, p in module.named_parameters()}
        for name, modules in units or transformer_units(module):
            self.units.append(self._build_unit(name, modules, names))
        covered = {id(p) for u in self.units for p in u.params}
        missing = [n for n, p in module.named_parameters() if id(p) not in covered]
        if missing:
            raise ValueError(f"parameters in no ZeRO unit: {', '.join(missing)}")
        self.pre_reduce_sq: torch.Tensor | None = None
        """With ``measure_pre_reduction``: Σ g² (fp64) of the counted ranges of each unit's
        local gradient as its reduction reads it (the gradient noise scale); stages 2-3 with
        hooks add one sum per micro-batch (``reduces_per_microbatch``)."""
        self._pre_reduce_ranges: dict[str, list[tuple[int, int]]] = {}
        self._sync = True
        # (work, what to do when it is done, the buffer it reads, kept alive until then)
        self._reduces: deque[tuple[dist.Work, Callable[[], object] | None, torch.Tensor]] = deque()
        self._reducing: deque[str] = deque()
        self.forward_order: list[int] = []    # unit indices by first use in the last forward
        self.backward_order: list[int] = []   # unit indices by backward start, last forward
        self._seen: list[int] = []
        self._done: list[int] = []
        self.peak_gathered_bytes = 0
        """Stage 3: the most bytes of gathered unit parameters that existed at once."""
        self._install_hooks()

    # -- construction --------------------------------------------------------------------------
    @torch.no_grad()
    def _build_unit(self, name: str, modules: list[nn.Module], names: dict[int, str]) -> FlatUnit:
        params, slots, offset = [], [], 0
        # A parameter belongs to the first unit that lists it (expert units come before their
        # block's unit, which then holds the block's other parameters).
        taken = {id(q) for v in self.units for q in v.params}
        for m in modules:
            for p in m.parameters():
                if any(p is q for q in params) or id(p) in taken:
                    continue
                params.append(p)
                slots.append(Slot(names[id(p)], offset, p.shape, p.ndim >= 2))
                offset += p.numel()
        group, divisor = self.unit_groups.get(name, (self.group, None))
        u = FlatUnit(name, modules, slots, params, stage=self.stage,
                     world=dist.get_world_size(group), rank=dist.get_rank(group),
                     dtype=self.dtype, group=group, divisor=divisor)
        full32 = torch.zeros(u.padded, dtype=torch.float32, device=params[0].device)
        for s, p in zip(slots, params, strict=True):
            full32[s.offset:s.offset + s.numel].copy_(p.reshape(-1))
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(full32, src=src, group=group)
        u.full = full32 if self.dtype == torch.float32 else full32.to(self.dtype)
        for s, p in zip(slots, params, strict=True):
            p.data = u.full[s.offset:s.offset + s.numel].view(s.shape)
        mixed = self.dtype != torch.float32
        if self.stage == 3:
            u.shard = u.full[u.lo:u.hi].clone()
            u.master = full32[u.lo:u.hi].clone() if mixed else u.shard
            self._free(u)
        else:
            u.shard = u.full[u.lo:u.hi]
            u.master = full32[u.own_lo:u.own_hi].clone() if mixed else u.full[u.own_lo:u.own_hi]
        numel = u.padded if self.stage < 2 else u.shard_numel
        u.grad = torch.zeros(numel, dtype=self.dtype, device=full32.device)
        if self.stage < 2:
            for s, p in zip(slots, params, strict=True):
                p.grad = u.grad[s.offset:s.offset + s.numel].view(s.shape)
        return u

    def _install_hooks(self) -> None:
        if self.schedule_driven:
            return  # the schedule's sharding actions do the hooks' work
        for i, u in enumerate(self.units):
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_ready(i))
            if self.stage < 3:
                continue
            for m in u.modules:
                m.register_forward_pre_hook(lambda _m, _a, i=i: self._pre_forward(i))
            u.modules[-1].register_forward_hook(lambda _m, _a, out, i=i: self._post_forward(i, out))

    @property
    def reduces_per_microbatch(self) -> bool:
        """Each micro-batch's gradient is reduced on its own (stages 2-3 with hooks)."""
        return self.stage >= 2 and not self.schedule_driven

    def measure_pre_reduction(self, ranges: dict[str, list[tuple[int, int]]] | None = None
                              ) -> None:
        """From now on add Σ g² over `ranges` (unit name -> [(start, end)] in the unit's flat
        layout; default: every parameter) to ``pre_reduce_sq`` just before each unit's gradient
        reduction starts (the caller zeroes it)."""
        self._pre_reduce_ranges = ranges if ranges is not None else {
            u.name: [(0, u.numel)] for u in self.units}
        self.pre_reduce_sq = torch.zeros((), dtype=torch.float64, device=self.units[0].grad.device)

    def _measure_pre_reduction(self, u: FlatUnit, flat: torch.Tensor) -> None:
        if self.pre_reduce_sq is not None:
            add_sums_of_squares(self.pre_reduce_sq,
                                [flat[a:b] for a, b in self._pre_reduce_ranges.get(u.name, ())])

    # -- forward / backward --------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.schedule_driven:
            self.wait_unsharded()
            return self.module(*args, **kwargs)
        self._seen, self._done, self.events = [], [], []
        out = self.module(*args, **kwargs)
        self.forward_order = self._seen
        self.backward_order = [i for i in self._done[::-1] if self.units[i].gather_for_backward]
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stages 0-1: accumulate gradients locally, reduce on the next backward outside.

        Stages 2-3 reduce-scatter every micro-batch anyway (keeping full gradients across
        micro-batches would give up what those stages save)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _pre_forward(self, i: int) -> None:
        if i in self._seen:
            return
        self._seen.append(i)
        self._gather(self.units[i])
        self._prefetch_after(i, self.forward_order)

    def _post_forward(self, i: int, out: torch.Tensor) -> torch.Tensor:
        self._done.append(i)
        self.events.append(("forward", self.units[i].name))
        if not (torch.is_grad_enabled() and self.units[i].gather_for_backward):
            self._free(self.units[i])
            return out
        if not (self.backward_order and self.backward_order[0] == i):
            self._free(self.units[i])
        return GatherBeforeBackward.apply(lambda: self._pre_backward(i), out)

    def _pre_backward(self, i: int) -> None:
        self._gather(self.units[i])
        self._prefetch_after(i, self.backward_order)

    def _prefetch_after(self, i: int, order: list[int]) -> None:
        if i in order and order.index(i) + 1 < len(order):
            u = self.units[order[order.index(i) + 1]]
            if not u.resident and u.pending is None:
                self._start_gather(u)

    def _grad_ready(self, i: int) -> None:
        u = self.units[i]
        u.grads_ready += 1
        if u.grads_ready == 1:
            self.events.append(("grad", u.name))
            # This unit's gradients start to pile up: finish the reduction of the unit before
            # it (in flight since that unit's backward ended, overlapping the compute since) and
            # drop its full gradient, so one unit's full gradient exists at a time.
            self._drain(0)
        if u.grads_ready < len(u.params):
            return
        u.grads_ready = 0
        self.events.append(("backward", u.name))
        if self.stage < 2:
            if self._sync:
                self._measure_pre_reduction(u, u.grad)
                u.grad.div_(u.divisor)
                work = dist.all_reduce(u.grad, group=u.group, async_op=True)
                self._reduces.append((work, None, u.grad))
                self._log_reduce(u)
            return
        if self.stage == 3:
            self._free(u)  # before flattening the gradients: never params and two grad copies
        self._reduce_scatter(u)

    @torch.no_grad()
    def _reduce_scatter(self, u: FlatUnit) -> None:
        grads = [p.grad.reshape(-1) for p in u.params]
        pad = u.padded - u.numel
        if pad:
            grads.append(torch.zeros(pad, dtype=self.dtype, device=u.grad.device))
        full_grad = torch.cat(grads)  # (padded,)
        self._measure_pre_reduction(u, full_grad)
        for p in u.params:
            p.grad = None
        # Sum, then divide the shard (1/N of the work of dividing the full gradient).
        self._log_reduce(u)
        if u.grad_fresh:  # first micro-batch of the step: reduce straight into the shard
            u.grad_fresh = False
            work = reduce_scatter_single(u.grad, full_grad, group=u.group, async_op=True)
            self._reduces.append((work, lambda: u.grad.div_(u.divisor), full_grad))
            return
        part = torch.empty_like(u.grad)
        work = reduce_scatter_single(part, full_grad, group=u.group, async_op=True)
        self._reduces.append((work, lambda: u.grad.add_(part, alpha=1 / u.divisor), full_grad))

    def _drain(self, limit: int) -> None:
        """Finish the oldest reductions until at most `limit` are in flight."""
        while len(self._reduces) > limit:
            work, on_done, _keep_alive = self._reduces.popleft()
            with self.comm_log.wait(self._reducing[0]):
                work.wait()
            if on_done is not None:
                on_done()
            self.events.append(("reduced", self._reducing.popleft()))

    def _log_reduce(self, u: FlatUnit) -> None:
        self.events.append(("reduce", u.name))
        self.comm_log.mark("reduce", u.name)
        self._reducing.append(u.name)  # names of self._reduces' entries, same order

    def finish_gradient_sync(self) -> None:
        """Wait for every gradient reduction of the step (call after the last backward)."""
        self.comm_log.mark("backward_end")
        self._drain(0)
        if self.schedule_driven:
            left = [u.name for u in self.units if any(p.grad is not None for p in u.params)]
            if left:
                raise RuntimeError(f"ZeRO units {', '.join(left)}: gradients never reduced "
                                   f"(the schedule needs a REDUCE_GRAD after the chunk's last "
                                   f"backward)")
        for u in self.units:
            if u.grads_ready:
                raise RuntimeError(f"ZeRO unit {u.name}: only {u.grads_ready} of "
                                   f"{len(u.params)} parameters received a gradient")
            if self.stage == 3 and u.resident:
                self._free(u)

    # -- schedule-driven stage 3: the sharding actions ------------------------------------------
    def unshard(self) -> None:
        """UNSHARD: start the all-gather of every unit not gathered yet (asynchronous)."""
        for u in self.units:
            if not u.resident and u.pending is None:
                self._start_gather(u)

    def wait_unsharded(self) -> None:
        """Wait for the all-gathers `unshard()` started; the chunk can compute after this."""
        for u in self.units:
            if not u.resident and u.pending is None:
                raise RuntimeError(f"ZeRO-3 unit {u.name} is used while sharded (the schedule "
                                   f"needs an UNSHARD of its chunk before this compute)")
            self._gather(u)

    def reshard(self) -> None:
        """RESHARD: free every unit's gathered parameters (saved activations keep their views;
        the next UNSHARD refills the same storage)."""
        for u in self.units:
            self._free(u)

    def reduce_grad(self) -> None:
        """REDUCE_GRAD: start the reduce-scatter of each unit's gradient accumulated over the
        step's micro-batches (``finish_gradient_sync`` waits for it)."""
        for u in self.units:
            if any(p.grad is None for p in u.params):
                missing = [s.name for s, p in zip(u.slots, u.params, strict=True)
                           if p.grad is None]
                raise RuntimeError(f"ZeRO unit {u.name}: no gradient for {', '.join(missing)} "
                                   f"at REDUCE_GRAD (is it before the chunk's backwards?)")
            self._reduce_scatter(u)

    def wait_reduced(self) -> None:
        """Wait for the reduce-scatters `reduce_grad()` started (and drop the full gradients
        they read); ``finish_gradient_sync`` does it too."""
        self._drain(0)

    # -- gathering (stage 3) -------------------------------------------------------------------
    def _start_gather(self, u: FlatUnit) -> None:
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        u.pending = all_gather_single(u.full, u.shard, group=u.group, async_op=True)
        self.events.append(("gather", u.name))
        self.comm_log.mark("gather", u.name)
        gathered = sum(v.full.untyped_storage().nbytes() for v in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    def _gather(self, u: FlatUnit) -> None:
        if u.resident:
            return
        if u.pending is None:
            self._start_gather(u)
        with self.comm_log.wait(u.name):
            u.pending.wait()
        u.pending, u.resident = None, True

    def _free(self, u: FlatUnit) -> None:
        if u.pending is not None:
            with self.comm_log.wait(u.name):
                u.pending.wait()
            u.pending = None
        if u.full.untyped_storage().nbytes():
            self.events.append(("free", u.name))
        u.full.untyped_storage().resize_(0)
        u.resident = False

    def live_tensors(self) -> list[torch.Tensor]:
        """Every model-state tensor the wrapper holds now: parameters (gathered or not), shards,
        gradients and gradient buffers, and full gradients waiting for their reduction."""
        params = list(self.module.parameters())
        return [*params, *(p.grad for p in params if p.grad is not None),
                *(u.shard for u in self.units), *(u.grad for u in self.units),
                *(buf for _, _, buf in self._reduces)]

    # -- around the optimizer ------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the units' gradient buffers (``zero_unit_grads``)."""
        zero_unit_grads([self])

    @torch.no_grad()
    def local_grad_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's dp slice of every unit's gradient (fp64)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.units[0].grad.device)
        add_sums_of_squares(sq, [u.dp_grad_slice() for u in self.units])
        return sq


# ---------------------------------------------------------------------------------------------
# Around the optimizer: every unit of a rank's ZeroModels (its pipeline chunks) at once, each
# elementwise op one multi-tensor op (one dispatched op; on a GPU a few launches per list).


@torch.no_grad()
def zero_unit_grads(zeros: Sequence[ZeroModel]) -> None:
    """Zero the gradient buffers of every unit of `zeros` (reused, never set to None) with one
    ``torch._foreach_zero_``; at stages 2-3 each buffer is marked as holding nothing of the
    step yet."""
    units = [u for z in zeros for u in z.units]
    for z in zeros:
        if z.stage >= 2:
            for u in z.units:
                u.grad_fresh = True
    if units:
        torch._foreach_zero_([u.grad for u in units])


@torch.no_grad()
def scale_unit_grads(zeros: Sequence[ZeroModel], factor: float) -> None:
    """Multiply the gradient buffer of every unit of `zeros` by `factor` (the clipping) with
    one multi-tensor op (``optim.scale_all_``: per element each buffer's ``mul_``)."""
    scale_all_([u.grad for z in zeros for u in z.units], factor)


@torch.no_grad()
def publish_unit_parameters(zeros: Sequence[ZeroModel]) -> None:
    """Make the compute parameters equal the (just stepped) fp32 masters on every rank: the
    masters that are not the parameters themselves (bf16: every one) copied and cast into
    their owned range of the parameters by one ``torch._foreach_copy_`` (the same rounding as
    ``copy_``), then, at stages 1-2, each unit all-gathered from its shards."""
    targets, masters = [], []
    for z in zeros:
        for u in z.units:
            target = u.shard if z.stage == 3 else u.full[u.own_lo:u.own_hi]
            if target.data_ptr() != u.master.data_ptr():
                targets.append(target)
                masters.append(u.master)
    if targets:
        torch._foreach_copy_(targets, masters)
    works = [all_gather_single(u.full, u.shard, group=u.group, async_op=True)
             for z in zeros if z.stage in (1, 2) for u in z.units]
    for w in works:
        w.wait()
