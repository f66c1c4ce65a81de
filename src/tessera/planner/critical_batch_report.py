"""What ``tessera plan --critical-batch`` prints: each family's time/cost frontier as a table,
the trade-off in words, JSON, and the frontier drawn as time against cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.pipeline.timeline import save_figure
from tessera.planner.critical_batch import FAMILIES, ZERO_BUBBLE, CriticalBatchPlan, Point
from tessera.planner.report import human_count

HEAD = (f"{'family':<22} {'GPUs':>5} {'batch':>6} {'β':>6} {'MFU':>6} {'step s':>8} "
        f"{'samples':>9} {'steps':>8} {'days':>8} {'GPU-hours':>10} {'lr x':>6}  layout")


def describe(plan: CriticalBatchPlan) -> str:
    w = plan.workload
    return (f"{w.model.name} ({human_count(w.model.param_count)} parameters) on "
            f"{w.hardware.name}, sequence {w.seq_len}, {human_count(plan.tokens)} tokens at "
            f"small batch, critical batch {plan.b_crit:.4g} sequences\n"
            f"samples needed = T/s x (1 + B/B_crit); cost = GPU-hours; no pipeline counts as "
            f"1F1B; zero-bubble = the best of {', '.join(ZERO_BUBBLE)}, without ZeRO-3; a row "
            f"is on its family's time/cost frontier (* : on the frontier of all families)")


def _row(plan: CriticalBatchPlan, p: Point, overall: set[int]) -> str:
    mark = "*" if id(p) in overall else " "
    return (f"{mark}{p.family:<21} {p.gpus:>5} {p.batch:>6} {p.beta:>6.3g} "
            f"{100 * p.mfu:>5.1f}% {p.best.step_time:>8.4g} {human_count(p.samples):>9} "
            f"{p.steps:>8.4g} {p.hours / 24:>8.3g} {p.gpu_hours:>10.4g} "
            f"{plan.lr_scale(p.batch):>6.3g}  {p.best.layout.describe()}")


def table(plan: CriticalBatchPlan) -> str:
    """Each family's frontier, fastest first; families with no fitting layout are named."""
    overall = {id(p) for p in plan.frontier()}
    lines = [HEAD]
    for name in FAMILIES:
        rows = plan.frontier(name)
        if not rows:
            lines.append(f" {name:<21} (no layout of this family fits at any grid point)")
            continue
        lines.extend(_row(plan, p, overall) for p in rows)
    return "\n".join(lines)


def explain(plan: CriticalBatchPlan) -> str:
    """The trade-off in words: the cheapest and the fastest plan, what separates them, and
    what the learning-rate rule assumes."""
    cheap, fast = plan.cheapest(), plan.fastest()
    bc = plan.b_crit
    lines = [
        f"Cost (GPU-hours) grows as (1 + B/B_crit) / MFU and time as cost / N: below the "
        f"critical batch ({bc:.4g} sequences) a larger batch adds few samples, so more GPUs "
        f"buy time almost for free; above it every doubling of the batch nearly doubles the "
        f"samples, so they buy time at a rising price.",
        f"Cheapest: {cheap.gpus} GPUs at batch {cheap.batch} ({cheap.family}, MFU "
        f"{100 * cheap.mfu:.1f}%): {cheap.gpu_hours:.4g} GPU-hours in {cheap.hours / 24:.3g} "
        f"days.",
        f"Fastest: {fast.gpus} GPUs at batch {fast.batch} ({fast.family}, MFU "
        f"{100 * fast.mfu:.1f}%): {fast.hours / 24:.3g} days for {fast.gpu_hours:.4g} "
        f"GPU-hours ({fast.gpu_hours / cheap.gpu_hours:.3g}x the cheapest's cost, "
        f"{cheap.hours / fast.hours:.3g}x faster).",
    ]
    lines.append(f"Zero-bubble ({', '.join(ZERO_BUBBLE)}) is priced without ZeRO-3 only: "
                 f"tessera refuses ZeRO-3 with a schedule that splits its backward into I and "
                 f"W (every unit would stay gathered from I to W).")
    small = [p for p in plan.frontier() if p.beta <= 1]
    if small:
        fam = {p.family for p in small}
        lines.append(f"At a batch per GPU of at most 1 the frontier is held by "
                     f"{', '.join(sorted(fam))}: small batches per GPU keep B below B_crit, "
                     f"and the schedule that loses least utilization there wins.")
    rule = plan.lr_scaling
    if rule == "none":
        lines.append("Learning rate: the samples model assumes a rate suited to each batch; "
                     "with train.lr_scaling none the rate stays fixed, so batches above the "
                     "one it was tuned at need more samples than shown (set --lr-scaling).")
    else:
        lines.append(f"Learning rate: train.lr_scaling {rule} against reference batch "
                     f"{plan.reference_batch} (the 'lr x' column); the samples model takes "
                     f"that rule to keep each batch near its best rate, which linear scaling "
                     f"does up to about B_crit (Goyal et al. 2017; McCandlish et al. 2018).")
    if max(p.batch for p in plan.frontier()) > bc:
        lines.append(f"warning: frontier plans above the critical batch ({bc:.4g}) need more "
                     f"samples than S_min, and the learning rate cannot buy them back.")
    return "\n".join(lines)


def to_json(plan: CriticalBatchPlan) -> dict[str, Any]:
    overall = {id(p) for p in plan.frontier()}

    def one(p: Point) -> dict[str, Any]:
        return {"family": p.family, "gpus": p.gpus, "global_batch": p.batch,
                "batch_per_gpu": p.beta, "mfu": p.mfu, "step_time_s": p.best.step_time,
                "samples": p.samples, "steps": p.steps, "hours": p.hours,
                "gpu_hours": p.gpu_hours, "lr_scale": plan.lr_scale(p.batch),
                "layout": p.best.layout.describe(), "overall_frontier": id(p) in overall}

    w = plan.workload
    return {"model": w.model.name, "hardware": w.hardware.name, "seq_len": w.seq_len,
            "critical_batch": plan.b_crit, "tokens": plan.tokens,
            "lr_scaling": plan.lr_scaling, "reference_batch": plan.reference_batch,
            "frontier": {name: [one(p) for p in plan.frontier(name)] for name in FAMILIES},
            "points": [one(p) for p in plan.points], "skipped": plan.skipped}


STYLE = {"1F1B": ("tab:blue", "o", "-"), "1F1B + ZeRO-3": ("tab:blue", "o", "--"),
         "interleaved": ("tab:orange", "s", "-"), "interleaved + ZeRO-3": ("tab:orange", "s", "--"),
         "breadth-first": ("tab:green", "^", "-"),
         "breadth-first + ZeRO-3": ("tab:green", "^", "--"),
         "zero-bubble": ("tab:red", "D", "-")}


def plot(plan: CriticalBatchPlan, path: str | Path) -> Path:
    """Training time against cost (GPU-hours), log-log, each family's frontier a line and every
    grid point a faint dot; frontier points labelled with their GPU count and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    for name in FAMILIES:
        color, marker, line = STYLE[name]
        mine = [p for p in plan.points if p.family == name]
        if not mine:
            continue
        ax.scatter([p.gpu_hours for p in mine], [p.hours / 24 for p in mine], s=10,
                   color=color, alpha=0.25, marker=marker)
        rows = plan.frontier(name)
        ax.plot([p.gpu_hours for p in rows], [p.hours / 24 for p in rows], line,
                marker=marker, color=color, label=name, ms=5)
    for p in plan.frontier():
        ax.annotate(f"N={p.gpus}, B={p.batch}", (p.gpu_hours, p.hours / 24), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cost (GPU-hours)")
    ax.set_ylabel("training time (days)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(describe(plan).splitlines()[0],
                 fontsize=7)
    return save_figure(fig, path)


def run_critical_batch(*, model: str | None, gpus: int | None, hardware: str, seq: int | None,
                       tokens: float | None, critical_batch: float | None, from_run: str | None,
                       gpu_counts: str | None, batch_per_gpu: str | None,
                       lr_scaling: str | None, reference_batch: int | None, precision: str,
                       kernels: str, flash_attention: bool, reserve_gb: float,
                       tp: tuple[int, ...] | None, pp: tuple[int, ...] | None, in_words: bool,
                       as_json: bool, plot_path: str | None) -> None:
    """``tessera plan --critical-batch B | --from-run DIR --tokens T``: print the frontier."""
    import json

    from tessera.config import LR_SCALINGS
    from tessera.errors import ConfigError
    from tessera.planner.critical_batch import (
        DEFAULT_BETAS,
        noise_scale_from_run,
        plan_critical_batch,
    )
    from tessera.planner.hardware import load_hardware
    from tessera.planner.models import load_model
    from tessera.planner.search import SearchSpace
    from tessera.planner.workload import Workload

    if critical_batch is not None and from_run is not None:
        raise ConfigError("--from-run", from_run, "give either it or --critical-batch")
    for name, value in (("--model", model), ("--gpus", gpus), ("--tokens", tokens)):
        if value is None:
            raise ConfigError(name, None, "is required with --critical-batch or --from-run")
    spec = load_model(model)
    seq_len = seq or spec.max_seq_len
    train: dict = {}
    source = ""
    if from_run is not None:
        critical_batch, source, train = noise_scale_from_run(from_run, seq_len)
    rule = lr_scaling or train.get("lr_scaling", "none")
    if rule not in LR_SCALINGS:
        raise ConfigError("--lr-scaling", rule, f"must be one of {', '.join(LR_SCALINGS)}")
    reference = reference_batch if reference_batch is not None else int(
        train.get("reference_batch", 0) or 0)
    if reference < 0:
        raise ConfigError("--reference-batch", reference, "must be >= 0")
    assert critical_batch is not None and gpus is not None and tokens is not None
    w = Workload(model=spec, hardware=load_hardware(hardware), gpus=gpus, global_batch=1,
                 seq_len=seq_len, precision=precision,
                 flash_attention=flash_attention, reserve_gb=reserve_gb, kernels=kernels)
    counts = _numbers(gpu_counts, "--gpu-counts", int) if gpu_counts else None
    betas = _numbers(batch_per_gpu, "--batch-per-gpu", float) if batch_per_gpu else DEFAULT_BETAS
    plan = plan_critical_batch(w, critical_batch, tokens, counts, betas,
                               SearchSpace(tp=tp, pp=pp), lr_scaling=rule,
                               reference_batch=reference)
    path = plot(plan, plot_path) if plot_path else None
    if as_json:
        out = to_json(plan)
        if in_words:
            out["explain"] = explain(plan)
        if path:
            out["plot"] = str(path)
        print(json.dumps(out, indent=1))
        return
    print(describe(plan))
    if source:
        print(f"critical batch from the {source}")
    print()
    print(table(plan))
    for line in plan.skipped:
        print(f"  skipped: {line}")
    if in_words:
        print()
        print(explain(plan))
    if path:
        print(f"\nplot: {path}")


def _numbers(text: str, name: str, kind: type) -> list:
    from tessera.errors import ConfigError

    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(name, text, "must be comma-separated numbers") from None
    if not values or min(values) <= 0:
        raise ConfigError(name, text, "must be positive")
    return values
