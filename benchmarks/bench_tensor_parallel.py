"""Tensor parallelism: tessera's Megatron TP/SP against PyTorch DTensor TP, on CPU/gloo.

    python benchmarks/bench_tensor_parallel.py [--tp 2 4] [--pairs 5] [--steps 4]

Both sides train the same Llama-style model (tessera.model.Transformer, same seed, fp32, AdamW,
one micro-batch per step, no clipping) on the same fixed batch:

- ours: ``tessera.step.build_executor`` with tp = t (Megatron TP/SP from ``tessera.parallelize``,
  vocab-parallel embedding and loss; the step runs through the one-rank pipeline schedule);
- peer: ``parallelize_module`` with ColwiseParallel / RowwiseParallel on wq, wk, wv / wo and
  w1, w3 / w2, a RowwiseParallel embedding, a ColwiseParallel head with ``loss_parallel``, and
  with SP: SequenceParallel on the norms and PrepareModuleInput gathering the sequence once per
  attention/MLP (the torchtitan plan). Without SP, PrepareModuleInput makes the region input one
  replicated DTensor so wq, wk, wv share one backward all-reduce, as Megatron's f.

Each (tp, SP) configuration runs ``--pairs`` alternating pairs (ours, then DTensor, each in fresh
processes); a run warms up, then times ``--steps`` optimizer steps (wall clock, and CPU time
summed over ranks). We print the median step time of each side, the median of the per-pair
ratios with its spread, the bytes each rank sends per step (ring bytes-equivalents of every
collective issued, counted for both sides by the same dispatch-mode spy; ours also by its own
CommStats; DTensor's loss_parallel and norm-gradient reductions, a few KiB, do not pass through
the dispatcher and are not seen) and both losses after the same steps. Ours runs SP without
the backward re-gather (``--sp-regather`` turns it on) so that both sides store the gathered
input and move the same bytes; at tp=4 the 4 ranks share 2 cores, so wall times include
waiting for a core.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from tessera.model import build_model, cross_entropy
from tessera.optim import adamw
from tessera.parallel.comm import CommStats
from tessera.step import build_executor
from tessera.testing import RankFailure, run_ranks
from tessera.topology import Topology

MODEL = dict(vocab_size=256, d_model=256, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=128)
SEQ, BATCH = 128, 8


class ByteSpy(TorchDispatchMode):
    """Ring bytes-equivalents one rank sends, from every c10d collective dispatched."""

    def __init__(self, t: int):
        super().__init__()
        self.t, self.bytes, self.ops = t, 0.0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, t = str(func), self.t
        share = (t - 1) / t
        if name.startswith("c10d.allreduce_"):
            n = sum(x.numel() * x.element_size() for x in args[0])
            self._add(name, 2 * share * n)
        elif name.startswith("c10d._allgather_base_"):
            self._add(name, share * args[0].numel() * args[0].element_size())
        elif name.startswith("c10d._reduce_scatter_base_"):
            self._add(name, share * args[1].numel() * args[1].element_size())
        elif name.startswith("_c10d_functional.all_gather_into_tensor"):
            self._add(name, (t - 1) * args[0].numel() * args[0].element_size())
        elif name.startswith("_c10d_functional.reduce_scatter_tensor"):
            self._add(name, share * args[0].numel() * args[0].element_size())
        elif name.startswith("_c10d_functional.all_reduce"):
            self._add(name, 2 * share * args[0].numel() * args[0].element_size())
        elif (name.startswith("c10d.") or name.startswith("_c10d_functional.")) and \
                "wait" not in name and "wrap" not in name:
            self._add(name, float("nan"))  # an op this spy does not price: shows as nan
        return func(*args, **(kwargs or {}))

    def _add(self, name: str, nbytes: float) -> None:
        self.bytes += nbytes
        self.ops[name.split(".")[1]] = self.ops.get(name.split(".")[1], 0) + 1


def data() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(step, warmup: int, steps: int, t: int) -> dict:
    for _ in range(warmup):
        step()
    spy = ByteSpy(t)
    with spy:
        step()
    walls, cpus, loss = [], [], 0.0
    for _ in range(steps):
        dist.barrier()
        w0, c0 = time.perf_counter(), cpu_seconds()
        loss = step()
        walls.append(time.perf_counter() - w0)
        cpus.append(cpu_seconds() - c0)
    return {"wall": walls, "cpu": cpus, "loss": loss, "spy_bytes": spy.bytes, "ops": spy.ops}


def ours(t: int, sp: bool, regather: bool, warmup: int, steps: int) -> dict:
    cfg = Config(model=ModelConfig(**MODEL),
                 parallel=ParallelConfig(tp=t, sequence_parallel=sp),
                 train=TrainConfig(grad_clip=0.0, seed=0, micro_batch_size=BATCH),
                 data=DataConfig(path="unused", seq_len=SEQ))
    stats = CommStats()  # the TP collectives of the last step
    executor = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"),
                              regather=regather, tp_stats=stats)
    optimizer = executor.optimizer(cfg.train)
    batch = [data()]

    def step() -> float:
        stats.reset()
        optimizer.zero_grad(set_to_none=True)
        loss = executor.forward_backward(batch)
        optimizer.step()
        return loss

    out = timed(step, warmup, steps, t)
    out["own_bytes"] = stats.bytes_sent()
    return out


def dtensor(t: int, sp: bool, warmup: int, steps: int) -> dict:
    cfg = ModelConfig(**MODEL)
    mesh = init_device_mesh("cpu", (t,))
    model = build_model(cfg, seed=0)
    act = Shard(1) if sp else Replicate()  # the residual stream's layout
    for block in model.layers:
        plan = {
            "attention": PrepareModuleInput(input_layouts=(act, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward": PrepareModuleInput(input_layouts=(act,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, mesh, plan)
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
           "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1),
                                     use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    optimizer = adamw(model.parameters(), TrainConfig())
    x, y = data()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        with loss_parallel():
            loss = cross_entropy(logits, y)
            loss.backward()
        optimizer.step()
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    return timed(step, warmup, steps, t)


def launch(fn, t: int, args: tuple) -> list[dict]:
    """run_ranks, retried once if a rank never joined the process group: on this shared
    machine a forked rank occasionally stalls in start-up (before any measured work)."""
    try:
        return run_ranks(fn, t, args=args, timeout=600)
    except RankFailure as e:
        if "init_process_group" not in str(e):
            raise
        print("note: a rank stalled joining the process group; run repeated", file=sys.stderr)
        return run_ranks(fn, t, args=args, timeout=600)


def run_side(side: str, t: int, sp: bool, args) -> dict:
    if side == "ours":
        per_rank = launch(ours, t, (t, sp, args.sp_regather, args.warmup, args.steps))
    else:
        per_rank = launch(dtensor, t, (t, sp, args.warmup, args.steps))
    walls = [max(ws) for ws in zip(*(r["wall"] for r in per_rank), strict=True)]
    cpus = [sum(cs) for cs in zip(*(r["cpu"] for r in per_rank), strict=True)]
    r0 = per_rank[0]
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "loss": r0["loss"],
            "spy_bytes": r0["spy_bytes"], "own_bytes": r0.get("own_bytes"), "ops": r0["ops"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sp-regather", action="store_true",
                        help="ours re-gathers SP inputs in backward (less memory, more bytes)")
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel.txt")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the parent forks the ranks; each rank runs 1 thread

    lines = [f"# bench_tensor_parallel, {datetime.date.today()}, torch {torch.__version__}, "
             f"{os.cpu_count()} CPUs, gloo, 1 thread per rank, fp32",
             f"# model {MODEL}, batch {BATCH}x{SEQ}, {args.pairs} alternating pairs x "
             f"{args.steps} timed steps (after {args.warmup} warm-up), SP re-gather "
             f"{'on' if args.sp_regather else 'off'}",
             f"# load average {os.getloadavg()[0]:.1f} at start (above the ranks running here: "
             "other jobs shared the machine); medians of alternating pairs",
             f"{'tp':>3} {'SP':>3} | {'ours ms':>8} {'dtensor ms':>10} {'ratio':>6} "
             f"{'(min-max)':>11} | {'ours cpu':>8} {'dt cpu':>7} | {'ours KiB':>8} "
             f"{'dt KiB':>7} | {'ours loss':>9} {'dt loss':>8}"]
    print("\n".join(lines), flush=True)
    for t in args.tp:
        for sp in (False, True):
            pairs = []
            for _ in range(args.pairs):
                pairs.append((run_side("ours", t, sp, args), run_side("dtensor", t, sp, args)))
            ratios = [a["wall"] / b["wall"] for a, b in pairs]
            a, b = pairs[-1]
            if a["own_bytes"] != a["spy_bytes"]:
                print(f"warning: own count {a['own_bytes']} != spy count {a['spy_bytes']}",
                      file=sys.stderr)
            line = (f"{t:>3} {'yes' if sp else 'no':>3} | "
                    f"{1e3 * statistics.median(p[0]['wall'] for p in pairs):>8.1f} "
                    f"{1e3 * statistics.median(p[1]['wall'] for p in pairs):>10.1f} "
                    f"{statistics.median(ratios):>6.2f} "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) | "
                    f"{1e3 * statistics.median(p[0]['cpu'] for p in pairs):>8.0f} "
                    f"{1e3 * statistics.median(p[1]['cpu'] for p in pairs):>7.0f} | "
                    f"{a['spy_bytes'] / 1024:>8.0f} {b['spy_bytes'] / 1024:>7.0f} | "
                    f"{a['loss']:>9.4f} {b['loss']:>8.4f}")
            print(line, f"  ops ours {a['ops']} dtensor {b['ops']}", flush=True)
            lines.append(line)
    lines.append("# ms: median wall time of a step (slowest rank); cpu: median CPU ms per step "
                 "summed over ranks; KiB: bytes one rank sends per step (ring equivalents); "
                 "ratio: ours/dtensor per pair, median (min-max)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
