"""What keeping freed host memory (tessera.host_memory) saves a CPU training step.

    flock /tmp/tessera-bench.lock python benchmarks/host_memory.py [--world 2] [--rounds 4] \
        [--out benchmarks/results/host_memory.txt]

A rank's malloc setting is fixed for its process, so the two settings cannot alternate inside
one launch. Each launch trains one candidate, tessera's DataParallel or its peer PyTorch's
DistributedDataParallel (``bench_data_parallel``'s setups: same model, batch, AdamW), with
malloc as it comes ("release") or keeping what it frees ("keep", what ``tessera train`` does on
a CPU rank); a round launches all four, in an order that rotates every round, so the
machine's drift lands on every one alike. Recorded per launch, after warm-up steps: the median
step time (each step the slowest rank's) and the minor page faults per step (memory the kernel
maps and zero-fills on its first touch), averaged over the ranks. The summary gives, per
candidate, the median over rounds of keep / release, and in each setting tessera's step over
torch DDP's (the peer's launches in the same rounds).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import time

import torch
import torch.distributed as dist
from bench_data_parallel import CANDIDATES, batch, load_average, print_and_write

from tessera.config import ModelConfig, TrainConfig
from tessera.model import build_model
from tessera.testing import run_ranks

NAMES = ("ours-ddp", "torch-ddp")


def rank_run(name: str, model_cfg: ModelConfig, args: argparse.Namespace) -> dict:
    """Train candidate `name`: this rank's timed step times and page faults per timed step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = CANDIDATES[name](build_model(model_cfg, seed=0), dist.group.WORLD,
                            TrainConfig(lr=1e-3, warmup_steps=0), args)
    times = []
    for i in range(args.warmup + args.steps):
        x, y = batch(i, model_cfg, args, rank, world)
        dist.barrier()
        if i == args.warmup:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return dict(times=times[args.warmup:], faults=faults / args.steps)


def launch(name: str, keep: bool, model_cfg: ModelConfig, args: argparse.Namespace) -> dict:
    """One launch: the median step (ms; each step the slowest rank's) and the ranks' mean
    page faults per step."""
    res = run_ranks(rank_run, args.world, args=(name, model_cfg, args), timeout=900,
                    keep_host_memory=keep)
    steps = [max(r["times"][i] for r in res) for i in range(args.steps)]
    return dict(step_ms=1e3 * statistics.median(steps),
                faults=statistics.fmean(r["faults"] for r in res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of four launches")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.bucket_mb, args.algorithm = 25.0, "backend"
    # The demo preset's shape (d_model 192, 4 layers), micro-batch global_batch / world.
    model_cfg = ModelConfig(vocab_size=256, d_model=192, n_layers=4, n_heads=6, n_kv_heads=2,
                            max_seq_len=args.seq)
    torch.set_num_threads(1)
    lines = [f"# host_memory.py  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.node()}  "
             f"torch {torch.__version__}, {args.world} gloo ranks, 1 thread each, "
             f"{os.cpu_count()} cores, load average {load_average()} at start",
             f"# demo shape, global batch {args.global_batch}x{args.seq}, fp32 AdamW; "
             f"{args.rounds} rounds of four launches (candidate x malloc, the order rotating), "
             f"{args.steps} timed steps after {args.warmup} warm-up in each",
             f"{'round':>5} {'candidate':<10} {'malloc':<8} {'step ms':>8} {'faults/step':>12}"]
    print("\n".join(lines), flush=True)
    launches = [(name, keep) for name in NAMES for keep in (False, True)]
    runs: dict[tuple[str, bool], list[dict]] = {k: [] for k in launches}
    for r in range(args.rounds):
        for name, keep in launches[r % 4:] + launches[:r % 4]:
            run = launch(name, keep, model_cfg, args)
            runs[name, keep].append(run)
            line = (f"{r:>5} {name:<10} {'keep' if keep else 'release':<8} "
                    f"{run['step_ms']:>8.1f} {run['faults']:>12.0f}")
            lines.append(line)
            print(line, flush=True)

    def ratio(a: list[dict], b: list[dict]) -> str:
        rs = [x["step_ms"] / y["step_ms"] for x, y in zip(a, b, strict=True)]
        return (f"{statistics.median(rs):.3f} (median of {len(rs)} rounds, range "
                f"{min(rs):.3f}-{max(rs):.3f})")

    summary = []
    for name in NAMES:
        faults = [statistics.median(run["faults"] for run in runs[name, keep])
                  for keep in (False, True)]
        kept = ratio(runs[name, True], runs[name, False])
        summary.append(f"{name}: keep / release step time {kept}; page faults per step per "
                       f"rank {faults[0]:.0f} -> {faults[1]:.0f}")
    for keep in (False, True):
        summary.append(f"{'keep' if keep else 'release'}: ours-ddp / torch-ddp "
                       f"{ratio(runs['ours-ddp', keep], runs['torch-ddp', keep])}")
    summary.append(f"# load average at end {load_average()}")
    print_and_write(lines, summary, args.out)


if __name__ == "__main__":
    main()
