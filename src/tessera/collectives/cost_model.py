"""The alpha-beta(-gamma) cost model of collective algorithms, and its measurement.

A message of n bytes between two ranks costs ``alpha + n * beta``; folding n bytes into a local
buffer costs ``n * gamma``. A rank sends and receives one message at a time, both at once
(Hockney's model as used by Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1), and Chan, Heimlich, Purkayastha & van de Geijn
2007, "Collective communication: theory, practice, and experience", CCPE 19(13)). A
collective's predicted time is the sum over its critical path. With S the buffer size in bytes,
N the group size, p = 2^floor(log2 N), r = N - p and L = log2 p:

================  ==================  ==============================================================
collective        algorithm           predicted time
================  ==================  ==============================================================
all_reduce        naive               2(N-1) alpha + 2(N-1) S beta + (N-1) S gamma
all_reduce        parallel            (N-1) alpha + (N-1) S beta + (N-1) S gamma
all_reduce        ring                2(N-1) alpha + 2(N-1)/N S beta + (N-1)/N S gamma
all_reduce        rabenseifner        2L alpha + 2(p-1)/p S beta + (p-1)/p S gamma
                                      [+ 2 alpha + 2 S beta + S gamma when r > 0: the fold]
reduce_scatter    ring                (N-1) alpha + (N-1)/N S (beta + gamma)
reduce_scatter    recursive           L alpha + (p-1)/p S (beta + gamma)
                                      [+ 2 alpha + S (beta + gamma) + S/N beta when r > 0]
all_gather        ring                (N-1) alpha + (N-1)/N S beta
all_gather        recursive           L alpha + (p-1)/p S beta [+ 2 alpha + S beta when r > 0]
broadcast         binomial            ceil(log2 N) (alpha + S beta)
broadcast         scatter_allgather   (ceil(log2 N) + N - 1) alpha + 2(N-1)/N S beta
reduce            binomial            ceil(log2 N) (alpha + S beta + S gamma)
scatter, gather   binomial            ceil(log2 N) alpha + (N-1)/N S beta
all_to_all        pairwise            (N-1) alpha + (N-1)/N S beta
================  ==================  ==============================================================

S is the full buffer: the all-reduced tensor, reduce-scatter's input, all-gather's output,
scatter's input / gather's output, one rank's all-to-all input. The parallel all-reduce
posts its N-1 messages at once but pays alpha once per message.

``choose_algorithm`` returns the cheapest algorithm under a model; ``measure_alpha_beta`` fits
alpha and beta to a ping-pong between the group's first two ranks (and gamma to a local add).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.collectives.p2p import PeerGroup, check_choice
from tessera.errors import ConfigError

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("naive", "parallel", "ring", "rabenseifner"),
    "reduce_scatter": ("ring", "recursive"),
    "all_gather": ("ring", "recursive"),
    "broadcast": ("binomial", "scatter_allgather"),
    "reduce": ("binomial",),
    "scatter": ("binomial",),
    "gather": ("binomial",),
    "all_to_all": ("pairwise",),
}
"""Every modelled algorithm, per collective; ties in choose_algorithm go to the earlier one."""


@dataclass(frozen=True)
class AlphaBeta:
    """Machine parameters of the cost model, in seconds."""

    alpha: float
    """Latency: fixed cost of one message."""
    beta: float
    """Inverse bandwidth: seconds per byte sent."""
    gamma: float = 0.0
    """Local reduction: seconds per byte folded into a buffer (0 ignores compute)."""


def default_model() -> AlphaBeta:
    """The model "auto" uses when none is passed: gloo over loopback on a 2-core CPU machine.

    Rounded from four :func:`measure_alpha_beta` runs (2 and 4 ranks) on the machine the
    benchmark ran on: alpha 64-69 us, beta 0.21-0.44 ns/B, gamma 0.031-0.040 ns/B (see
    docs/collectives.md). Measure your own and pass it as ``model=`` on other machines.
    """
    return AlphaBeta(alpha=70e-6, beta=0.3e-9, gamma=0.035e-9)


def log2_ceil(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def predict_time(collective: str, algorithm: str, nbytes: float, world: int,
                 model: AlphaBeta) -> float:
    """Predicted seconds of one call (the table in this module's docstring)."""
    check_choice("collective", collective, tuple(ALGORITHMS))
    check_choice("algorithm", algorithm, ALGORITHMS[collective])
    if world < 1:
        raise ConfigError("world", world, "must be at least 1")
    if world == 1:
        return 0.0
    a, b, g = model.alpha, model.beta, model.gamma
    n, s = world, float(nbytes)
    p = 1 << (n.bit_length() - 1)
    folded = n != p
    lg_p, lg_n = int(math.log2(p)), log2_ceil(n)
    frac_n, frac_p = (n - 1) / n, (p - 1) / p
    key = (collective, algorithm)
    if key == ("all_reduce", "naive"):
        return 2 * (n - 1) * (a + s * b) + (n - 1) * s * g
    if key == ("all_reduce", "parallel"):
        return (n - 1) * (a + s * b + s * g)
    if key == ("all_reduce", "ring"):
        return 2 * (n - 1) * a + 2 * frac_n * s * b + frac_n * s * g
    if key == ("all_reduce", "rabenseifner"):
        t = 2 * lg_p * a + 2 * frac_p * s * b + frac_p * s * g
        return t + (2 * a + 2 * s * b + s * g if folded else 0.0)
    if key == ("reduce_scatter", "ring"):
        return (n - 1) * a + frac_n * s * (b + g)
    if key == ("reduce_scatter", "recursive"):
        t = lg_p * a + frac_p * s * (b + g)
        return t + (2 * a + s * (b + g) + s / n * b if folded else 0.0)
    if key == ("all_gather", "ring"):
        return (n - 1) * a + frac_n * s * b
    if key == ("all_gather", "recursive"):
        return lg_p * a + frac_p * s * b + (2 * a + s * b if folded else 0.0)
    if key == ("broadcast", "binomial"):
        return lg_n * (a + s * b)
    if key == ("broadcast", "scatter_allgather"):
        return (lg_n + n - 1) * a + 2 * frac_n * s * b
    if key == ("reduce", "binomial"):
        return lg_n * (a + s * b + s * g)
    if collective in ("scatter", "gather"):
        return lg_n * a + frac_n * s * b
    return (n - 1) * a + frac_n * s * b  # all_to_all, pairwise


def choose_algorithm(collective: str, nbytes: float, world: int, model: AlphaBeta) -> str:
    """The algorithm with the least predicted time (ties: the first in ALGORITHMS).

    Depends only on its arguments, so ranks that agree on them agree on the choice.
    """
    check_choice("collective", collective, tuple(ALGORITHMS))
    times = [(predict_time(collective, alg, nbytes, world, model), i, alg)
             for i, alg in enumerate(ALGORITHMS[collective])]
    return min(times)[2]


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float],
                   large: float = 1 << 16) -> tuple[float, float]:
    """Fit t = alpha + beta * n in two regimes, as Hockney's model is usually measured.

    beta is the least-squares slope over the messages of at least `large` bytes, where
    bandwidth dominates (all messages if fewer than two are that large); alpha is then the
    median of t - beta * n over the remaining small messages, where latency dominates. A
    single fit over all sizes lets a few milliseconds of scheduling noise on a shared machine
    drag the slope to zero; the split keeps each parameter fixed by the sizes that carry it.
    Negative estimates (noise) are clamped to zero.
    """
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    big = n >= large
    if int(big.sum()) < 2:
        big = torch.ones_like(n, dtype=torch.bool)
    nb, tb = n[big], t[big]
    beta = float(((nb - nb.mean()) * (tb - tb.mean())).sum() / ((nb - nb.mean()) ** 2).sum())
    small = ~big if bool((~big).any()) else big
    alpha = float((t[small] - beta * n[small]).median())
    return max(alpha, 0.0), max(beta, 0.0)


def _ping_pong(pg: PeerGroup, buf: torch.Tensor, repeats: int, warmup: int) -> float:
    """One-way time of `buf` between positions 0 and 1: the fastest half round trip.

    The minimum, not the median: on a shared machine a round trip is now and then slowed by
    milliseconds when a rank waits to be scheduled, which is not a property of the network.
    """
    samples = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        if pg.rank == 0:
            pg.round(sends=[(1, buf)])
            pg.round(recvs=[(1, buf)])
        else:
            pg.round(recvs=[(0, buf)])
            pg.round(sends=[(0, buf)])
        if buf.is_cuda:  # NCCL's wait orders streams; the transfer ends on the device
            torch.cuda.synchronize(buf.device)
        if i >= warmup:
            samples.append((time.perf_counter() - start) / 2)
    return min(samples)


def _reduction_seconds_per_byte(sizes: Sequence[int], repeats: int) -> float:
    acc_sizes, secs = [], []
    for nbytes in sizes:
        acc, x = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            acc.add_(x)
            if acc.is_cuda:
                torch.cuda.synchronize(acc.device)
            samples.append(time.perf_counter() - start)
        acc_sizes.append(nbytes)
        secs.append(statistics.median(samples))
    return fit_alpha_beta(acc_sizes, secs)[1]


def measure_alpha_beta(group: dist.ProcessGroup | None = None, *,
                       sizes: Sequence[int] = tuple(4 ** k for k in range(2, 13)),
                       repeats: int = 10, warmup: int = 2) -> AlphaBeta:
    """Measure this machine's alpha, beta (and gamma) on `group`; every rank gets the same.

    Group ranks 0 and 1 ping-pong messages of each size in `sizes` (bytes; default 16 B to
    16 MiB, so that beta sees buffers larger than the caches), take the fastest one-way time
    of `repeats`, and fit ``t = alpha + beta * n`` (:func:`fit_alpha_beta`); rank 0 also times
    a float32 add on 1 to 64 MiB buffers for gamma. Rank 0 then sends the numbers to every
    rank, so "auto" choices agree. All ranks must call; it takes a second or two. Buffers are
    made on the default device (``with torch.device("cuda")`` measures a GPU link).
    """
    pg = PeerGroup(group, None)
    if pg.size < 2:
        raise ConfigError("group", f"size {pg.size}", "needs at least 2 ranks to measure alpha "
                          "and beta")
    if not sizes or min(sizes) < 1:
        raise ConfigError("sizes", list(sizes), "must be a non-empty list of positive byte counts")
    params = torch.zeros(3, dtype=torch.float64)
    if pg.rank in (0, 1):
        seconds = [_ping_pong(pg, torch.zeros(s, dtype=torch.uint8), repeats, warmup)
                   for s in sizes]
        if pg.rank == 0:
            alpha, beta = fit_alpha_beta(sizes, seconds)
            gamma = _reduction_seconds_per_byte([1 << 20, 1 << 22, 1 << 24, 1 << 26], repeats)
            params = torch.tensor([alpha, beta, gamma], dtype=torch.float64)
    others = range(1, pg.size)  # one round: rank 0 hands the fit to every rank
    if pg.rank == 0:
        pg.round(sends=[(i, params) for i in others])
    else:
        pg.round(recvs=[(0, params)])
    return AlphaBeta(*params.tolist())
