"""Context-parallel attention against single-process attention at the same total length, CPU/gloo.

    python benchmarks/bench_context_parallel.py [--cp 2 4] [--seq 2048] [--reps 5]

One causal attention layer's core (fp32, B=1, 8 query heads, 2 kv heads, head dim 64): q, k, v
of the whole sequence, forward then backward of a fixed random output gradient.

- ours: ``ContextParallelAttention`` on cp gloo ranks (one thread each), each holding its
  zig-zag 1/cp of the sequence, for every method (ring, allgather, ulysses, hybrid);
- peer: ``tessera.model.AttentionCore`` (torch SDPA, causal, GQA) on the whole sequence in one
  process with one thread, measured in the same run.

A measurement is the median over --reps timed repetitions (after one warm-up) of the slowest
rank's forward+backward wall time. We print both times and their ratio, the bytes each rank
sent (counted by CommStats; the formulas of ``context_parallel.bytes_per_layer``), and the
chunk-pair products per rank (zig-zag balance). With cp ranks on a 2-core machine the ranks
share cores, so wall times at cp=4 include waiting for a core; this is a correctness-scale
benchmark, not a speed claim.

torch's own ``context_parallel`` (torch.distributed.tensor.experimental) is attempted on the
same mesh: in torch 2.13 it does not run on CPU/gloo; the exception it raises is printed.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.model import AttentionCore
from tessera.parallel.comm import CommStats
from tessera.parallel.context_parallel import (
    METHODS,
    ContextParallelAttention,
    CPContext,
    hybrid_groups,
    shard_sequence,
)
from tessera.testing import run_ranks

B, HEADS, KV_HEADS, HD = 1, 8, 2, 64


def inputs(T: int):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, HEADS, T, HD, generator=g), torch.randn(B, KV_HEADS, T, HD, generator=g),
            torch.randn(B, KV_HEADS, T, HD, generator=g), torch.randn(B, HEADS, T, HD, generator=g))


def fwd_bwd(core, q, k, v, dout) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, bytes autograd saved for backward) of one
    forward + backward. The saved bytes are the distinct storages attention keeps for its
    backward (inputs included): its activation memory on this rank."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    c0, t0 = time.process_time(), time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = core(q, k, v)
    (y * dout).sum().backward()
    return time.perf_counter() - t0, time.process_time() - c0, sum(saved.values())


def _rank(T: int, reps: int) -> dict:
    cp, rank = dist.get_world_size(), dist.get_rank()
    u_group, r_group = hybrid_groups([list(range(cp))], 2, rank)
    local = [shard_sequence(t, 2, cp, rank) for t in inputs(T)]
    out = {}
    for method in METHODS:
        ctx = CPContext(dist.group.WORLD, method, ulysses_group=u_group, ring_group=r_group,
                        stats=CommStats())
        core = ContextParallelAttention(ctx)
        fwd_bwd(core, *local)  # warm-up
        ctx.stats.reset()
        ctx.work.products = 0
        times, cpus, memory = [], [], 0
        for _ in range(reps):
            dist.barrier()
            wall, cpu, saved = fwd_bwd(core, *local)
            t = torch.tensor([wall, float(saved)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, the fullest rank
            c = torch.tensor(cpu, dtype=torch.float64)
            dist.all_reduce(c)  # CPU time summed over the ranks
            times.append(float(t[0]))
            cpus.append(float(c))
            memory = max(memory, int(t[1]))
        out[method] = {"time": statistics.median(times), "cpu": statistics.median(cpus),
                       "memory": memory, "bytes": ctx.stats.bytes_sent() / reps,
                       "products": ctx.work.products // reps}
    out["torch"] = torch_context_parallel(T, cp)
    return out


def torch_context_parallel(T: int, cp: int) -> str:
    """Try torch's experimental context_parallel on a CPU/gloo mesh; the outcome in words."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (cp,))
        q, k, v, _ = (t.clone() for t in inputs(T))
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1).contiguous() for t in (k, v))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ran"
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        return f"does not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/context_parallel.txt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    T = args.seq
    core = AttentionCore()
    fwd_bwd(core, *inputs(T))
    runs = [fwd_bwd(core, *inputs(T)) for _ in range(args.reps)]
    single = statistics.median(r[0] for r in runs)
    single_cpu = statistics.median(r[1] for r in runs)
    single_mem = max(r[2] for r in runs)
    lines = [f"# bench_context_parallel {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}Z, "
             f"torch {torch.__version__}, {platform.machine()}, "
             f"{__import__('os').cpu_count()} cores",
             f"# causal attention fwd+bwd, fp32, B={B} heads={HEADS} kv_heads={KV_HEADS} "
             f"head_dim={HD} T={T}; median of {args.reps}",
             f"single process (SDPA, 1 thread): {single * 1e3:8.1f} ms wall, "
             f"{single_cpu * 1e3:8.1f} ms CPU, {single_mem / 2**20:6.2f} MiB saved for backward",
             "# ms: slowest rank's wall time; CPU ms: summed over the ranks; attn MiB: the fullest "
             "rank's bytes saved for backward",
             f"{'cp':>3} {'method':>10} {'ms':>9} {'vs single':>10} {'CPU ms':>9} "
             f"{'CPU vs 1':>9} {'attn MiB':>9} {'vs 1':>6} {'MiB sent/rank':>14} "
             f"{'products/rank':>14}"]
    for cp in args.cp:
        per_rank = run_ranks(_rank, cp, args=(T, args.reps), timeout=900)
        for method in METHODS:
            r = per_rank[0][method]
            products = [p[method]["products"] for p in per_rank]
            lines.append(f"{cp:>3} {method:>10} {r['time'] * 1e3:9.1f} "
                         f"{r['time'] / single:9.2f}x {r['cpu'] * 1e3:9.1f} "
                         f"{r['cpu'] / single_cpu:8.2f}x {r['memory'] / 2**20:9.2f} "
                         f"{r['memory'] / single_mem:5.2f}x {r['bytes'] / 2**20:14.2f} "
                         f"{str(products):>14}")
        lines.append(f"    torch context_parallel on CPU/gloo, cp={cp}: {per_rank[0]['torch']}")
    print("\n".join(lines))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
