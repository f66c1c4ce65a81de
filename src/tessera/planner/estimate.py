"""One layout's estimate: its peak memory, a lower bound on its step time, and its step
simulated under its schedule (``tessera.pipeline.simulator``, through
:mod:`tessera.planner.pipeline`) from the chunk costs of :func:`tessera.planner.cost.layout_costs`.

Memory: a stage holds the activations of as many (micro-batch, chunk) pairs as the schedule
keeps in flight on it, which the pipeline simulator reports (1F1B: at most p; GPipe: m;
interleaving holds more on the first rank); the first stage also holds the embedding, the last
the final norm, the LM head and fp32 logits ``4·s·b·V/t`` (Korthikanti et al. §4.3).

Reported per layout: step time, tokens/s, TFLOP/s per GPU (hardware FLOPs, counted as
Megatron-LM counts them, i.e. with recomputation), MFU and HFU, peak memory and headroom,
and the days to train on T tokens (T / tokens per second; for GPT-form models with full
recomputation this equals Megatron-LM's 8·T·P/(n·X)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from tessera.errors import UserError
from tessera.pipeline.schedules import SCHEDULES
from tessera.pipeline.simulator import StageCosts
from tessera.planner.cost import LayoutCosts, layout_costs, zero3_by_actions
from tessera.planner.formulas import hardware_flops_per_step, model_flops_per_step
from tessera.planner.local.terms import shared_cpu_bound
from tessera.planner.pipeline import (
    chunk_inflight,
    inflight,
    lower_bound,
    rank_chunks,
    time_pipeline,
)
from tessera.planner.rules import check_layout
from tessera.planner.state import RankState, rank_state
from tessera.planner.workload import GB, Layout, Workload


class PlanError(UserError):
    """No layout satisfies the request. The message is one line meant for the user."""


@dataclass
class Memory:
    """Bytes on the fullest rank, by category."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    transient: float = 0.0
    """A recomputed block's full activations and ZeRO-3's gathered parameters."""
    rank: int = 0
    """The pipeline rank these numbers belong to."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "transient": self.transient,
                "total": self.total}


@dataclass
class Estimate:
    """A layout's predicted cost. Times in seconds per optimizer step."""

    workload: Workload
    layout: Layout
    costs: LayoutCosts
    memory: Memory
    inflight: tuple[int, ...]
    lower_bound: float
    step_time: float = math.nan
    makespan: float = math.nan
    busy: float = math.nan
    exposed_dp: float = math.nan
    simulated_m: tuple[int, ...] = ()

    # -- derived --------------------------------------------------------------------------------
    @property
    def m(self) -> int:
        return self.layout.microbatches(self.workload.global_batch)

    @property
    def simulated(self) -> bool:
        return not math.isnan(self.step_time)

    @property
    def tokens_per_s(self) -> float:
        return self.workload.tokens_per_step / self.step_time

    # FLOP counts: `convention` is "full" (Megatron-LM's s² attention term; the default, as
    # the table and the published Megatron figures use it) or "causal" (half of it, as Llama 3
    # and most MFU reports count). Every figure states which (report module).
    def model_flops(self, convention: str = "full") -> float:
        w = self.workload
        return model_flops_per_step(w.model, w.global_batch, w.seq_len, convention)

    def hardware_flops(self, convention: str = "full") -> float:
        w = self.workload
        return hardware_flops_per_step(w.model, w.global_batch, w.seq_len,
                                       self.layout.recompute, convention)

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware FLOP/s per GPU in TFLOP/s (with recomputation, full attention: as
        Megatron-LM counts)."""
        return self.hardware_flops() / self.step_time / self.workload.gpus / 1e12

    def model_tflops_per_gpu(self, convention: str = "full") -> float:
        """Model FLOP/s per GPU in TFLOP/s (no recomputation; Llama 3's Table 4 column with
        convention='causal')."""
        return self.model_flops(convention) / self.step_time / self.workload.gpus / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization, full attention FLOPs (Megatron-LM's count)."""
        return self.mfu_as("full")

    @property
    def mfu_causal(self) -> float:
        """Model FLOPs utilization, causal attention FLOPs (Llama 3's count)."""
        return self.mfu_as("causal")

    def mfu_as(self, convention: str) -> float:
        w = self.workload
        return self.model_flops(convention) / self.step_time / (
            w.gpus * w.hardware.peak_tflops * 1e12)

    @property
    def hfu(self) -> float:
        w = self.workload
        return self.hardware_flops() / self.step_time / (w.gpus * w.hardware.peak_tflops * 1e12)

    @property
    def headroom(self) -> float:
        w = self.workload
        return w.hardware.memory_bytes - w.reserve_gb * GB - self.memory.total

    def days(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / 86400

    def breakdown(self) -> dict[str, float]:
        """The step split by cause on the busiest pipeline rank (sums to step_time)."""
        L = self.layout
        ranks = _busiest_rank_chunks(self)
        ch = [self.costs.chunks[c] for c in ranks]
        m = self.m
        compute = m * sum(c.forward_compute + c.backward_compute - c.recompute for c in ch)
        recompute = m * sum(c.recompute for c in ch)
        sync_dp, sync_tp, sync_pp = self.costs.sync
        tp = m * sum(c.tp_forward + c.tp_backward for c in ch) + sync_tp
        cp = m * sum(c.cp_forward + c.cp_backward for c in ch)
        zero = m * sum(c.zero_forward + c.zero_backward for c in ch)
        dp_total = sum(self.costs.chunks[c].dp_total for c in ranks)
        return {
            "compute": compute, "recompute": recompute, "tp_comm": tp, "cp_comm": cp,
            "bubble": self.makespan - self.busy,
            "dp_exposed": self.exposed_dp + zero + self.costs.ps_time + sync_dp,
            "pp_sync": sync_pp,
            "dp_hidden": max(0.0, dp_total - self.exposed_dp - zero),
            "tp_hidden": m * sum(c.tp_hidden for c in ch),
            "cp_hidden": m * sum(c.cp_hidden for c in ch),
            "optimizer": self.costs.optimizer_time,
            "time_sharing": self.step_time - (self.makespan + self.exposed_dp
                                              + self.costs.optimizer_time
                                              + self.costs.ps_time + self.costs.sync_time),
            "pp_ranks": float(L.pp),
        }

    def row(self, tokens: float | None = None) -> dict:
        L = self.layout
        out = {
            "dp": L.dp, "tp": L.tp, "pp": L.pp, "cp": L.cp, "virtual": L.virtual_stages,
            "microbatch_group": L.microbatch_group,
            "micro_batch": L.micro_batch, "microbatches": self.m, "zero": L.zero_stage,
            "recompute": L.recompute, "schedule": L.schedule,
            "sequence_parallel": L.sequence_parallel, "dp_mode": L.dp_mode,
            "cp_method": L.cp_method, "cp_ulysses": L.cp_ulysses,
            "stage_layout": list(L.stage_layout) if L.stage_layout else None,
            "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
            "mfu_causal": self.mfu_causal, "hfu": self.hfu,
            "model_tflops_per_gpu_causal": self.model_tflops_per_gpu("causal"),
            "memory_gb": self.memory.total / GB, "headroom_gb": self.headroom / GB,
        }
        if tokens:
            out["days"] = self.days(tokens)
        return out


def _busiest_rank_chunks(est: Estimate) -> list[int]:
    L = est.layout
    per_rank = [rank_chunks(L.schedule, L.pp, L.virtual_stages, r) for r in range(L.pp)]
    return max(per_rank, key=lambda cs: sum(est.costs.chunks[c].forward +
                                            est.costs.chunks[c].backward for c in cs))


# ---------------------------------------------------------------------------------------------
# One layout


def estimate(w: Workload, L: Layout, simulate: bool = True, check: bool = True,
             costs: LayoutCosts | None = None, bound: bool = True) -> Estimate:
    """Costs, memory and (if `simulate`) the simulated step time of layout `L`; `costs`: its
    ``layout_costs`` where the caller has them (they are read, never changed). Without
    `bound` the lower bound is left NaN (the search bounds only the layouts that fit:
    :func:`step_lower_bound`)."""
    why = check_layout(w, L) if check else None
    if why:
        raise PlanError(f"layout {L.describe()}: {why}")
    costs = layout_costs(w, L) if costs is None else costs
    m = L.microbatches(w.global_batch)
    held = (inflight(L.schedule, L.pp, m, L.virtual_stages, L.microbatch_group) if _pipelined(L)
            else (1,))
    memory = _memory(w, L, costs, held, m)
    est = Estimate(workload=w, layout=L, costs=costs, memory=memory, inflight=held,
                   lower_bound=step_lower_bound(w, L, costs, m) if bound else math.nan)
    if simulate:
        run_simulation(est)
    return est


def step_lower_bound(w: Workload, L: Layout, costs: LayoutCosts, m: int) -> float:
    """No schedule runs `L`'s step faster: the busiest pipeline rank's work, fill and drain
    (:func:`chunk_lower_bound`) with the step's tail, or what ranks sharing cores must do."""
    spec = SCHEDULES[L.schedule] if _pipelined(L) else None
    owner = (spec.placement(L.pp, L.pp * L.virtual_stages) if spec and spec.chunks_per_rank
             else None)
    drain = not (spec and spec.split_backward)
    return max(chunk_lower_bound(costs, L.pp, m, drain, owner) + costs.optimizer_time
               + costs.ps_time
               + costs.sync_time,
               shared_cpu_bound(w, L, costs.chunks, costs.optimizer_time,
                                sync_time=costs.sync_time))


def _pipelined(L: Layout) -> bool:
    """More than one chunk: the layout's schedule orders them (tessera runs pp = 1 with one
    chunk as F0 B0 F1 B1 ..., whatever the schedule's name)."""
    return L.pp > 1 or L.virtual_stages > 1


def chunk_lower_bound(costs: LayoutCosts, p: int, m: int, drain: bool = True,
                      owner: tuple[int, ...] | None = None) -> float:
    """:func:`tessera.planner.pipeline.lower_bound` for the planner's chunk structure (chunk
    0 and the last chunk special, all others equal) in O(1): the middle ranks all bound the
    same work, so the one with the longest fill and drain, p−2, stands for them. Chunks of
    unequal middles (tessera's cost-balanced split) take the generic O(chunks) bound.
    `drain`: False for split backwards (no drain after a rank's last W); `owner`: the rank of
    each chunk where it is not c mod p (the V shapes: the generic bound)."""
    transfer = costs.p2p_latency + costs.p2p_bytes / costs.p2p_bandwidth if p > 1 else 0.0
    chunks = costs.chunks
    n = len(chunks)
    if not costs.uniform_middle or owner is not None:
        fs, bs, ds = _per_chunk(costs)
        return lower_bound(fs, bs, ds, transfer, costs.dp_overlap, p, m, drain, owner)
    if n == 1:
        ch = chunks[0]
        return m * (ch.forward + ch.backward) + ch.dp_reduce
    first, mid, last = chunks[0], chunks[1] if n > 2 else None, chunks[-1]
    ff, fb, lf, lb = first.forward, first.backward, last.forward, last.backward
    mf, mb = (mid.forward, mid.backward) if mid is not None else (0.0, 0.0)
    v = n // p
    best = 0.0
    for r in sorted({0, max(0, p - 2), p - 1}):
        mine_first, mine_last = r == 0, r == p - 1
        n_mid = v - mine_first - mine_last
        work = n_mid * (mf + mb) + mine_first * (ff + fb) + mine_last * (lf + lb)
        reductions = ([first.dp_reduce] if mine_first else []) + (
            [last.dp_reduce] if mine_last else []) + ([mid.dp_reduce] * n_mid if n_mid else [])
        reduce = min(reductions) if costs.dp_overlap else sum(reductions)
        start = (ff + (r - 1) * mf + r * transfer) if r else 0.0
        tail = (fb + (r - 1) * mb + r * transfer) if r and drain else 0.0
        best = max(best, start + m * work + max(tail, reduce))
    return best


def _per_chunk(costs: LayoutCosts) -> tuple[list[float], list[float], list[float]]:
    """Forward, backward and reduction seconds per chunk (middle chunks share one object)."""
    memo: dict[int, tuple[float, float, float]] = {}
    for ch in costs.chunks:
        if id(ch) not in memo:
            memo[id(ch)] = (ch.forward, ch.backward, ch.dp_reduce)
    rows = [memo[id(ch)] for ch in costs.chunks]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _sharded(est: Estimate) -> int | None:
    """Breadth-first ZeRO-3 (``cost.zero3_by_actions``): the simulator places the gathers and
    reductions by the schedule's sharding actions (prefetch depth), else None (the chunk
    costs carry them per unit and micro-batch)."""
    return est.workload.zero_prefetch if zero3_by_actions(est.layout) else None


def run_simulation(est: Estimate, with_p2p: bool = True, with_gathers: bool = True) -> None:
    L, costs = est.layout, est.costs
    fs, bs, ds = _per_chunk(costs)
    sim_costs = StageCosts(
        forward=fs, backward=bs,
        p2p_latency=costs.p2p_latency if with_p2p else 0.0,
        p2p_bytes=costs.p2p_bytes if with_p2p else 0.0, p2p_bandwidth=costs.p2p_bandwidth,
        dp_reduce=ds, dp_overlap=costs.dp_overlap,
        unshard=[ch.unshard if with_gathers else 0.0 for ch in costs.chunks])
    schedule = L.schedule if _pipelined(L) else "1f1b"
    timing = time_pipeline(schedule, L.pp, est.m, L.virtual_stages, sim_costs,
                           sharded=_sharded(est), group=L.microbatch_group)
    est.step_time = max(timing.step_time + costs.optimizer_time + costs.ps_time
                        + costs.sync_time,
                        shared_cpu_bound(est.workload, L, costs.chunks, costs.optimizer_time,
                                         timing.exposed_dp, costs.sync_time))
    est.makespan = timing.makespan
    est.busy = timing.compute_time
    est.exposed_dp = timing.exposed_dp
    est.simulated_m = timing.simulated_m


def pipeline_comm_exposed(est: Estimate) -> float:
    """Seconds the point-to-point transfers add to the step: the simulated makespan with them
    minus without them (two simulations; used by --explain)."""
    free = replace(est)
    run_simulation(free, with_p2p=False)
    return max(0.0, est.makespan - free.makespan)


def gather_waits_exposed(est: Estimate) -> float:
    """Seconds breadth-first ZeRO-3's simulated parameter gathers keep compute waiting inside
    the makespan: with them minus without them (two simulations; used by --explain)."""
    if _sharded(est) is None:
        return 0.0
    free = replace(est)
    run_simulation(free, with_gathers=False)
    return max(0.0, est.makespan - free.makespan)


def _memory(w: Workload, L: Layout, costs: LayoutCosts, held: Sequence[int],
            m: int) -> Memory:
    """Peak bytes over pipeline ranks (:func:`_rank_memory`). When ranks 1..p−2 hold identical
    chunks, rank 1 stands for them with the largest in-flight count among them."""
    worst = Memory()
    every_rank = len(costs.ranks) == L.pp
    for r, state in costs.ranks.items():
        count = held[r] if every_rank or r in (0, L.pp - 1) else max(held[1:L.pp - 1])
        mem = _rank_memory(L, costs, state, r, count, m)
        if mem.total > worst.total:
            worst = mem
    return worst


def _rank_memory(L: Layout, costs: LayoutCosts, state: RankState, r: int, count: int,
                 m: int) -> Memory:
    """Pipeline rank r's bytes. With one chunk per rank it holds `count` (the schedule's
    in-flight peak) copies of its chunk's activations; breadth-first holds all m micro-batches
    of all its chunks; any other schedule with several chunks per rank is walked action by
    action (:func:`tessera.planner.pipeline.chunk_inflight`): the peak over time of the bytes
    of the (micro-batch, chunk) pairs held, each chunk weighing its own activations (the LM
    head's chunk, with its fp32 logits, is held at most a few times)."""
    chunks = [costs.chunks[c] for c in rank_chunks(L.schedule, L.pp, L.virtual_stages, r)]
    if L.virtual_stages == 1:
        acts = count * chunks[0].act_bytes
    elif L.schedule == "bfs":
        acts = m * sum(c.act_bytes for c in chunks)
    else:
        sets = chunk_inflight(L.schedule, L.pp, m, L.virtual_stages, r, L.microbatch_group)
        weights = [c.act_bytes for c in chunks]
        if min(weights) == max(weights):  # chunks alike (a middle rank): the most sets held
            acts = max(map(sum, sets)) * weights[0]
        else:
            acts = _heaviest(sets, tuple(weights))
    return Memory(params=state.params, grads=state.grads, optimizer=state.optimizer,
                  activations=acts,
                  transient=max(c.work_bytes for c in chunks) + state.zero3_buffer, rank=r)


@lru_cache(maxsize=4096)
def _heaviest(sets: tuple[tuple[int, ...], ...], weights: tuple[float, ...]) -> float:
    """The most bytes any of the in-flight `sets` holds, each chunk weighing `weights` (cached:
    layouts that differ only in ZeRO stage or data-parallel mode hold the same activations)."""
    return max(sum(n * b for n, b in zip(held, weights, strict=True)) for held in sets)


def memory_by_rank(est: Estimate) -> list[Memory]:
    """The predicted bytes of every pipeline rank (each of its dp and tp ranks holds the same),
    e.g. to compare with what each rank of a run allocates."""
    L, costs = est.layout, est.costs
    out = []
    for r in range(L.pp):
        state = costs.ranks.get(r) or rank_state(est.workload, L, r, costs.chunks)
        out.append(_rank_memory(L, costs, state, r, est.inflight[r], est.m))
    return out
