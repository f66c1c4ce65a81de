"""The links between the calibrating ranks and how far apart the ranks compute.

- α and β over the backend: for point-to-point sends :func:`tessera.collectives.measure_alpha_beta`
  (ping-pong, fit of ``t = α + n·β``, the local reduction γ folded into β); for collectives
  the same fit (:func:`tessera.collectives.fit_alpha_beta`) to the backend's own
  ``all_reduce`` at 4 KiB-16 MiB, converted to the ring form the planner uses; all-gather and
  reduce-scatter are timed too and their speed relative to the ring form on that link stored
  as ``gather_efficiency``. Intra- and inter-node are the same link: every rank lives on this
  machine. Each collective follows a matmul and is timed from the rank's own start, so it
  holds the wait for later ranks, except where the ranks outnumber the cores: there a rank's
  early arrival gives its core to a late rank, and a call is timed from the last arrival plus
  the core-time the arrivals left idle (:func:`timed_collective`, :func:`sync_idle_seconds`;
  the planner adds no straggler wait for time-shared ranks);
- jitter: how far apart ranks that start a stretch of one block's forward + backward, and one
  of four, together (after a barrier) finish it, in wall time: per stretch the median over
  repeats of (slowest rank − the ranks' mean), which is what a collective after the compute
  waits for, divided by the expected maximum of N standard normals: σ at two lengths T, and
  the line through them, σ = a + r·T (``jitter_fixed_us``, ``jitter_rate``; the straggler
  term inverted). The ranks' spread, not one rank's spread over time: a slow stretch that
  slows every rank alike costs a collective nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from tessera.planner.comm import allgather_time
from tessera.planner.hardware import Link
from tessera.planner.local.rates import block_step
from tessera.planner.local.terms import expected_max_normal, ranks_time_share
from tessera.planner.local.timing import wall_clock
from tessera.planner.models import ModelSpec


def sync_idle_seconds(arrivals: list[float], cores: int) -> float:
    """Wall seconds the ranks' spread of `arrivals` (instants on one clock) at a collective
    costs a step when they share `cores` CPU cores: the core-time left idle between the first
    arrival and the last, over the cores they use (min(cores, ranks)). While k of N ranks have
    arrived, N − k still compute, and a core idles only when fewer than that many are left:
    with a core each (N ≤ cores) that is every arrived rank's, and the cost is the last
    arrival minus the mean one (what a rank's own-start timing averages to); N ranks
    time-sharing fewer cores give an early rank's core to a late one, and only the last
    ranks' gaps idle any (4 ranks on 2 cores: half the gap between the last two)."""
    t = sorted(arrivals)
    n = len(t)
    used = min(cores, n)
    if n <= 1 or used <= 0:
        return 0.0
    idle = sum(max(0, used - (n - k)) * (t[k] - t[k - 1]) for k in range(1, n))
    return idle / used


def timed_collective(op: str, nbytes: int, repeats: int,
                     before: Callable[[], object] | None = None, cores: int = 0,
                     clock: Callable[[], float] = wall_clock) -> float:
    """Median wall seconds of gloo's `op` ('all_reduce', 'all_gather', 'reduce_scatter') whose
    full (unsharded) tensor has `nbytes`, each call right after `before` (compute).

    Each call is timed from this rank's own start, which holds the wait for the ranks that
    arrive after it: with a core each, what the step's collective waits for too. Where the
    ranks time-share `cores` CPU cores of this machine (0 < cores < ranks), a rank that
    arrives early leaves its core to a late one, so that wait is mostly someone's compute:
    there each call costs the ranks' mean time from the last arrival to their return, plus
    the cores its arrivals left idle (:func:`sync_idle_seconds`), read across the ranks on
    the clock the machine's processes share. Every rank returns the same value then.
    `clock`: wall time (the clock the tests replace with a fake one)."""
    import torch.distributed as dist

    from tessera.collectives.algorithms import all_gather_single, reduce_scatter_single

    n = dist.get_world_size()
    shared = ranks_time_share(cores, n)
    full = torch.ones(nbytes // 4 // n * n)
    shard = torch.ones(full.numel() // n)
    run = {"all_reduce": lambda: dist.all_reduce(full),
           "all_gather": lambda: all_gather_single(full, shard),
           "reduce_scatter": lambda: reduce_scatter_single(shard, full)}[op]
    samples = []
    for _ in range(repeats + 3):
        dist.barrier()
        if before is not None:
            before()
        start = clock()
        run()
        end = clock()
        if not shared:
            samples.append(end - start)
            continue
        mine = torch.tensor([start, end], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(n)]
        dist.all_gather(every, mine)  # outside the timed call
        starts = [float(e[0]) for e in every]
        last = max(starts)
        samples.append(statistics.fmean(float(e[1]) - last for e in every)
                       + sync_idle_seconds(starts, cores))
    return statistics.median(samples[3:])

def collective_link(spec: ModelSpec, seq: int, micro_batch: int,
                     cores: int = 0) -> dict[str, float]:
    """Point-to-point and collective α and β of this process's default group, its ranks
    sharing `cores` CPU cores (0: a device each)."""
    import torch.distributed as dist

    from tessera.collectives import fit_alpha_beta, measure_alpha_beta

    # Point to point: a ping-pong up to 16 MiB (so that β is pinned by large messages), 25
    # repeats for a stable median on a machine shared with other jobs.
    p2p = measure_alpha_beta(None, sizes=tuple(4 ** k for k in range(2, 13)), repeats=25)
    # Collectives: gloo's own all-reduce costs several times what the ping-pong predicts (its
    # algorithm, threads, copies), so the link is fitted to it: t = a + b·n, and for the ring
    # form 2(N−1)·α + 2(N−1)/N·n·β that the planner uses, α = a / (2(N−1)), β = b·N / (2(N−1)).
    # Each call follows a matmul at the model's shapes, as in training: the ranks arrive a
    # little apart, with cold caches and idle gloo threads, which costs up to twice a call
    # timed back to back. Ranks time-sharing the cores pay for their spread of arrivals only
    # the cores it leaves idle (timed_collective).
    x = torch.randn(micro_batch * seq, spec.hidden)
    w = torch.randn(spec.ffn_hidden, spec.hidden)

    def compute() -> None:
        x @ w.t()

    sizes = [4 ** k for k in range(6, 13)]  # 4 KiB to 16 MiB
    seconds = [timed_collective("all_reduce", n, 25, compute, cores) for n in sizes]
    a, b = fit_alpha_beta(sizes, seconds)
    n = dist.get_world_size()
    alpha, beta = a / (2 * (n - 1)), b * n / (2 * (n - 1))
    # All-gather and reduce-scatter against the ring form on that link, at the sizes tensor
    # and sequence parallelism move (64 KiB to 16 MiB).
    ring = Link(alpha=alpha, bandwidth=1.0 / beta)
    timed = [(size, timed_collective(op, size, 25, compute, cores))
             for op in ("all_gather", "reduce_scatter") for size in sizes[2:]]
    return {"p2p_alpha": p2p.alpha, "p2p_beta": p2p.beta + p2p.gamma, "alpha": alpha,
            "beta": beta, "gather_efficiency": gather_efficiency(ring, n, timed)}


def ring_beta(seconds: float, nbytes: float, n: int, alpha: float) -> float:
    """β (seconds per byte) that gives an all-reduce of `nbytes` over `n` ranks `seconds` in
    the ring form 2(n−1)·α + 2(n−1)/n·nbytes·β the planner uses, α given (at least 0.1% of
    the time is left to the bytes, so a latency-bound timing still gives a finite rate)."""
    return max(seconds - 2 * (n - 1) * alpha, 1e-3 * seconds) / (2 * (n - 1) / n * nbytes)


def gather_efficiency(ring: Link, n: int, timed: list[tuple[float, float]]) -> float:
    """Speed of all-gathers and reduce-scatters relative to the ring form on `ring` (the cost
    model's ``allgather_time`` at gather efficiency 1): the median over the (bytes, seconds)
    timings of predicted / measured, at most 1."""
    return min(1.0, statistics.median(allgather_time(size, n, ring) / seconds
                                      for size, seconds in timed))

JITTER_BLOCKS = (1, 4)
"""The stretches calibrate times the ranks' spread over, in blocks of forward + backward."""


def side_by_side(step: Callable[[], None], times: int,
                 clock: Callable[[], float] = wall_clock) -> tuple[float, float]:
    """Every rank of the default group runs `step` `times` times from a barrier: (the
    slowest rank's seconds on `clock` (wall time) minus the ranks' mean, the mean), the same
    on every rank."""
    import torch.distributed as dist

    dist.barrier()
    start = clock()
    for _ in range(times):
        step()
    mine = torch.tensor([clock() - start], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    seconds = [float(t) for t in every]
    mean = statistics.fmean(seconds)
    return max(seconds) - mean, mean


def jitter(spec: ModelSpec, seq: int, micro_batch: int, repeats: int = 48, *,
           step: Callable[[], None] | None = None,
           clock: Callable[[], float] = wall_clock) -> tuple[float, float]:
    """(a seconds, r per second): σ = a + r·T of a stretch of T seconds of compute as the
    ranks of the default group run it side by side (module docstring). Per stretch of
    JITTER_BLOCKS blocks, interleaved: the median over repeats of the slowest rank's wall
    time minus the ranks' mean, over E[max of N standard normals] (Blom, as
    ``straggler_time``), at T the median time; the line through the two (neither part
    negative). Every rank returns the same values; zeros on one rank. `step` (default: one
    block's forward + backward, :func:`block_step`) and `clock` (default: wall time) are
    what the tests replace with work on a fake clock."""
    import torch.distributed as dist

    n = dist.get_world_size()
    if n <= 1:
        return 0.0, 0.0
    step = step or block_step(spec, seq, micro_batch)
    step()  # warm-up
    skews: dict[int, list[float]] = {k: [] for k in JITTER_BLOCKS}
    times: dict[int, list[float]] = {k: [] for k in JITTER_BLOCKS}
    for _ in range(repeats):
        for k in JITTER_BLOCKS:
            skew, mean = side_by_side(step, k, clock)
            skews[k].append(skew)
            times[k].append(mean)
    (t1, s1), (t2, s2) = ((statistics.median(times[k]),
                           statistics.median(skews[k]) / expected_max_normal(n))
                          for k in JITTER_BLOCKS)
    return sigma_line(t1, s1, t2, s2)


def sigma_line(t1: float, s1: float, t2: float, s2: float) -> tuple[float, float]:
    """(a, r) of σ = a + r·T through (t1, s1) and (t2, s2), t1 < t2, with a, r ≥ 0: a line
    that would fall below 0 at T = 0 goes through the origin and the longer stretch's point,
    one that would fall with T is flat at the mean σ."""
    rate = (s2 - s1) / (t2 - t1)
    if rate <= 0:
        return (s1 + s2) / 2, 0.0
    fixed = s1 - rate * t1
    if fixed < 0:
        return 0.0, s2 / t2
    return fixed, rate
