"""The cost of one parallel layout: per-chunk seconds and bytes with the data-parallel
collectives (:func:`layout_costs`), the pipeline ranks' model state, and what a step adds
outside the pipeline (parameter server, scalar reductions).

The parts live in their own modules: the papers' formulas in :mod:`~tessera.planner.formulas`,
communication in :mod:`~tessera.planner.comm`, a block's and a chunk's compute in
:mod:`~tessera.planner.compute`, model state and the optimizer step in
:mod:`~tessera.planner.state`, what ranks on one CPU machine add (time-sharing, stragglers,
tessera's own data-parallel work) in :mod:`~tessera.planner.local.terms`; notation as in
:mod:`~tessera.planner.workload`. Here:

- data parallelism: one all-reduce of the gradients per step (Li et al. 2020, PyTorch DDP),
  bucketed so that each chunk's reduction can overlap the remaining backward; ZeRO-1/2 replace
  it by a reduce-scatter and an all-gather of the same volume, ZeRO-3 adds a second
  all-gather of the parameters: 1.5× the volume (Rajbhandari et al. §7). Priced per unit
  (bucket, block) on the link the group crosses, and exposed only where compute cannot cover
  it (:func:`comm.exposed_behind`; a second of compute hides ``LocalTerms.dp_overlap``
  seconds of a collective: 1 on GPUs); breadth-first ZeRO-3 is placed by the schedule's
  sharding actions and simulated (:func:`zero3_by_actions`); tessera's own work around them (DDP's
  gradient hooks and division, :func:`comm.ddp_bucket_time`; ZeRO-3's per-unit buffers and views,
  :func:`~tessera.planner.local.terms.zero_unit_work`, 0 on GPUs) is exposed beside them;
- the step (:mod:`~tessera.planner.estimate`): the pipeline simulator
  (``tessera.pipeline.simulator``) runs the chosen schedule with per-chunk forward/backward
  times (compute + exposed TP and CP communication), the point-to-point costs and each
  chunk's data-parallel reduction, and returns step time, bubble and exposed DP time; the
  optimizer step (memory-bound) is added after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

from tessera.planner import engine
from tessera.planner.comm import (
    allgather_time,
    allreduce_time,
    ddp_bucket_time,
    exposed_behind,
    group_link,
    p2p_link,
    scalar_sync_times,
)
from tessera.planner.compute import ChunkCosts, ChunkList, compute_chunks, hidden_state_bytes
from tessera.planner.kernels import (
    PS_SERVE_OPS,
    Hooks,
    launch_floor,
    parameter_server_kernels,
    parameter_server_step_kernels,
)
from tessera.planner.local.terms import local_terms, rank_skew, zero_unit_work
from tessera.planner.models import ModelSpec
from tessera.planner.pipeline import head_apart, rank_chunks
from tessera.planner.rules import chunk_sizes
from tessera.planner.state import RankState, rank_state
from tessera.planner.workload import Layout, Workload


@dataclass
class LayoutCosts:
    """Everything about a layout that does not need the schedule's timing."""

    chunks: ChunkList
    """Per chunk; chunk c runs on rank c mod p. Chunks of the same shape share one object."""
    ranks: dict[int, RankState]
    """Model state of the pipeline ranks: every rank, or, when the middle chunks are all alike,
    0 (embedding), p−1 (head) and 1 standing for all the others."""
    p2p_latency: float
    p2p_bytes: float
    p2p_bandwidth: float
    dp_overlap: bool
    optimizer_time: float
    """The slowest rank's optimizer step."""
    dp_time: float
    """Data-parallel communication seconds per step on one rank (all its chunks)."""
    ps_time: float = 0.0
    """Parameter server: seconds its exchanges (and, asynchronous, its extra updates) add to a
    step after the backward."""
    sync: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """tessera's per-step scalar all-reduces (:func:`comm.scalar_sync_times`), seconds over the
    (dp·cp, tp, pp) groups."""

    @property
    def sync_time(self) -> float:
        return sum(self.sync)

    @property
    def uniform_middle(self) -> bool:
        """All chunks but the first and the last are one object (the O(1) bound applies)."""
        return self.chunks.uniform_middle


def layout_costs(w: Workload, L: Layout) -> LayoutCosts:
    """Per-chunk times and bytes of `L` on `w` (chunk c runs on rank c mod p, or in the V
    shapes' placement: ``pipeline.rank_chunks``)."""
    chunks, p2p_latency, p2p_bytes, p2p_bandwidth = chunk_costs(
        w, L.tp, L.cp, L.pp, L.dp, L.virtual_stages, L.micro_batch, L.recompute,
        L.sequence_parallel, L.zero_stage, L.dp_mode, L.cp_method, chunk_sizes(w, L),
        head_apart(L.schedule, L.pp, L.virtual_stages), zero3_by_actions(L), L.cp_ulysses)
    wanted = sorted({0, min(1, L.pp - 1), L.pp - 1}) if chunks.uniform_middle else range(L.pp)
    ranks: dict[int, RankState] = {}
    by_chunks: dict[tuple[int, ...], RankState] = {}  # ranks holding the same chunks
    for r in wanted:
        mine = tuple(id(chunks[c]) for c in rank_chunks(L.schedule, L.pp, L.virtual_stages, r))
        if mine not in by_chunks:
            by_chunks[mine] = rank_state(w, L, r, chunks)
        ranks[r] = by_chunks[mine]
    dp_time = max(sum(chunks[c].dp_total for c in rank_chunks(L.schedule, L.pp,
                                                                L.virtual_stages, r))
                  for r in ranks)
    optimizer_time = max(rs.optimizer_time for rs in ranks.values())
    return LayoutCosts(chunks=chunks, ranks=ranks, p2p_latency=p2p_latency,
                       p2p_bytes=p2p_bytes, p2p_bandwidth=p2p_bandwidth,
                       dp_overlap=local_terms(w.hardware).dp_overlap > 0,
                       optimizer_time=optimizer_time,
                       dp_time=dp_time, ps_time=_parameter_server_time(w, L, chunks,
                                                                       optimizer_time),
                       sync=scalar_sync_times(w, L) if w.tessera_engine else (0.0, 0.0, 0.0))


def _parameter_server_time(w: Workload, L: Layout, chunks: list[ChunkCosts],
                           optimizer_time: float) -> float:
    """Li et al. 2014's push/pull through one server (tessera.parallel.parameter_server): the
    server receives N−1 pushes of (S + P + 2) fp32 values and sends N−1 pulls of (S + 3), one
    message at a time over its own link (S parameter elements, P tensors, N = dp). Synchronous:
    after the slowest replica's backward. Asynchronous: nobody waits for the slowest, but the
    server also applies each of the N−1 gradients it serves (N−1 more optimizer steps). The
    kernels that pack and unpack the messages (:mod:`~tessera.planner.kernels`: a few per
    parameter tensor) cost ``op_overhead_us`` each and no less than the host's launches, as the
    optimizer's step: synchronously the step waits for those on its critical path
    (:func:`kernels.parameter_server_step_kernels`); asynchronously the server serves the
    pushes in turn (an exchange, an update and PS_SERVE_OPS kernels each) while a worker packs
    its push, waits for it to be served and unpacks the reply, and the longer loop sets the
    step (the update that serves a worker is the step's optimizer_time)."""
    if L.dp_mode == "allreduce":
        return 0.0
    hw = w.hardware
    link = p2p_link(hw, L.gpus)
    S = sum(c.params for c in chunks)
    P = sum(c.tensors for c in chunks)
    exchange = 2 * link.alpha + 4 * ((S + P + 2) + (S + 3)) * link.beta

    def launched(kernels: int) -> float:
        return max(kernels * hw.op_overhead_us * 1e-6, launch_floor(hw.launch_us, kernels))

    if L.dp_mode == "ps-async":
        served = exchange + launched(PS_SERVE_OPS)
        worker = launched(parameter_server_kernels(P, L.dp, server=False, asynchronous=True))
        return max((L.dp - 1) * (served + optimizer_time), worker + served)
    m = L.microbatches(w.global_batch)
    work = m * sum(c.forward + c.backward for c in chunks)
    return ((L.dp - 1) * exchange + launched(parameter_server_step_kernels(P, L.dp))
            + rank_skew(w, L.dp, work))


_CHUNK_FIELDS = tuple(f.name for f in fields(ChunkCosts))


def _copy(ch: ChunkCosts) -> ChunkCosts:
    """A copy of `ch` (its fields are numbers; faster than dataclasses.replace)."""
    new = object.__new__(ChunkCosts)
    for name in _CHUNK_FIELDS:
        setattr(new, name, getattr(ch, name))
    return new


@lru_cache(maxsize=65536)
def chunk_costs(w: Workload, t: int, cp: int, pp: int, dp: int, v: int, b: int,
                 recompute: str, sp: bool, zero: int, dp_mode: str,
                 cp_method: str, sizes: tuple[int, ...], head_apart: bool,
                 by_actions: bool = False, cp_ulysses: int = 2
                 ) -> tuple[list[ChunkCosts], float, float, float]:
    """Per-chunk costs (:func:`compute.compute_chunks`, with the data-parallel collectives) and the
    point-to-point latency, bytes and bandwidth (cached: a search asks for the same chunks
    under many layouts; the returned chunks are read-only)."""
    spec, hw = w.model, w.compute_hardware
    gb = w.bytes[1]
    n_chunks = pp * v
    tessera = w.tessera_engine and cp == 1
    # tessera's data-parallel wrapper's kernels in each unit's backward (kernels.Hooks; not
    # where the schedule's sharding actions reduce the gradients instead of hooks), with
    # DataParallel's bucket copies where it runs (per parameter at dp > 1; a parameter server
    # has no hooks: its copies are priced with its exchange, _parameter_server_time).
    flat = engine.flat_units(w.precision, zero, dp_mode)
    ddp = not flat and dp > 1 and dp_mode == "allreduce"
    hooks = Hooks(flat, min(zero, 2) if flat else 0, dp if flat and zero >= 2 else 1,
                  w.global_batch // (dp * b), ddp) if tessera and not by_actions else None
    base = compute_chunks(w, t, cp, pp, v, b, recompute, sp, cp_method, sizes, head_apart,
                          cp_ulysses, hooks)
    copies: dict[int, ChunkCosts] = {}  # a shared middle chunk stays one object
    chunks = ChunkList()
    for ch in base:
        if id(ch) not in copies:
            copies[id(ch)] = _copy(ch)
        chunks.append(copies[id(ch)])
    chunks.uniform_middle = base.uniform_middle
    distinct = list(copies.values())
    tp_link = group_link(hw, t)
    act = hidden_state_bytes(w, b, cp)

    # -- data parallel --------------------------------------------------------------------------
    # Every collective is priced per unit on the link its group crosses (group_link: the dp·cp
    # ranks of a tensor-parallel rank sit t apart in the (pp, dp, cp, tp) order) and only what
    # compute cannot cover is exposed (:func:`comm.exposed_behind`; never a negative hidden time).
    # ZeRO-0/1: gradients accumulate over the m micro-batches and are all-reduced once, in
    # buckets that start as the last backward completes them (Li et al. 2020, PyTorch DDP);
    # ZeRO-1 reduce-scatters them and all-gathers the updated parameters after the step.
    # ZeRO-2 reduce-scatters every micro-batch's gradients unit by unit during its backward;
    # ZeRO-3 also all-gathers each unit's parameters before its forward and again before its
    # backward, `zero_prefetch` units ahead (Rajbhandari et al. 2020 §7; FSDP, Zhao et al.
    # 2023 §3.3). A parameter server moves nothing here (``_parameter_server_time``).
    dp_group = dp * cp
    dp_link = group_link(hw, t * cp * dp, stride=t * cp)
    m = w.global_batch // (dp * b)
    ovl = local_terms(hw).dp_overlap
    pb = w.bytes[0]
    reducing = distinct if dp_mode == "allreduce" else []
    for ch in reducing:
        grads, weights = gb * ch.params, pb * ch.params
        units = _units_of(ch, sizes, chunks)
        # The reduction waits for the slowest replica: after the step's backward (ZeRO-0/1),
        # after each micro-batch (ZeRO-2/3).
        wait = rank_skew(w, dp_group, (m if zero <= 1 else 1) * (ch.forward
                                                                       + ch.backward))
        # the seconds of collective that the compute beside it hides (LocalTerms.dp_overlap)
        fwd, bwd = ovl * ch.forward, ovl * ch.backward
        if zero <= 1:
            n_buckets = max(1, math.ceil(grads / (w.bucket_mb * 2**20)))
            per_bucket = (allreduce_time(grads / n_buckets, dp_group, dp_link) if zero == 0
                          else allgather_time(grads / n_buckets, dp_group, dp_link))
            gather_after = allgather_time(weights, dp_group, dp_link) if zero == 1 else 0.0
            ddp = zero == 0 and tessera and dp_group > 1
            book = ddp_bucket_time(hw, grads, ch.tensors) if ddp else 0.0
            ch.dp_total = n_buckets * per_bucket + gather_after + wait + book
            ch.dp_reduce = (exposed_behind(per_bucket, n_buckets, bwd, 0) + gather_after + wait
                            + book)
            ch.dp_cpu = book
        else:
            ag = allgather_time(weights / units, dp_group, dp_link)
            rs = allgather_time(grads / units, dp_group, dp_link)
            # tessera's own work around each unit's collectives (ZeRO-3, calibrated: a fixed
            # part per unit and passes over the gathered parameter bytes, per micro-batch,
            # with what the collectives in flight take from the rank's core): exposed, on
            # the rank's own thread, every rank of the group at the same time when a collective
            # releases them all, so ranks that time-share cores stretch it like compute
            # (dp_cpu, shared_cpu_bound).
            book = 0.0
            if zero == 3 and tessera:
                book = zero_unit_work(
                    hw, _engine_units(spec, t, n_chunks, sizes, chunks, ch, head_apart), weights)
            if zero == 2:
                ch.zero_backward = exposed_behind(rs, units, bwd, 0) + wait
                ch.dp_reduce = units * ag  # the parameters, gathered once after the step
                ch.dp_total = m * (units * rs + wait) + units * ag
            elif by_actions:
                # Breadth-first: the schedule's sharding actions say when each chunk is
                # gathered (twice per step: its forwards, its backwards) and reduced (after
                # its last backward, while the rank's other chunks still run backward), and
                # the simulator overlaps them with compute (Lamy-Poirier 2022, §4).
                ch.unshard = units * ag
                ch.dp_reduce = units * rs + wait + book
                ch.dp_total = 2 * ch.unshard + ch.dp_reduce  # gathered twice per step
            else:
                depth = w.zero_prefetch
                ch.zero_forward = exposed_behind(ag, units, fwd, depth, lead=True)
                ch.zero_backward = (exposed_behind(ag + rs, units, bwd, depth, lead=True) + wait
                                    + book)
                ch.dp_reduce = 0.0
                ch.dp_total = m * (units * (2 * ag + rs) + wait + book)
                ch.dp_cpu = m * book

    # -- pipeline point-to-point ------------------------------------------------------------
    p2p_bytes = float(act)
    p2p_latency = 0.0
    pp_link = p2p_link(hw, t * cp * dp * pp)
    if pp > 1 and t > 1 and (w.scatter_gather or sp):
        p2p_bytes /= t
        if not sp:  # gather the full activation back on the fast link
            p2p_latency += allgather_time(act, t, tp_link)
    p2p_latency += pp_link.alpha if pp > 1 else 0.0
    if w.p2p_blocking and pp > 1:
        # The rank itself waits out each exchange (the gather included) after every forward
        # and backward; the data is there when that wait ends, so nothing more is in flight.
        for ch in distinct:
            ch.p2p_exchange = p2p_latency + p2p_bytes / pp_link.bandwidth
        p2p_latency = p2p_bytes = 0.0
    return chunks, p2p_latency, p2p_bytes, pp_link.bandwidth


def zero3_by_actions(L: Layout) -> bool:
    """ZeRO-3 under a breadth-first schedule is timed from the schedule's sharding actions
    (``schedule.add_sharding_actions``, simulated); elsewhere each micro-batch gathers and
    reduces unit by unit (depth-first runs are single actions: per micro-batch)."""
    return L.zero_stage >= 3 and L.schedule == "bfs" and L.pp * L.virtual_stages > 1 and (
        L.dp_mode == "allreduce")


def _chunk_index(ch: ChunkCosts, chunks: list[ChunkCosts]) -> int | None:
    """Where `ch` (this object, not an equal one: middle chunks may share one) first appears."""
    return next((c for c, other in enumerate(chunks) if other is ch), None)


def _units_of(ch: ChunkCosts, sizes: tuple[int, ...], chunks: list[ChunkCosts]) -> int:
    """ZeRO units of a chunk: one per block (tessera's and FSDP's wrapping), the embedding
    and the head folded into the first and last block's units."""
    c = _chunk_index(ch, chunks)
    return 1 if c is None else sizes[c]


def _engine_units(spec: ModelSpec, t: int, n_chunks: int, sizes: tuple[int, ...],
                  chunks: list[ChunkCosts], ch: ChunkCosts, head_apart: bool) -> int:
    """tessera's ZeRO units of chunk `ch` (``engine.chunk_units``: the embedding and the head
    are units of their own, beside one per block)."""
    c = _chunk_index(ch, chunks)
    return 1 if c is None else len(engine.chunk_units(spec, t, n_chunks, c, sizes[c], head_apart))
