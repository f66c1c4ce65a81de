"""How the wait for the slowest rank grows with the compute before a collective.

    flock /tmp/tessera-bench.lock python benchmarks/straggler_scaling.py \
        [--ranks 2] [--micro-batch 16] [--rounds 40] \
        [--out benchmarks/results/straggler_scaling.txt]

The planner prices the wait at a collective after T seconds of compute on each of N ranks as
σ·E[max of N standard normals] with σ = jitter·√T (``terms.straggler_time``): independent
noise accumulating over the compute, as a sum of many small independent delays would. If
the delays were instead one slow-down per stretch (a rank's whole stretch a few percent
slower), σ would grow as T. ``plan calibrate`` measures the wait after one block's forward +
backward and scales it by √T to the steps it prices, so the law decides every straggler term
the planner gives a CPU run.

This benchmark measures it: the ranks run k blocks of the demo model's forward + backward
(``rates.block_step``, k = 1, 2, 4, 8, 16) side by side after a barrier, the sizes
interleaved within each round so that a slow minute hits every size alike, and records the
slowest rank's time minus the ranks' mean. Per k: the median wait and the median T. The
exponent e of wait ∝ T^e is the least-squares slope of log wait on log T over the sizes,
with a 95% interval from resampling the rounds (bootstrap, 2000 resamples).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from pathlib import Path

SIZES = (1, 2, 4, 8, 16)


def _worker(micro_batch: int, rounds: int) -> dict[int, list[tuple[float, float]]]:
    """Per size k, per round: (the slowest rank's wall seconds minus the ranks' mean, the
    mean). Every rank returns the same lists."""
    from tessera.config_io import make_config
    from tessera.planner.local.links import side_by_side
    from tessera.planner.local.rates import block_step
    from tessera.planner.models import from_model_config

    cfg = make_config("demo")
    spec = from_model_config("demo", cfg.model, cfg.data.seq_len)
    step = block_step(spec, cfg.data.seq_len, micro_batch)
    step()  # warm-up
    out: dict[int, list[tuple[float, float]]] = {k: [] for k in SIZES}
    order = list(SIZES)
    for r in range(rounds):
        random.Random(r).shuffle(order)  # the same order on every rank
        for k in order:
            out[k].append(side_by_side(step, k))
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log y on log x over (x, y) points."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
            / sum((x - mx) ** 2 for x in xs))


def exponent(samples: dict[int, list[tuple[float, float]]]) -> float:
    """e in wait ∝ T^e from the per-size medians (sizes whose median wait is not positive
    are left out: no log)."""
    points = []
    for rows in samples.values():
        wait = statistics.median(w for w, _ in rows)
        if wait > 0:
            points.append((statistics.median(t for _, t in rows), wait))
    return slope(points)


def report(samples: dict[int, list[tuple[float, float]]], ranks: int, micro_batch: int,
           resamples: int = 2000) -> str:
    rounds = len(next(iter(samples.values())))
    lines = [f"straggler wait vs compute: {ranks} ranks, demo block at micro-batch {micro_batch}, "
             f"{rounds} rounds per size",
             f"{'blocks':>6} {'T ms':>8} {'wait ms':>8} {'wait/sqrt(T)':>13} {'wait/T':>8}"]
    for k, rows in samples.items():
        t = statistics.median(x for _, x in rows)
        wait = statistics.median(w for w, _ in rows)
        lines.append(f"{k:>6} {1e3 * t:>8.1f} {1e3 * wait:>8.2f} {wait / math.sqrt(t):>13.4f} "
                     f"{wait / t:>8.4f}")
    e = exponent(samples)
    rng = random.Random(0)
    boot = []
    for _ in range(resamples):
        picks = [rng.randrange(rounds) for _ in range(rounds)]
        boot.append(exponent({k: [rows[i] for i in picks] for k, rows in samples.items()}))
    boot.sort()
    lo, hi = boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]
    lines.append(f"exponent e in wait ~ T^e: {e:.2f} [95%: {lo:.2f}, {hi:.2f}] "
                 f"(the planner's law: 0.5; a per-stretch slow-down: 1)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tessera.testing import run_ranks

    samples = run_ranks(_worker, args.ranks, args=(args.micro_batch, args.rounds),
                        timeout=3600)[0]
    text = report(samples, args.ranks, args.micro_batch)
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
