"""One GPU: tessera's step executor (NCCL, one rank) against a plain PyTorch training loop.

    python benchmarks/bench_gpu_step.py [--pairs 5] [--steps 10] [--precision bf16]

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
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.config import make_config
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
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
