"""Pipeline scatter/gather on and off at tp 2 × pp 2, CPU/gloo (4 ranks).

    python benchmarks/bench_scatter_gather.py [--pairs 5] [--out FILE]

Both sides are tessera's executor (``tessera.step.build_executor``) on the same 4 rank
processes, the same model (seed), the same micro-batches and 1F1B; they differ only in
``parallel.scatter_gather``. The peer is the option off: every tp rank sends the whole
(b, s, h) tensor, as ``torch.distributed.pipelining`` does (it has no scatter/gather).
Alternating blocks of ``--steps`` forward-backward steps (on first in even pairs), after one
warm-up step of each. Printed: the median step time of each (wall time of the slowest rank,
every rank entering from a barrier), CPU seconds per step summed over ranks, the median of the
per-pair ratios on/off with its range, the bytes each rank sent point-to-point per step, and
both sides' losses (the same model on the same data: they agree to fp32 noise).

Threads: one per rank; 4 ranks on a 2-core machine oversubscribe the cores, so summed CPU time
is printed beside wall time (the headline there). Gloo on one
machine moves bytes through memory, not a network: what the option saves here is a memory
copy, and what it adds is an all-gather per receive; the GPU-cluster case is what the planner
prices (docs/pipeline.md, Scatter/gather).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

from tessera.config_io import make_config
from tessera.step import build_executor
from tessera.testing import run_ranks
from tessera.topology import Topology


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def config(args, scatter_gather: bool):
    return make_config(
        None, model=dict(d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                         vocab_size=256, max_seq_len=args.seq),
        data=dict(seq_len=args.seq),
        parallel=dict(tp=2, pp=2, schedule="1f1b", scatter_gather=scatter_gather),
        train=dict(grad_accum=args.microbatches,
                   micro_batch_size=args.global_batch // args.microbatches))


def batches(args, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (args.global_batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return list(zip(x.chunk(args.microbatches), y.chunk(args.microbatches), strict=True))


def bench_rank(args) -> dict:
    torch.set_num_threads(1)
    topo = Topology.build(config(args, True).parallel)
    sides = {sg: build_executor(config(args, sg), topo, torch.device("cpu"))
             for sg in (True, False)}
    out: dict = {sg: {"wall": [], "cpu": [], "loss": [], "sent": 0} for sg in sides}

    def block(sg: bool, steps: int, first: int, record: bool) -> None:
        ex = sides[sg]
        for step in range(first, first + steps):
            mbs = batches(args, step)
            dist.barrier()
            c0, t0 = cpu_seconds(), time.perf_counter()
            loss = ex.forward_backward(mbs)
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            for p in ex.parameters():
                p.grad = None
            if record:
                out[sg]["wall"].append(wall)
                out[sg]["cpu"].append(cpu)
                out[sg]["loss"].append(loss)
                out[sg]["sent"] = sum(ex.last_record.sent_bytes)

    for sg in sides:
        block(sg, 1, 0, record=False)
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for sg in order:
            block(sg, args.steps, 1 + pair * args.steps, record=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    per_rank = run_ranks(bench_rank, 4, args=(args,), timeout=1800)
    n = args.pairs * args.steps
    wall = {sg: [max(r[sg]["wall"][i] for r in per_rank) for i in range(n)] for sg in (True, False)}
    cpu = {sg: [sum(r[sg]["cpu"][i] for r in per_rank) for i in range(n)] for sg in (True, False)}
    ratios = [statistics.median(wall[True][k * args.steps:(k + 1) * args.steps])
              / statistics.median(wall[False][k * args.steps:(k + 1) * args.steps])
              for k in range(args.pairs)]
    cpu_ratios = [statistics.median(cpu[True][k * args.steps:(k + 1) * args.steps])
                  / statistics.median(cpu[False][k * args.steps:(k + 1) * args.steps])
                  for k in range(args.pairs)]
    lines = [
        f"# bench_scatter_gather {date.today()} (tp 2 x pp 2, 1F1B, 4 gloo ranks on "
        f"{os.cpu_count()} cores, 1 thread each; load average after the run "
        f"{os.getloadavg()[0]:.1f})",
        f"# model d_model={args.d_model} layers={args.layers} seq={args.seq} "
        f"global batch={args.global_batch} m={args.microbatches}; {args.pairs} pairs x "
        f"{args.steps} steps",
        f"{'side':<22}{'median step s':>14}{'CPU s/step (sum)':>18}{'p2p bytes/step/rank':>21}"
        f"{'last loss':>11}"]
    for sg, name in ((True, "scatter/gather on"), (False, "off (peer: whole)")):
        sent = max(r[sg]["sent"] for r in per_rank)
        lines.append(f"{name:<22}{statistics.median(wall[sg]):>14.3f}"
                     f"{statistics.median(cpu[sg]):>18.3f}{sent:>21,}"
                     f"{per_rank[0][sg]['loss'][-1]:>11.5f}")
    lines.append(f"wall ratio on/off (median of {args.pairs} pairs): "
                 f"{statistics.median(ratios):.3f} "
                 f"(range {min(ratios):.3f}-{max(ratios):.3f}; pairs: "
                 f"{', '.join(f'{r:.3f}' for r in ratios)})")
    lines.append(f"CPU ratio on/off (the headline at 4 ranks on 2 cores): "
                 f"{statistics.median(cpu_ratios):.3f} (range {min(cpu_ratios):.3f}-"
                 f"{max(cpu_ratios):.3f})")
    diff = max(abs(a - b) for a, b in zip(per_rank[0][True]["loss"], per_rank[0][False]["loss"],
                                          strict=True))
    lines.append(f"largest loss difference on vs off over the same steps: {diff:.2e}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
