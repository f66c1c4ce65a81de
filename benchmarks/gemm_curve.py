"""The planner's matrix-multiply curve against the GEMMs a device actually runs.

    python benchmarks/gemm_curve.py [--hardware H100] [--repeats 5] [--device cuda]

The planner prices a GEMM of F FLOPs at ``Hardware.gemm_time``: F / (peak · matmul_efficiency)
+ matmul_tail_us. For the catalog GPUs that curve (0.69 of peak, a 40 µs tail) was fitted to
published A100 iteration times (tests/test_planner_scale.py), so on any other GPU it is an
extrapolation, and even on an A100 its tail stands for more than a GEMM's ramp-up (whatever
else a real run spends per GEMM). This script times, on this device, the GEMMs those runs are
priced from — each weight GEMM of one block (``compute.block_gemm_shapes``) of the Korthikanti et
al. GPT runs (22B to 1T, tensor parallel 8, 2048 tokens per micro-batch), of Llama 3 405B
(tensor parallel 8, 8192 tokens) and of ``bench_gpu_step.py``'s model — and a sweep of square
GEMMs, and prints per GEMM: measured TFLOP/s and share of peak, the catalog curve's, and
measured / predicted time. Last, the curve fitted to these timings (least squares of
time = F / R + tail), beside the catalog's.

Y = X·W with X (m, k), W (k, n) in bf16 on a GPU (fp32 on a CPU), random normal data; each
GEMM is run `--iters` times back to back between two CUDA events (a wall clock on a CPU) after
warm-up, and the median over `--repeats` such runs is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.planner.compute import block_gemm_shapes
from tessera.planner.hardware import load_hardware
from tessera.planner.models import KORTHIKANTI_RUNS, ModelSpec, from_model_config, llama3

# name, spec, tensor-parallel degree, tokens per micro-batch (m): the published runs'
# layouts (sequence 2048, micro-batch 1)
KORTHIKANTI_SHAPES = [(f"{row.model.name} t{row.tp}", row.model, row.tp, 2048)
                      for row in KORTHIKANTI_RUNS]


def workloads() -> list[tuple[str, ModelSpec, int, int]]:
    from tessera.config_io import make_config

    # bench_gpu_step.py's default model (its make_config), one block of it
    cfg = make_config(None, model=dict(vocab_size=256, d_model=1024, n_layers=1, n_heads=16,
                                       n_kv_heads=4, max_seq_len=1024))
    bench = from_model_config("bench_gpu_step", cfg.model)
    return [*KORTHIKANTI_SHAPES,
            ("llama3-405b t8", llama3("llama3-405b", 16384, 1, 128, 53248), 8, 8192),
            ("bench_gpu_step t1", bench, 1, 16 * 1024)]


def gemm_list(square: tuple[int, ...]) -> list[tuple[str, int, int, int]]:
    """(label, m, k, n) of every GEMM timed: each distinct block GEMM of each workload, then
    the squares."""
    out = []
    for name, spec, t, tokens in workloads():
        for k, n in dict.fromkeys(block_gemm_shapes(spec, t)):
            out.append((name, tokens, int(k), int(n)))
    out += [("square", s, s, s) for s in square]
    return out


def time_gemm(kind: str, m: int, k: int, n: int, device: torch.device, dtype: torch.dtype,
              iters: int, repeats: int) -> float:
    """Median seconds of one GEMM of Y = X·W, X (m, k), W (k, n) (module docstring): `kind`
    fwd is Y itself, dX = dY·Wᵀ and dW = Xᵀ·dY its backward's two, with the transposes as
    autograd passes them (views, not copies)."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    a, b = {"fwd": (x, w), "dX": (dy, w.t()), "dW": (x.t(), dy)}[kind]
    out = torch.empty(a.shape[0], b.shape[1], device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e-3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                torch.mm(a, b, out=out)
            runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def fit_curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (rate FLOP/s, tail seconds) of seconds = flops / rate + tail."""
    xs, ys = [f for f, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x in xs))
    return 1.0 / slope, my - slope * mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default=None,
                    help="catalog entry whose curve is compared (default: this GPU's, "
                         "src/tessera/report.py hardware_for; H100 on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--square", default="512,1024,2048,4096,8192",
                    help="sizes of the square GEMMs timed after the workloads' own")
    ap.add_argument("--scale", type=int, default=1,
                    help="divide every dimension by this (a quick run on a CPU)")
    args = ap.parse_args()

    from tessera.report import hardware_for

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = args.hardware or (hardware_for(device) if device.type == "cuda" else None) or "H100"
    hw = load_hardware(name)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# device {label}, torch {torch.__version__}, {dtype}; compared with the catalog "
          f"curve of {hw.name}: {hw.matmul_efficiency:.2f} of {hw.peak_tflops:.0f} TFLOP/s "
          f"+ {hw.matmul_tail_us:.0f} µs per GEMM")
    print(f"{'workload':<20} {'m':>6} {'k':>6} {'n':>6} {'GEMM':>4} {'GFLOP':>8} "
          f"{'measured':>9} {'of peak':>7} {'curve':>9} {'of peak':>7} {'meas/pred':>9}")
    square = tuple(int(s) for s in args.square.split(",") if s)
    points, backward = [], []
    for wl, m, k, n in gemm_list(square):
        m, k, n = (max(1, d // args.scale) for d in (m, k, n))
        flops = 2.0 * m * k * n
        predicted = hw.gemm_time(flops)
        timed = {}
        for kind in ("fwd", "dX", "dW"):
            seconds = timed[kind] = time_gemm(kind, m, k, n, device, dtype, args.iters,
                                              args.repeats)
            points.append((flops, seconds))
            print(f"{wl:<20} {m:>6} {k:>6} {n:>6} {kind:>4} {flops / 1e9:>8.1f} "
                  f"{flops / seconds / 1e12:>7.1f} T "
                  f"{flops / seconds / 1e12 / hw.peak_tflops:>7.1%} "
                  f"{flops / predicted / 1e12:>7.1f} T "
                  f"{flops / predicted / 1e12 / hw.peak_tflops:>7.1%} "
                  f"{seconds / predicted:>9.2f}")
        backward.append((timed["dX"] + timed["dW"]) / timed["fwd"])
    print(f"backward / forward (dX + dW over Y; the planner takes 2): median "
          f"{statistics.median(backward):.2f}, range {min(backward):.2f}-{max(backward):.2f}")
    rate, tail = fit_curve(points)
    print(f"fitted to these {len(points)} GEMMs: {rate / 1e12:.0f} TFLOP/s "
          f"({rate / 1e12 / hw.peak_tflops:.0%} of peak) + {tail * 1e6:.1f} µs per GEMM; "
          f"catalog: {hw.matmul_flops / 1e12:.0f} TFLOP/s ({hw.matmul_efficiency:.0%}) "
          f"+ {hw.matmul_tail_us:.1f} µs")


if __name__ == "__main__":
    main()
