"""The gradient noise scale over a training run on the demo corpus.

    flock /tmp/tessera-bench.lock python benchmarks/noise_scale.py \
        [--steps 200] [--micro-batch 8] [--dp 2] [--data data/stdlib] \
        [--out benchmarks/results/noise_scale.txt]

Trains the demo model at dp 2 with ``tessera train`` (the noise scale is on by default) and
tabulates, every 10 steps, the mean training loss of those steps, the validation loss where it
was measured, and the step's moving averages from ``metrics.jsonl``: B_simple (sequences and
tokens), |G|² and tr(Σ) (``tessera.noise_scale``). McCandlish et al. (2018) find that B_simple
grows as the loss falls; the record states the trend this run shows, whichever way it goes
(the Spearman rank correlation of loss and B_simple over the steps after SETTLED_STEPS).

No PyTorch peer: torch measures no noise scale. Its cost is in the step time of
``metrics.jsonl`` like any other part of the step (one sum of squares over the gradients
before each reduction; no extra collective).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

from tessera.metrics import read_metrics
from tessera.noise_scale import SETTLED_STEPS

WINDOW = 10


def train(out: Path, data: str, dp: int, steps: int, micro_batch: int,
          extra: list[str] = ()) -> tuple[list[dict], str]:
    """One `tessera train --preset demo` run on dp ranks; its step records and its output."""
    cmd = [sys.executable, "-m", "tessera.cli", "train", "--preset", "demo", "--nproc", str(dp),
           "--dp", str(dp), "--steps", str(steps), "--micro-batch-size", str(micro_batch),
           "--data", data, "--out", str(out), "--overwrite",
           "--set", "train.sample_tokens=0", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return read_metrics(out / "metrics.jsonl"), done.stdout


def header(command: str) -> list[str]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    load = os.getloadavg()[0]
    return [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {commit}, "
            f"{platform.machine()} {os.cpu_count()} cores, load average {load:.1f} at the end",
            f"# {command}"]


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for r, i in enumerate(order):
        out[i] = float(r)
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy)


def table(rows: list[dict], batch: int) -> list[str]:
    steps = [r for r in rows if "loss" in r]
    lines = [f"{'step':>5} {'loss':>7} {'val':>7} {'B_simple':>9} {'tokens':>9} "
             f"{'|G|^2':>9} {'tr(S)':>9}  (B_simple: sequences; global batch {batch})"]
    for end in range(WINDOW, len(steps) + 1, WINDOW):
        window = steps[end - WINDOW:end]
        r = window[-1]
        loss = sum(w["loss"] for w in window) / WINDOW
        val = f"{r['val_loss']:7.4f}" if "val_loss" in r else f"{'':7}"
        scale = r.get("noise_scale")
        scale_text = (f"{scale:9.1f} {r['noise_scale_tokens']:9.0f}" if scale is not None
                      else f"{'n/a':>9} {'':9}")
        lines.append(f"{r['step']:5d} {loss:7.4f} {val} {scale_text} {r['grad_sq_est']:9.4f} "
                     f"{r['grad_trace_est']:9.2f}")
    return lines


def trend(rows: list[dict]) -> list[str]:
    settled = [r for r in rows if "loss" in r and r["step"] > SETTLED_STEPS
               and r.get("noise_scale") is not None]
    if len(settled) < 3:
        return ["trend: too few settled steps"]
    first, last = settled[0], settled[-1]
    rho = spearman([r["loss"] for r in settled], [r["noise_scale"] for r in settled])
    grows = "grows" if last["noise_scale"] > first["noise_scale"] else "falls"
    return [f"trend over steps {first['step']}-{last['step']}: B_simple {grows} from "
            f"{first['noise_scale']:.1f} to {last['noise_scale']:.1f} sequences "
            f"({last['noise_scale'] / first['noise_scale']:.2f}x) while the loss goes from "
            f"{first['loss']:.3f} to {last['loss']:.3f}; Spearman rank correlation of loss "
            f"and B_simple: {rho:+.2f} (negative: B_simple grows as the loss falls)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--run-dir", default="runs/bench-noise-scale")
    ap.add_argument("--out", default="benchmarks/results/noise_scale.txt")
    args = ap.parse_args()
    rows, stdout = train(Path(args.run_dir), args.data, args.dp, args.steps, args.micro_batch,
                         ["--set", "train.eval_interval=50"])
    batch = args.dp * args.micro_batch
    summary = [ln for ln in stdout.splitlines() if ln.startswith(("noise scale", "warning"))]
    lines = [*header(f"python benchmarks/noise_scale.py --steps {args.steps} --micro-batch "
                     f"{args.micro_batch} --dp {args.dp}"),
             f"# demo preset (seq_len 128), dp {args.dp} x micro-batch {args.micro_batch}, "
             f"{args.steps} steps; moving averages with decay 0.99 (tessera.noise_scale)",
             *table(rows, batch), "", *trend(rows), *summary]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
