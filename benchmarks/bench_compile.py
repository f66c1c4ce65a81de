"""Regional compilation on CPU: tessera's ``--compile`` against eager, and a compiled plain loop.

    python benchmarks/bench_compile.py [--steps 3] [--out benchmarks/results/compile_cpu.txt]
        [--models demo 23.5M] [--layouts 1 dp2 tp2pp2] [--single-threads 2] [--append]

Models: the demo preset's (1.7M parameters) and a 23.5M-parameter one (d_model 512, 8
layers, 8 heads, 4 key/value heads), sequence 128, global batch 8, fp32, AdamW. Layouts: one
process (``--single-threads``, 2 by default), dp 2 and tp 2 × pp 2 (1F1B, 2 micro-batches;
one thread per rank, 4 ranks time-sharing 2 cores). Each (model, layout) builds an eager
and a compiled (``train.compile``, inductor's C++ backend) executor in the same processes and
alternates their steps (eager, compiled, eager, ...), so both see the same load: the first
step of each (the compiled one compiles), then ``--steps`` more; we print each side's median
step after the first, the compiled/eager ratio, the compile seconds
(``tessera.parallel.compile.compile_seconds``: dynamo + inductor, forward and backward graphs,
rank 0) and the compiled first step's wall time, and both sides' last losses.

Peer (one process, with the one-process layout's threads): the reference model in a plain
loop (cross-entropy, backward, AdamW), eager and ``torch.compile(model)`` (whole model, one
graph: nanoGPT's way), alternated the same way.

Compile cache: the run uses one fresh inductor cache directory (TORCHINDUCTOR_CACHE_DIR), so
the first compile of each graph is cold; a later run whose graphs match an earlier one's
(dp 2's are the one-process graphs at half the batch: other shapes, so cold too) would load
them. One pass per row: a machine shared by other jobs moves single figures by tens of percent
(the header states the load); alternating steps keeps the ratio fairer than the figures.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from tessera.config_io import make_config
from tessera.model import build_model, cross_entropy, param_count
from tessera.optim import adamw
from tessera.testing import rank_micro_batches, run_ranks

SEQ, GLOBAL_BATCH = 128, 8
MODELS = {
    "demo": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=256),
    "23.5M": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=256),
}
LAYOUTS = {"1": dict(), "dp2": dict(dp=2), "tp2pp2": dict(tp=2, pp=2, schedule="1f1b")}


def _cfg(model: dict, layout: dict, compile: bool):
    dp = layout.get("dp", 1)
    m = 2 if layout.get("pp", 1) > 1 else 1
    return make_config(None, model=model, data=dict(seq_len=SEQ),
                       parallel=dict(layout),
                       train=dict(grad_accum=m, micro_batch_size=GLOBAL_BATCH // (dp * m),
                                  compile=compile, warmup_steps=0, grad_clip=1.0))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _alternate(steps: int, step_fns: dict[bool, Callable[[int], float]]) -> list[dict]:
    """Run step 0 (which compiles) and then `steps` steps of each side, alternating eager and
    compiled step by step in this process, so that both see the same load; per side, the
    first step's seconds, the median of the rest, the last loss and the compile seconds."""
    from tessera.parallel.compile import compile_seconds

    times: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, float] = {}
    compiled_s = 0.0
    for step in range(steps + 1):
        for compiled, fn in step_fns.items():
            before = compile_seconds()
            start = time.perf_counter()
            losses[compiled] = fn(step)
            times[compiled].append(time.perf_counter() - start)
            if compiled:
                compiled_s += compile_seconds() - before
    return [dict(first=times[c][0], median=statistics.median(times[c][1:]), loss=losses[c],
                 compile_s=compiled_s if c else 0.0) for c in (False, True)]


def _tessera_rank(model: dict, layout: dict, steps: int) -> list[dict]:
    import torch.distributed as dist

    from tessera.step import build_executor
    from tessera.topology import Topology

    def side(compile: bool) -> Callable[[int], float]:
        cfg = _cfg(model, layout, compile)
        topo = Topology.build(cfg.parallel)
        ex = build_executor(cfg, topo, torch.device("cpu"))
        opt = ex.optimizer(cfg.train)

        def step(k: int) -> float:
            batches = rank_micro_batches(*_batch(k), topo, cfg.train.grad_accum)
            dist.barrier()
            return ex.train_step(batches, opt, grad_clip=1.0).loss

        return step

    return _alternate(steps, {False: side(False), True: side(True)})


def _peer_rank(model: dict, steps: int) -> list[dict]:
    def side(compile: bool) -> Callable[[int], float]:
        cfg = _cfg(model, {}, False)
        net = build_model(cfg.model, cfg.train.seed)
        opt = adamw(net.parameters(), cfg.train)
        forward = torch.compile(net) if compile else net

        def step(k: int) -> float:
            x, y = _batch(k)
            opt.zero_grad(set_to_none=True)
            loss = cross_entropy(forward(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            return loss.item()

        return step

    return _alternate(steps, {False: side(False), True: side(True)})


def _row(label: str, eager: dict, compiled: dict) -> str:
    return (f"{label:<28} {1e3 * eager['median']:>9.0f} {1e3 * compiled['median']:>9.0f} "
            f"{compiled['median'] / eager['median']:>7.2f} {compiled['compile_s']:>9.1f} "
            f"{compiled['first']:>8.1f}   {eager['loss']:.4f} / {compiled['loss']:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--single-threads", type=int, default=2,
                    help="threads of a one-process run (ranks of a layout get 1 each)")
    ap.add_argument("--append", action="store_true", help="append to --out")
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-compile-"))
    load = os.getloadavg()
    lines = [f"# bench_compile.py {' '.join(sys.argv[1:])}, "
             f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch "
             f"{torch.__version__}, {os.cpu_count()} cores, load average at start "
             f"{load[0]:.1f} (a shared machine: other jobs ran beside this one)",
             f"# global batch {GLOBAL_BATCH} x {SEQ} tokens, fp32, AdamW; median of "
             f"{args.steps} steps after the first; compile s: rank 0's dynamo + inductor "
             "seconds; first step: its wall seconds (compile included)",
             f"{'model / layout':<28} {'eager ms':>9} {'comp. ms':>9} {'ratio':>7} "
             f"{'compile s':>9} {'1st s':>8}   loss eager / compiled"]
    print("\n".join(lines), flush=True)
    for name in args.models:
        model = MODELS[name]
        n = param_count(_cfg(model, {}, False).model)
        for layout_name in args.layouts:
            layout = LAYOUTS[layout_name]
            world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
            threads = args.single_threads if world == 1 else 1
            runs = run_ranks(_tessera_rank, world, args=(model, layout, args.steps),
                             threads=threads, timeout=1800, collective_timeout=900)[0]
            lines.append(_row(f"{name} ({n / 1e6:.1f}M) {layout_name}", *runs))
            print(lines[-1], flush=True)
        if "1" not in args.layouts:
            continue
        peer = run_ranks(_peer_rank, 1, args=(model, args.steps),
                         threads=args.single_threads, timeout=1800)[0]
        lines.append(_row(f"{name} peer: plain loop", *peer))
        print(lines[-1], flush=True)
    lines.append(f"# load average at end {os.getloadavg()[0]:.1f}")
    print(lines[-1])
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
