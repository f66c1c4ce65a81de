"""One GPU: tessera's step executor (NCCL, one rank) against a plain PyTorch training loop.

    python benchmarks/bench_gpu_step.py [--pairs 5] [--steps 10] [--precision bf16] [--profile 3]

What runs: the same Llama-style reference model (``tessera.model``), seed, batch and AdamW
settings on both sides.

- ours: ``parallelize`` + ``Executor`` on a one-rank NCCL process group (the path every layout
  takes: the one-rank schedule through the pipeline runtime, ZeRO's flat units holding bf16
  parameters and gradients with fp32 masters under bf16);
- peer: the reference ``Transformer`` stepped by ``torch.optim.AdamW`` — in bf16 the usual
  ``torch.autocast`` recipe (fp32 parameters and optimizer, bf16 matmuls).

They alternate in one process (``--pairs`` pairs of ``--steps`` timed steps, after warm-up);
each step is synchronized (``torch.cuda.synchronize``). Printed: median step time, tokens/s,
model TFLOP/s (PaLM's 6N + 12·L·H·Q·T per token, ``tessera.model.flops_per_token``), MFU
against the device's dense bf16 peak (989 TFLOP/s on H100/H200), the ratio ours/peer, and both
sides' losses (the same batches; bf16 rounding differs between the two recipes).
``--profile N``: then N profiled steps of each side, the GPU's time per kernel kind, and ours'
memory-bound kernels as passes over the cost model's activation bytes (``passes_line``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.config_io import make_config
from tessera.metrics import device_peak_tflops
from tessera.model import build_model, cross_entropy, flops_per_token
from tessera.optim import adamw
from tessera.step import build_executor
from tessera.topology import Topology


def batches(n: int, b: int, seq: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, 256, (b, seq + 1), generator=g).to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


KERNEL_KINDS = (("attention", ("flash", "fmha", "sdpa", "attention", "efficient")),
                ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
                ("optimizer", ("adam", "multi_tensor")),
                ("reduction/norm", ("reduce", "norm")),
                ("copy/cast", ("copy", "memcpy", "cat", "to_copy")))
"""Kernel name fragments (lower case) per kind, first match wins; the rest is "elementwise"."""


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in low for p in parts)),
                "elementwise/other")


def kernel_breakdown(name: str, step, data, device_time: str = "self_device_time_total",
                     activities=None, kernel_rows: str = "CUDA"
                     ) -> tuple[list[str], dict[str, float]]:
    """Profile `step` over `data` (torch.profiler) and say where the device's time goes.
    Returns the lines (wall time per step, the kernels' summed time and the idle rest, the
    time per kernel kind of KERNEL_KINDS, the six longest kernels) and the seconds per step of
    each kind. The profiler's own host cost inflates the wall and idle times. Only the
    kernels' own rows count (device type `kernel_rows`, not also a host row): an operator's
    row carries its kernels' time too.
    `device_time`, `activities`, `kernel_rows`: what a CPU-only check of this function uses."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = activities or [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for x, y in data:
            step(x, y)
        sync()
        wall = (time.perf_counter() - t0) / len(data)
    averages = prof.key_averages()
    # A user annotation (the optimizer's "Optimizer.step#...") has a host row and a device row
    # of the same name; a kernel has only its device row.
    host = {r.key for r in averages if r.device_type != getattr(DeviceType, kernel_rows)}
    rows = [(r.key, getattr(r, device_time) * 1e-6 / len(data), r.count / len(data))
            for r in averages
            if r.device_type == getattr(DeviceType, kernel_rows) and getattr(r, device_time) > 0
            and (r.key not in host or kernel_rows == "CPU")]
    busy = sum(t for _, t, _ in rows)
    kinds: dict[str, float] = {}
    for key, t, _ in rows:
        kinds[kernel_kind(key)] = kinds.get(kernel_kind(key), 0.0) + t
    out = [f"{name}: {1e3 * wall:.2f} ms per step, kernels {1e3 * busy:.2f} ms "
           f"({len(rows)} kinds, {sum(c for *_, c in rows):.0f} launches), idle "
           f"{1e3 * (wall - busy):.2f} ms"]
    out += [f"  {kind:<18} {1e3 * t:8.2f} ms" for kind, t in
            sorted(kinds.items(), key=lambda kv: -kv[1])]
    out += [f"  top: {1e3 * t:7.2f} ms x{c:.0f} {key[:90]}"
            for key, t, c in sorted(rows, key=lambda r: -r[1])[:6]]
    return out, kinds


MEMORY_BOUND = ("elementwise/other", "copy/cast", "reduction/norm")
"""The kernel kinds the cost model prices as passes over the activation bytes."""


def passes_line(cfg, device: torch.device, kinds: dict[str, float]) -> str:
    """The memory-bound kernels' time per step as passes over the activation bytes the cost
    model counts for this model (``Hardware.eager_elementwise_passes``, which the catalog
    GPUs take from this line): the planner's step at 1 pass minus its step at 0."""
    from dataclasses import replace

    from tessera.planner.estimate import estimate
    from tessera.report import hardware_for, planner_workload

    name = hardware_for(device) or "H100"
    w, layout = planner_workload(cfg, 1, name)

    def step(passes: float) -> float:
        hw = replace(w.hardware, elementwise_passes=passes, eager_elementwise_passes=passes)
        return estimate(replace(w, hardware=hw), layout).step_time

    per_pass = step(1.0) - step(0.0)
    memory = sum(kinds.get(k, 0.0) for k in MEMORY_BOUND)
    return (f"ours: memory-bound kernels ({', '.join(MEMORY_BOUND)}) {1e3 * memory:.2f} ms per "
            f"step = {memory / per_pass:.1f} passes over the cost model's activation bytes "
            f"({1e3 * per_pass:.2f} ms per pass on {name}); the planner's step as the catalog "
            f"prices it: {1e3 * estimate(w, layout).step_time:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--profile", type=int, default=0,
                    help="after the timing, profile this many steps of each side and print "
                         "where the GPU's time goes (kernel_breakdown)")
    args = ap.parse_args()

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=timedelta(minutes=5))
    cfg = make_config(None, model=dict(vocab_size=256, d_model=args.d_model,
                                       n_layers=args.layers, n_heads=args.heads,
                                       n_kv_heads=args.heads // 4, max_seq_len=args.seq),
                      data=dict(seq_len=args.seq),
                      train=dict(micro_batch_size=args.batch, grad_accum=1, lr=3e-4,
                                 precision=args.precision, warmup_steps=0))
    data = batches(args.steps, args.batch, args.seq, device)

    ours = build_executor(cfg, Topology.build(cfg.parallel, "cuda"), device)
    ours_opt = ours.optimizer(cfg.train)

    ref = build_model(cfg.model, cfg.train.seed, device)
    ref_opt = adamw(ref.parameters(), cfg.train)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16,
                              enabled=args.precision == "bf16")

    def step_ours(x, y) -> float:
        ours_opt.zero_grad(set_to_none=True)
        loss = ours.forward_backward([(x, y)])
        ours.clip_grad_norm_(1.0)
        ours_opt.step()
        return loss

    def step_peer(x, y) -> float:
        ref_opt.zero_grad(set_to_none=True)
        with autocast:
            logits = ref(x)
        loss = cross_entropy(logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        return float(loss)

    def timed(step) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for x, y in data:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses.append(step(x, y))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times, losses

    for step in (step_ours, step_peer):  # warm-up: allocator, kernels, lazy imports
        timed(step)
    tokens = args.batch * args.seq
    flops = flops_per_token(cfg.model, args.seq) * tokens
    peak = device_peak_tflops(device)
    results: dict[str, list[float]] = {"ours": [], "peer": []}
    last_losses = {}
    ratios = []
    for _ in range(args.pairs):
        for name, step in (("ours", step_ours), ("peer", step_peer)):
            times, losses = timed(step)
            results[name].append(statistics.median(times))
            last_losses[name] = losses[-1]
        ratios.append(results["ours"][-1] / results["peer"][-1])
    print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"backend nccl (1 rank), precision {args.precision}, model d={args.d_model} "
          f"L={args.layers} heads={args.heads} seq={args.seq} batch={args.batch}, "
          f"{sum(p.numel() for p in ref.parameters()) / 1e6:.1f}M params, "
          f"{args.pairs} pairs x {args.steps} steps")
    for name in ("ours", "peer"):
        t = statistics.median(results[name])
        tflops = flops / t / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a"
        print(f"{name:5s} median step {1e3 * t:8.2f} ms | {tokens / t:12,.0f} tokens/s | "
              f"{tflops:7.1f} model TFLOP/s | MFU {mfu} (dense bf16 peak {peak}) | "
              f"loss after {args.steps * (args.pairs + 1)} steps {last_losses[name]:.4f}")
    print(f"ours/peer step time: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    for name, step in (("ours", step_ours), ("peer", step_peer)) if args.profile else ():
        lines, kinds = kernel_breakdown(name, step, data[:args.profile])
        print("\n".join(lines))
        if name == "ours":
            print(passes_line(cfg, device, kinds))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
