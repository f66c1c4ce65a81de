"""Learning-rate scaling at 4x the reference batch, compared at equal tokens on the demo corpus.

    flock /tmp/tessera-bench.lock python benchmarks/lr_scaling.py \
        [--reference-batch 8] [--steps 256] [--lr 1e-3] [--dp 2] [--seq-len 64] \
        [--data data/stdlib] [--out benchmarks/results/lr_scaling.txt]

Four `tessera train --preset demo` runs on dp ranks, each seeing the same number of tokens:

- the reference: R sequences per step (``--reference-batch``), ``--steps`` steps at ``--lr``;
- at 4R sequences per step for a quarter of the steps, with ``--lr-scaling`` none (lr),
  linear (4·lr, warm-up at least steps/18: Goyal et al. 2017) and sqrt (2·lr: Malladi et al.
  2022), all against ``--reference-batch R`` (``tessera.optim.scaled``).

Each run's warm-up is ``train.warmup_steps`` = 10% of its steps, its cosine ends at its last
step, and the validation loss is measured once, after the last step, on the same held-out
tokens. The record lists each run's learning rate, warm-up, steps, tokens and validation loss
against the reference's, and the gradient noise scale the reference run measured
(``tessera.noise_scale``): above it, the 4x batch needs more samples whatever the rate
(samples grow as 1 + B/B_crit), which the warnings of the 4x runs say. Whichever way the
losses fall, they are recorded as measured; one seed per run, so differences of a few
hundredths are within the spread of seeds.

No PyTorch peer: the same engine runs every arm; the comparison is between scaling rules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from noise_scale import header, train  # noqa: E402 - the launcher of the sibling benchmark


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--run-dir", default="runs/bench-lr-scaling")
    ap.add_argument("--out", default="benchmarks/results/lr_scaling.txt")
    args = ap.parse_args()
    ref, dp = args.reference_batch, args.dp
    arms = [("reference", ref, args.steps, "none")]
    arms += [(f"4x {rule}", 4 * ref, args.steps // 4, rule) for rule in ("none", "linear", "sqrt")]
    results = []
    for name, batch, steps, rule in arms:
        extra = ["--lr-scaling", rule, "--reference-batch", str(ref),
                 "--set", f"train.lr={args.lr}", "--set", f"train.warmup_steps={steps // 10}",
                 "--set", "train.eval_interval=0", "--set", f"data.seq_len={args.seq_len}"]
        rows, stdout = train(Path(args.run_dir) / name.replace(" ", "-"), args.data, dp, steps,
                             batch // dp, extra)
        step0 = rows[0]
        last = [r for r in rows if "loss" in r][-1]
        warning = [ln for ln in stdout.splitlines() if ln.startswith("warning: global batch")]
        results.append((name, batch, steps, step0.get("scaled_lr", args.lr),
                        step0.get("scaled_warmup_steps", steps // 10), last, warning))
        print(name, last["val_loss"], flush=True)
    reference_val = results[0][5]["val_loss"]
    noise = results[0][5].get("noise_scale")
    lines = [*header(f"python benchmarks/lr_scaling.py --reference-batch {ref} --steps "
                     f"{args.steps} --lr {args.lr} --dp {dp} --seq-len {args.seq_len}"),
             f"# demo model, seq_len {args.seq_len}, dp {dp}; every run sees "
             f"{ref * args.steps} sequences ({ref * args.steps * args.seq_len:,} tokens); "
             "validation loss after the last step",
             f"{'run':<12} {'batch':>5} {'steps':>5} {'lr':>8} {'warm-up':>7} {'val loss':>8} "
             f"{'vs ref':>7} {'B_simple':>8}"]
    for name, batch, steps, lr, warmup, last, _ in results:
        scale = last.get("noise_scale")
        lines.append(f"{name:<12} {batch:5d} {steps:5d} {lr:8.2e} {warmup:7d} "
                     f"{last['val_loss']:8.4f} {last['val_loss'] - reference_val:+7.4f} "
                     + (f"{scale:8.1f}" if scale is not None else f"{'n/a':>8}"))
    lines.append("")
    if noise is not None:
        lines.append(f"the reference run's noise scale at its end: B_simple = {noise:.1f} "
                     f"sequences; the 4x batch is {4 * ref} sequences, so samples needed grow "
                     f"by 1 + B/B_crit = {1 + 4 * ref / noise:.2f}x against "
                     f"{1 + ref / noise:.2f}x at the reference batch")
    for name, *_, warning in results:
        lines += [f"{name}: {w}" for w in warning]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
