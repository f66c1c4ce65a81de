"""Bus bandwidth of tessera's point-to-point collectives against gloo's built-in ones.

    python benchmarks/bench_collectives.py                       # worlds 2 and 4, 1 KiB..64 MiB
    python benchmarks/bench_collectives.py --worlds 2 --max-bytes 4M --pairs 3

For each world size, message size (float32, powers of 4 from --min-bytes to --max-bytes) and
algorithm, the algorithm and the backend's collective (``dist.all_reduce``,
``reduce_scatter_single``, ``all_gather_single`` on gloo) run alternately, `pairs` times, the
order flipping each pair (ABBA). One measurement is `reps` back-to-back calls after a barrier;
its time is the slowest rank's, divided by `reps`. The table reports medians over pairs and the
median of the per-pair ratios with its spread.

Bus bandwidth (the nccl-tests convention) makes algorithms and world sizes comparable: for
all-reduce busbw = S/t * 2(N-1)/N, for reduce-scatter and all-gather S/t * (N-1)/N, with S the
full buffer. The "model" column is the alpha-beta prediction from alpha, beta, gamma measured at
the start of the same run (tessera.collectives.measure_alpha_beta); "auto" is what
``algorithm="auto"`` picks from that model.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tessera import collectives as C
from tessera.testing import run_ranks

ALGORITHMS = {
    "all_reduce": ("naive", "parallel", "ring", "rabenseifner"),
    "reduce_scatter": ("ring", "recursive"),
    "all_gather": ("ring", "recursive"),
}
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _call(collective: str, algorithm: str, buf: torch.Tensor, world: int) -> Callable[[], object]:
    """A no-argument function running one collective on `buf` (S bytes of full buffer)."""
    if collective == "all_reduce":
        return lambda: C.all_reduce(buf, algorithm=algorithm)
    if collective == "reduce_scatter":
        return lambda: C.reduce_scatter(buf, algorithm=algorithm)
    shard = buf[: buf.numel() // world].clone()
    return lambda: C.all_gather(shard, algorithm=algorithm)


def _timed(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def bench_rank(args: argparse.Namespace) -> list[dict] | None:
    world, me = dist.get_world_size(), dist.get_rank()
    model = C.measure_alpha_beta()
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        numel = size // 4
        reps = max(1, min(args.max_reps, (32 << 20) // size))
        for collective in args.collectives:
            buf = torch.zeros(numel)  # sums stay 0: no overflow to inf/NaN over many calls
            backend = _call(collective, "backend", buf, world)
            for algorithm in ALGORITHMS[collective]:
                ours = _call(collective, algorithm, buf, world)
                ours(), backend()  # warm-up: buffers, connections
                t_ours, t_backend = [], []
                for pair in range(args.pairs):
                    order = (ours, backend) if pair % 2 == 0 else (backend, ours)
                    times = {id(fn): _timed(fn, reps) for fn in order}
                    t_ours.append(times[id(ours)])
                    t_backend.append(times[id(backend)])
                ratios = [b / a for a, b in zip(t_ours, t_backend, strict=True)]  # busbw ratio
                factor = BUS_FACTOR[collective](world)
                rows.append(dict(
                    world=world, collective=collective, size=size, algorithm=algorithm,
                    reps=reps, ours_ms=1e3 * statistics.median(t_ours),
                    backend_ms=1e3 * statistics.median(t_backend),
                    ours_busbw=size * factor / statistics.median(t_ours) / 1e9,
                    backend_busbw=size * factor / statistics.median(t_backend) / 1e9,
                    ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios),
                    model_ms=1e3 * C.predict_time(collective, algorithm, size, world, model),
                    auto=C.choose_algorithm(collective, size, world, model)))
        size *= 4
    return (rows, model) if me == 0 else None


def human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def format_table(world: int, rows: list[dict], model: C.AlphaBeta) -> list[str]:
    lines = [f"## world={world}: measured alpha={model.alpha * 1e6:.1f} us, "
             f"beta={model.beta * 1e9:.3f} ns/B ({1 / model.beta / 1e9 if model.beta else 0:.2f}"
             f" GB/s), gamma={model.gamma * 1e9:.3f} ns/B"]
    header = (f"{'collective':<15}{'size':>9} {'algorithm':<13}{'ours ms':>9}{'gloo ms':>9}"
              f"{'ours GB/s':>10}{'gloo GB/s':>10}{'ours/gloo':>10}  {'spread':<13}"
              f"{'model ms':>9}  auto")
    lines += [header, "-" * len(header)]
    for r in rows:
        spread = f"[{r['lo']:.2f}-{r['hi']:.2f}]"
        lines.append(
            f"{r['collective']:<15}{human(r['size']):>9} {r['algorithm']:<13}"
            f"{r['ours_ms']:>9.3f}{r['backend_ms']:>9.3f}{r['ours_busbw']:>10.3f}"
            f"{r['backend_busbw']:>10.3f}{r['ratio']:>10.2f}  "
            f"{spread:<13}{r['model_ms']:>9.3f}  {r['auto']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-bytes", type=parse_bytes, default=1 << 10)
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    parser.add_argument("--pairs", type=int, default=5, help="alternating ours/gloo pairs")
    parser.add_argument("--max-reps", type=int, default=50, help="calls per timing, small sizes")
    parser.add_argument("--collectives", nargs="+", default=list(ALGORITHMS),
                        choices=list(ALGORITHMS))
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()

    load = os.getloadavg()[0]
    lines = [
        f"# bench_collectives {datetime.datetime.now():%Y-%m-%d %H:%M}, torch "
        f"{torch.__version__}, gloo over loopback, float32, 1 thread per rank, "
        f"{os.cpu_count()} cores ({platform.machine()})",
        f"# load average at start {load:.1f}: the machine was shared with other jobs"
        if load > 1.5 else "# machine idle at start",
        f"# {args.pairs} alternating pairs per row; times are medians of the slowest rank; "
        "'ours/gloo' is the median per-pair bus-bandwidth ratio (>1: ours faster)",
    ]
    print("\n".join(lines), flush=True)
    started = time.time()
    for world in args.worlds:
        rows, model = run_ranks(bench_rank, world, args=(args,), timeout=1800)[0]
        table = format_table(world, rows, model)
        print("\n".join(table), flush=True)
        lines += [""] + table
    lines.append(f"\n# total {time.time() - started:.0f} s")
    print(lines[-1].strip())
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
