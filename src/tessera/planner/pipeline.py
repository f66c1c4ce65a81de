"""The planner's use of the pipeline simulator: cached, m-capped, never a second derivation.

Every bubble the planner reports comes from ``tessera.pipeline.simulator.simulate`` run on the
schedule ``tessera.pipeline.schedules`` generates. Two facts keep the search fast:

1. *In-flight activations depend only on the order of actions*, not on their costs. Each
   registered schedule gives the per-rank peak as a closed form
   (``ScheduleSpec.closed_form_inflight``, used by :func:`inflight`), checked equal to
   ``simulator.peak_inflight`` of the generated schedule for every (schedule, p, v, m) of a
   grid in the tests; a schedule registered without one is generated and counted.
2. *Step time grows linearly in m once the pipeline is in its steady state*: every p further
   micro-batches add the same time (the steady state of every schedule here repeats with
   period p). A schedule with more than ``EXACT_ACTIONS`` compute actions is therefore
   simulated at m₁ ≡ m (mod p), the smallest such m₁ ≥ p (≥ 2p for breadth-first and
   unknown schedules, whose transient is longer), and at m₁ + p, and extrapolated in steps
   of p. With equal per-chunk costs and free communication this is exact (the closed
   forms hold at every m ≥ p); with the planner's cost structure (a heavier last chunk, p2p
   latency, data-parallel reductions) the tests bound the error against full simulations.

Simulation results are cached by (schedule, p, v, m simulated, costs normalized by the
largest forward time and rounded to 6 significant digits): time is homogeneous of degree one
in all costs, so layouts whose costs differ only by a common factor share one simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tessera.pipeline.schedule import Schedule, add_sharding_actions
from tessera.pipeline.schedules import SCHEDULES
from tessera.pipeline.simulator import Prepared, StageCosts, peak_inflight, prepare, simulate

EXACT_ACTIONS = 3000
"""Largest schedule (compute actions: :func:`compute_actions`) simulated at its true m."""
UNKNOWN_STEADY_AFTER_PERIODS = 2
"""Periods before the steady state for a name the registry does not hold; a registered
schedule says so itself (``ScheduleSpec.steady_after_periods``, whose default is this same
cautious 2; tests/test_planner_search.py checks the extrapolation against full
simulations)."""


@dataclass(frozen=True)
class PipelineTiming:
    """What the planner takes from one simulation (seconds)."""

    step_time: float
    """Makespan plus the exposed data-parallel reduction."""
    makespan: float
    compute_time: float
    """Busiest rank's compute."""
    exposed_dp: float
    simulated_m: tuple[int, ...]
    """The micro-batch counts actually simulated (one: exact; two: extrapolated)."""

    @property
    def bubble(self) -> float:
        return self.makespan - self.compute_time


def build(name: str, p: int, m: int, v: int, group: int = 0) -> Schedule:
    """The registered generator's schedule, without the validator's deadlock search.

    ``build_schedule`` validates every schedule, which costs minutes at p = 64; the generators
    are validated by the pipeline tests for the sizes they check, and the simulator itself
    raises if a schedule cannot run."""
    spec = SCHEDULES[name]
    why = spec.refusal(p, m, v, group)
    if why:
        raise ValueError(f"microbatches={m}: {why}")
    return Schedule(name, spec.orders(p, m, v, group), p * v, m, spec.placement(p, p * v))


@lru_cache(maxsize=4096)
def rank_chunks(name: str, p: int, v: int, rank: int) -> tuple[int, ...]:
    """The chunks pipeline rank `rank` holds, ascending: the schedule's placement (chunk c on
    rank c mod p, or the V shapes' chunks r and 2p-1-r)."""
    spec = SCHEDULES.get(name)
    if spec is None or not spec.chunks_per_rank:
        return tuple(range(rank, p * v, p))
    placement = spec.placement(p, p * v)
    return tuple(c for c in range(p * v) if placement[c] == rank)


def head_apart(name: str, p: int, v: int) -> bool:
    """Whether the last chunk (the LM head) runs on another pipeline rank than chunk 0 (the
    embedding): a tied head then keeps a copy of the embedding matrix (``parallelize``'s tie
    group), where on one rank it reads chunk 0's (pp = 1, the V shapes' rank 0)."""
    return p * v - 1 not in rank_chunks(name, p, v, 0)


def period(p: int, group: int = 0) -> int:
    """Micro-batches after which a schedule's steady state repeats: p, or with interleaved's
    micro-batch groups of G, lcm(p, G) (the groups realign with the ring)."""
    return math.lcm(p, group or p)


def inflight(name: str, p: int, m: int, v: int = 1, group: int = 0) -> tuple[int, ...]:
    """Per rank, the peak number of (micro-batch, chunk) activation sets held: the schedule's
    registered closed form (``ScheduleSpec.closed_form_inflight``), else counted over the
    generated schedule."""
    spec = SCHEDULES.get(name)
    if spec is not None and spec.closed_form_inflight is not None:
        return spec.closed_form_inflight(p, m, v, group)
    return _counted_inflight(name, p, m, v, group)


def chunk_inflight(name: str, p: int, m: int, v: int, rank: int,
                   group: int = 0) -> tuple[tuple[int, ...], ...]:
    """Rank `rank`'s in-flight activation sets, per chunk it owns, at every point where the
    count may peak (after each forward; those no other point exceeds in every chunk), walked
    over the generated schedule's actions: the per-chunk memory walk. Large m is walked at the
    smallest m' ≡ m (mod the period, p or lcm(p, G)) past the warm-up (m' ≥ 2 periods): the
    counts only repeat after that, so the peak is the same."""
    per = period(p, group)
    if m > 3 * per:
        m = 2 * per + m % per
    return _chunk_inflight(name, p, m, v, group, rank)


@lru_cache(maxsize=256)
def _chunk_inflight(name: str, p: int, m: int, v: int, group: int,
                    rank: int) -> tuple[tuple[int, ...], ...]:
    from tessera.pipeline.schedule import Kind

    schedule = _built(name, p, m, v, group)
    mine = schedule.chunks_of(rank)
    slot = {c: i for i, c in enumerate(mine)}
    held = [0] * len(mine)
    peaks: set[tuple[int, ...]] = {tuple(held)}
    rising = False
    for a in schedule.actions[rank]:
        if a.kind is Kind.F:
            held[slot[a.chunk]] += 1
            rising = True
        elif a.kind.ends_weight_grad:  # B, or W: a set is held until its W (W_HELD)
            if rising:  # only the last of a run of forwards can peak: the others are below
                peaks.add(tuple(held))
                rising = False
            held[slot[a.chunk]] -= 1
    if rising:
        peaks.add(tuple(held))
    return _undominated(peaks)


@lru_cache(maxsize=128)
def _built(name: str, p: int, m: int, v: int, group: int) -> Schedule:
    """One schedule walked for the few ranks the planner weighs (first, second, last). The
    1T search walks 126 distinct ones (interleaved, the V shapes), a few MB in all; with
    room for 16 it regenerated them 398 times."""
    return build(name, p, m, v, group)


def _undominated(points: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The points no other point is at least as large as in every coordinate: the only ones
    that can hold the most bytes, whatever (non-negative) bytes each chunk weighs."""
    ordered = sorted(points, key=sum, reverse=True)
    kept: list[tuple[int, ...]] = []
    for x in ordered:
        if not any(all(a >= b for a, b in zip(k, x, strict=True)) for k in kept):
            kept.append(x)
    return tuple(sorted(kept))


@lru_cache(maxsize=256)
def _counted_inflight(name: str, p: int, m: int, v: int, group: int = 0) -> tuple[int, ...]:
    return tuple(peak_inflight(build(name, p, m, v, group)))


def _normalized(costs: StageCosts, n_chunks: int) -> tuple[float, tuple]:
    """(scale, key): costs divided by their largest forward time, rounded."""

    def seq(x: float | list[float]) -> list[float]:
        return [float(x)] * n_chunks if isinstance(x, int | float) else [float(y) for y in x]

    f, b, d = seq(costs.forward), seq(costs.backward), seq(costs.dp_reduce)
    u = seq(costs.unshard)
    scale = max(f) or 1.0

    def r(x: float) -> float:
        return 0.0 if x == 0 else float(f"{x / scale:.6g}")

    key = (tuple(map(r, f)), tuple(map(r, b)), tuple(map(r, d)), r(costs.transfer),
           costs.dp_overlap, tuple(map(r, u)))
    return scale, key


def compute_actions(name: str, p: int, m: int, v: int) -> int:
    """Compute actions (F, B, I, W) of schedule `name`: ``ScheduleSpec.compute_actions`` (2·p·v·m,
    3·p·v·m where every backward is split); 2·p·v·m for a name the registry does not hold."""
    spec = SCHEDULES.get(name)
    return spec.compute_actions(p, m, v) if spec else 2 * p * v * m


def time_pipeline(name: str, p: int, m: int, v: int, costs: StageCosts,
                  sharded: int | None = None, group: int = 0) -> PipelineTiming:
    """Simulated timing of schedule `name` (p ranks, m micro-batches, v chunks per rank).

    `sharded`: ZeRO-3's prefetch depth; the schedule then carries the sharding actions of
    ``schedule.add_sharding_actions`` (an all-gather per run of a chunk, its gradients'
    reduce-scatter after its last backward), timed with costs.unshard and costs.dp_reduce:
    breadth-first gathers each chunk twice per step and reduces it while the rank's other
    chunks still run backward; depth-first schedules regather per micro-batch or keep the
    chunk gathered. `group`: interleaved's micro-batch group size (0: p); the extrapolation
    then steps by lcm(p, group) micro-batches (:func:`period`)."""
    scale, key = _normalized(costs, p * v)
    key = key + (sharded, group)
    per = period(p, group)
    spec = SCHEDULES.get(name)
    start = (spec.steady_after_periods if spec else UNKNOWN_STEADY_AFTER_PERIODS) * per
    if compute_actions(name, p, m, v) <= EXACT_ACTIONS or m < start + per:
        t = _simulate_normalized(name, p, m, v, key)
        return PipelineTiming(*(x * scale for x in t), simulated_m=(m,))
    m1 = start + (m % per)
    k = (m - m1) // per
    t1 = _simulate_normalized(name, p, m1, v, key)
    t2 = _simulate_normalized(name, p, m1 + per, v, key)
    step, makespan, compute, dp = (scale * (a + k * (b - a)) for a, b in zip(t1, t2, strict=True))
    return PipelineTiming(step, makespan, compute, dp, simulated_m=(m1, m1 + per))


@lru_cache(maxsize=4096)
def _simulate_normalized(name: str, p: int, m: int, v: int,
                         key: tuple) -> tuple[float, float, float, float]:
    f, b, d, transfer, overlap, u, sharded, group = key
    costs = StageCosts(forward=list(f), backward=list(b), p2p_latency=transfer,
                       dp_reduce=list(d), dp_overlap=overlap, unshard=list(u))
    schedule, prepared = _prepared(name, p, m, v, group, sharded)
    result = simulate(schedule, costs, timeline=False, prepared=prepared)
    return result.step_time, result.makespan, result.compute_time, result.exposed_dp_time


@lru_cache(maxsize=16)
def _prepared(name: str, p: int, m: int, v: int, group: int,
              sharded: int | None) -> tuple[Schedule, Prepared]:
    """The schedule the simulator times, with what it reads off it: a search times the same
    schedule under many layouts' costs (recomputation, sequence parallelism, ZeRO stage)."""
    schedule = _built(name, p, m, v, group)  # shared with the memory walk, never changed
    if sharded is not None:
        schedule = add_sharding_actions(schedule, prefetch=sharded)
    return schedule, prepare(schedule)


def lower_bound(chunk_f: list[float], chunk_b: list[float], dp: list[float], transfer: float,
                overlap: bool, p: int, m: int, drain: bool = True,
                owner: tuple[int, ...] | None = None) -> float:
    """A bound below the simulated step time of *any* schedule, from dependencies alone.

    Rank r (chunks c ≡ r mod p, or those `owner` gives it; chunk r is on rank r in every
    placement here) cannot start before micro-batch 0 has gone forward through
    chunks 0..r−1 (and r transfers), must do m·Σ(f + b) of its own work, and after its last
    backward that micro-batch's gradient still has to go back through chunks r−1..0, while
    the reduction of the chunk it finished last (all its chunks, without overlap) runs.
    Without `drain` (split backwards: the rank may end on weight gradients nobody waits for)
    only the reduction follows. Used only to skip layouts that cannot enter the top of the
    ranking."""
    n = len(chunk_f)
    work = [0.0] * p
    reduce_sum = [0.0] * p
    reduce_min = [math.inf] * p
    for c in range(n):
        r = c % p if owner is None else owner[c]
        work[r] += chunk_f[c] + chunk_b[c]
        reduce_sum[r] += dp[c]
        reduce_min[r] = min(reduce_min[r], dp[c])
    best = start = tail = 0.0
    for r in range(p):
        reduce = reduce_min[r] if overlap else reduce_sum[r]
        best = max(best, start + m * work[r] + max(tail if drain else 0.0, reduce))
        start += chunk_f[r] + transfer
        tail += chunk_b[r] + transfer
    return best


__all__ = ["PipelineTiming", "chunk_inflight", "inflight", "time_pipeline", "lower_bound", "build",
           "compute_actions", "rank_chunks"]
