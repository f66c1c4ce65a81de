"""Mixture of experts on CPU/gloo: quality against the dense model, and expert-parallel timing.

    python benchmarks/bench_moe.py [--part quality|timing|balance|both] [--quality-steps 200]
                                   [--pairs 5] [--data data/stdlib]

Quality: the ``demo`` preset (dense, SwiGLU 512 wide) and the ``moe-demo`` preset (16 experts of
128, top-4: the same active parameters per token plus the router's 16·h per layer) trained on the
demo corpus with the same global batch (32 × 128 bytes), steps, learning rate and seed, on 2
ranks each (dp 2; MoE with ep 2). Printed: both validation losses (every 50 steps and at the
end), their difference, and both parameter counts (total and active).

Timing: the same MoE model and global batch (16 × 128) run as one process (2 threads) and as ep
2 and ep 4 (dp = ep, one thread per rank), alternately in the same session, --pairs times.
Per run: the median over the steps after 2 warm-up steps of the slowest rank's wall time, the
CPU time (user + sys) summed over ranks, and the share of the wall time the ranks spend in the
token all-to-alls (dispatch and combine, forward and backward; ``A2AStats.seconds``, mean over
ranks; it includes waiting there for the slower peer, so it bounds the cost of the exchange
from above). Ratios are ep / single per pair; the median and spread over pairs are printed. At 4
ranks on 2 cores wall time includes waiting for a core (BENCHMARKING.md): read the CPU time.

Balance (``--part balance``): the ``moe-demo`` preset on the demo corpus, one process, 200 steps
(its learning-rate schedule) three times: with its Switch auxiliary loss (coefficient 0.01),
with no balancing at all, and with DeepSeek-V3's routing bias instead (rate 1e-3, no aux loss).
Printed per run: for each MoE layer the busiest expert's tokens over the mean, counted over the
last 20 steps, and the largest over layers (the issue's line: under 1.5x with balancing).
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: idle threads sleep instead of spinning on a shared 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from tessera.config import Config  # noqa: E402
from tessera.config_io import make_config  # noqa: E402
from tessera.model import active_param_count, param_count  # noqa: E402
from tessera.step import build_executor  # noqa: E402
from tessera.testing import run_ranks  # noqa: E402
from tessera.topology import Topology  # noqa: E402

WARMUP, TIMED = 2, 6


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- quality -----------------------------------------------------------------------------------

def quality_config(preset: str, data: str, steps: int, out: str) -> Config:
    return make_config(preset, overrides=[f"data.path={data}"],
                       train=dict(steps=steps, eval_interval=50, log_interval=50,
                                  sample_tokens=0, out_dir=out))


def _train(cfg: Config) -> list[tuple[int, float]]:
    from tessera.trainer import train

    return train(cfg, progress=False).val_losses


def quality(data: str, steps: int) -> list[str]:
    lines = [f"quality: demo corpus {data}, {steps} steps, global batch 32 x 128, 2 ranks each"]
    curves = {}
    for preset in ("demo", "moe-demo"):
        cfg = quality_config(preset, data, steps, f"runs/bench_moe_{preset}")
        start = time.perf_counter()
        curves[preset] = run_ranks(_train, 2, args=(cfg,), timeout=3600)[0]
        m = cfg.model
        lines.append(f"  {preset:9s} params {param_count(m) / 1e6:.2f}M, active "
                     f"{active_param_count(m) / 1e6:.2f}M per token; layout dp={cfg.parallel.dp}"
                     f" ep={cfg.parallel.ep}; {time.perf_counter() - start:.0f} s")
    lines.append("  step    val demo   val moe-demo")
    for (step, dense), (_, moe) in zip(curves["demo"], curves["moe-demo"], strict=True):
        lines.append(f"  {step:5d}   {dense:8.4f}   {moe:8.4f}")
    dense, moe = curves["demo"][-1][1], curves["moe-demo"][-1][1]
    verdict = "lower" if moe < dense else "NOT lower"
    lines.append(f"  final validation loss: moe-demo {moe:.4f} vs demo {dense:.4f} "
                 f"({moe - dense:+.4f} nats/byte; MoE {verdict})")
    return lines


# -- balance -----------------------------------------------------------------------------------

def _busiest_per_layer(data: str, steps: int, last: int, **moe: float) -> list[float]:
    from tessera.data.loader import BatchLoader, TokenDataset
    from tessera.moe import moe_layers
    from tessera.optim import lr_lambda

    preset = make_config("moe-demo")
    # One process holds what the preset's dp ranks hold: the same global batch, accumulated.
    accum = preset.parallel.dp * preset.train.grad_accum
    cfg = make_config("moe-demo", overrides=[f"data.path={data}"], model=dict(**moe),
                      parallel=dict(dp=1, ep=1), train=dict(steps=steps, grad_accum=accum))
    executor = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
    opt = executor.optimizer(cfg.train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train))
    loader = BatchLoader(TokenDataset(cfg.data.path).train, cfg.data.seq_len,
                         cfg.train.micro_batch_size, cfg.train.grad_accum, 0, 1, cfg.data.seed)
    layers = [m for c in executor.model.chunks.values() for m in moe_layers(c)]
    for step in range(steps):
        if step == steps - last:
            for m in layers:
                m.stats.reset()
        executor.train_step(loader, opt, sched, cfg.train.grad_clip)
    return [float(m.stats.tokens_per_expert.max() / m.stats.tokens_per_expert.mean())
            for m in layers]


def balance(data: str, steps: int = 200, last: int = 20) -> list[str]:
    lines = [f"balance: moe-demo on {data}, one process, {steps} steps; busiest expert's tokens "
             f"/ mean per MoE layer over the last {last} steps"]
    runs = {"Switch aux loss 0.01": dict(moe_aux_loss_coef=0.01),
            "no balancing": dict(moe_aux_loss_coef=0.0),
            "routing bias 1e-3, no aux": dict(moe_aux_loss_coef=0.0, moe_router_bias_rate=1e-3)}
    for name, moe in runs.items():
        start = time.perf_counter()
        ratios = _busiest_per_layer(data, steps, last, **moe)
        lines.append(f"  {name:27s} max {max(ratios):.2f}  per layer "
                     + " ".join(f"{r:.2f}" for r in ratios)
                     + f"  ({time.perf_counter() - start:.0f} s)")
    return lines


# -- timing ------------------------------------------------------------------------------------

def timing_config(ep: int) -> Config:
    dp = max(ep, 1)
    return make_config("moe-demo", model=dict(moe_capacity_factor=0.0),
                       parallel=dict(dp=dp, ep=ep),
                       train=dict(micro_batch_size=16 // dp, grad_accum=1, steps=WARMUP + TIMED))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (16, 129), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _time_rank(cfg: Config, threads: int) -> dict[str, list[float]]:
    torch.set_num_threads(threads)
    topo = Topology.build(cfg.parallel)
    executor = build_executor(cfg, topo, torch.device("cpu"))
    opt = executor.optimizer(cfg.train)
    d, dp = topo.coords()["dp"], topo.dp
    ep = executor.model.ep
    out: dict[str, list[float]] = {"wall": [], "cpu": [], "a2a": [], "loss": []}
    for step in range(WARMUP + TIMED):
        x, y = _batch(step)
        rows = slice(d * 16 // dp, (d + 1) * 16 // dp)
        if ep is not None:
            ep.stats.reset()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        c0 = cpu_seconds()
        done = executor.train_step([(x[rows], y[rows])], opt, grad_clip=1.0)
        out["cpu"].append(cpu_seconds() - c0)
        out["wall"].append(done.seconds)
        out["a2a"].append(ep.stats.seconds if ep is not None else 0.0)
        out["loss"].append(done.loss)
    return out


def measure(ep: int) -> dict[str, float]:
    """One run: median over timed steps of the slowest rank's wall, summed CPU, mean a2a."""
    cfg = timing_config(ep)
    if ep == 1:
        ranks = [_time_rank(cfg, 2)]
    else:
        ranks = run_ranks(_time_rank, ep, args=(cfg, 1), timeout=1200)
    steps = range(WARMUP, WARMUP + TIMED)
    wall = [max(r["wall"][s] for r in ranks) for s in steps]
    cpu = [sum(r["cpu"][s] for r in ranks) for s in steps]
    a2a = [statistics.mean(r["a2a"][s] for r in ranks) for s in steps]
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu),
            "a2a_share": statistics.median(a / w for a, w in zip(a2a, wall, strict=True)),
            "loss": ranks[0]["loss"][-1]}


def timing(pairs: int, eps: list[int]) -> list[str]:
    cfg = timing_config(1)
    m = cfg.model
    lines = [f"timing: moe-demo model (E={m.moe_experts}, top-{m.moe_top_k}, dropless, "
             f"d={m.d_model}, L={m.n_layers}), global batch 16 x 128, fp32; single process "
             f"2 threads, ep ranks 1 thread each; {pairs} alternating pairs; warm-up "
             f"{WARMUP}, median of {TIMED} steps"]
    runs: dict[int, list[dict[str, float]]] = {e: [] for e in [1, *eps]}
    for _ in range(pairs):
        for e in [1, *eps]:
            runs[e].append(measure(e))
    single = runs[1]
    lines.append(f"  single process: wall {1e3 * statistics.median(r['wall'] for r in single):.0f}"
                 f" ms/step, CPU {1e3 * statistics.median(r['cpu'] for r in single):.0f} ms/step"
                 f", loss after {WARMUP + TIMED} steps {single[-1]['loss']:.4f}")
    for e in eps:
        wall_ratio = [r["wall"] / s["wall"] for r, s in zip(runs[e], single, strict=True)]
        cpu_ratio = [r["cpu"] / s["cpu"] for r, s in zip(runs[e], single, strict=True)]
        rs = runs[e]
        lines.append(
            f"  ep {e} (dp {e}): wall {1e3 * statistics.median(r['wall'] for r in rs):.0f} ms/"
            f"step = {statistics.median(wall_ratio):.2f}x single (spread "
            f"{min(wall_ratio):.2f}-{max(wall_ratio):.2f}); CPU summed over ranks "
            f"{1e3 * statistics.median(r['cpu'] for r in rs):.0f} ms/step = "
            f"{statistics.median(cpu_ratio):.2f}x (spread {min(cpu_ratio):.2f}-"
            f"{max(cpu_ratio):.2f}); dispatch/combine all-to-all "
            f"{100 * statistics.median(r['a2a_share'] for r in rs):.1f}% of the step; loss "
            f"{rs[-1]['loss']:.4f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("quality", "timing", "balance", "both"), default="both")
    parser.add_argument("--quality-steps", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--out", default="benchmarks/results/moe.txt")
    args = parser.parse_args()
    header = [f"# bench_moe.py {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
              f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, load average "
              f"{os.getloadavg()[0]:.1f} at start (other users of the machine)"]
    lines = list(header)
    if args.part in ("timing", "both"):
        lines += timing(args.pairs, args.ep)
        print("\n".join(lines), flush=True)
    if args.part in ("quality", "both"):
        q = quality(args.data, args.quality_steps)
        print("\n".join(q), flush=True)
        lines += q
    if args.part == "balance":
        b = balance(args.data)
        print("\n".join(b), flush=True)
        lines += b
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n\n")
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
