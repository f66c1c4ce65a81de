"""What the planner prints: the ranked table, the explanation of the best layout, JSON, a plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tessera.pipeline.timeline import save_figure
from tessera.planner.estimate import Estimate, gather_waits_exposed, pipeline_comm_exposed
from tessera.planner.search import Plan
from tessera.planner.workload import GB, stage_layout_text

AXES = (("dp", "data parallel"), ("tp", "tensor parallel"), ("pp", "pipeline parallel"),
        ("cp", "context parallel"), ("virtual_stages", "virtual stages"),
        ("micro_batch", "micro-batch size"), ("zero_stage", "ZeRO stage"))


def human_count(n: float) -> str:
    """1_235_000_000 -> '1.24B', 123_600_000 -> '124M', 52_300 -> '52.3K', 912 -> '912'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


RECIPES = {
    "bf16": "bf16 params and grads, fp32 master + Adam m, v: 16 B/param",
    "bf16-fp32grads": "bf16 params, fp32 grads, fp32 master + Adam m, v: 18 B/param",
    "bf16-states": "bf16 params and grads, fp32 master, bf16 Adam m, v: 12 B/param",
    "fp32": "fp32 params, grads, Adam m, v: 16 B/param",
}
FLOPS_NOTE = ("MFU counts attention's s² products in full (Megatron-LM); MFU-c counts the "
              "causal half (Llama 3)")


def describe_workload(plan: Plan) -> str:
    w = plan.workload
    kernels = ", fused-kernel activations" if w.kernels == "fused" else ""
    return (f"{w.model.name} ({human_count(w.model.param_count)} parameters) on {w.gpus} x "
            f"{w.hardware.name}, global batch {w.global_batch} x {w.seq_len} tokens, "
            f"{w.precision} ({RECIPES[w.precision]}){kernels}\n{FLOPS_NOTE}")


def table(plan: Plan, tokens: float | None = None) -> str:
    """The ranked layouts as a fixed-width table."""
    head = (f"{'#':>2} {'dp':>4} {'tp':>3} {'pp':>3} {'cp':>3} {'schedule':>19} {'b':>3} "
            f"{'m':>5} {'zero':>4} {'recomp':>9} {'sp':>3} {'step s':>9} {'tokens/s':>10} "
            f"{'HW TF/s':>8} {'MFU':>6} {'MFU-c':>6} {'mem GB':>7} {'free GB':>7}")
    if tokens:
        head += f" {'days':>7}"
    lines = [head]
    for i, e in enumerate(plan.ranked, 1):
        L = e.layout
        sched = ("-" if L.pp == L.virtual_stages == 1 else
                 L.schedule + (f" v{L.virtual_stages}" if L.virtual_stages > 1 else ""))
        if L.dp_mode != "allreduce":
            sched = f"{L.dp_mode} {sched}" if sched != "-" else L.dp_mode
        if L.cp > 1:  # the context-parallel method shares the schedule's column
            method = L.cp_method + (f" u{L.cp_ulysses}" if L.cp_method == "hybrid" else "")
            sched = f"{method} {sched}" if sched != "-" else method
        line = (f"{i:>2} {L.dp:>4} {L.tp:>3} {L.pp:>3} {L.cp:>3} {sched:>19} "
                f"{L.micro_batch:>3} {e.m:>5} {L.zero_stage:>4} {L.recompute:>9} "
                f"{'y' if L.sequence_parallel else '-':>3} {_num(e.step_time):>9} "
                f"{_num(e.tokens_per_s):>10} {e.tflops_per_gpu:>8.4g} {100 * e.mfu:>5.1f}% "
                f"{100 * e.mfu_causal:>5.1f}% {e.memory.total / GB:>7.1f} "
                f"{e.headroom / GB:>7.1f}")
        if tokens:
            line += f" {e.days(tokens):>7.1f}"
        lines.append(line)
    return "\n".join(lines)


def _model_tflops(e: Estimate) -> float:
    return e.mfu * e.workload.hardware.peak_tflops


def _num(x: float) -> str:
    return f"{x:.4g}" if x < 1e5 else f"{x:.3e}"


def breakdown(e: Estimate) -> dict[str, float]:
    """The step split into causes that sum to the step time (PP comm from two simulations)."""
    b = e.breakdown()
    pp = pipeline_comm_exposed(e) if e.layout.pp > 1 else 0.0
    gathers = min(gather_waits_exposed(e), max(0.0, b["bubble"] - pp))
    return {
        "compute": b["compute"], "recompute": b["recompute"],
        "bubble": b["bubble"] - pp - gathers,
        "tp_comm": b["tp_comm"], "cp_comm": b["cp_comm"], "pp_comm": pp + b["pp_sync"],
        "dp_comm": b["dp_exposed"] + gathers, "optimizer": b["optimizer"],
        "time_sharing": b["time_sharing"],
        "tp_hidden": b["tp_hidden"], "cp_hidden": b["cp_hidden"], "dp_hidden": b["dp_hidden"],
    }


LABELS = {"compute": "compute", "recompute": "recomputation", "bubble": "pipeline bubble",
          "tp_comm": "TP communication", "cp_comm": "CP communication",
          "pp_comm": "PP communication", "dp_comm": "DP communication",
          "optimizer": "optimizer step", "time_sharing": "CPU time-sharing"}


def explain(plan: Plan) -> str:
    """Why the best layout is best: its step and memory by category, and the runner-up."""
    best = plan.best
    parts = breakdown(best)
    w = plan.workload
    title = "Best layout" if len(plan.ranked) > 1 or plan.considered > 1 else "Layout"
    lines = [f"{title}: {best.layout.describe()} (m={best.m} micro-batches per step)",
             f"  step {best.step_time:.4g} s on the busiest pipeline rank:"]
    for key, label in LABELS.items():
        value = parts[key]
        if key == "time_sharing" and value <= 1e-9 * best.step_time:  # float rounding
            continue
        hidden = parts.get(key.replace("_comm", "_hidden")) if key.endswith("_comm") else None
        extra = f"   (exposed; {hidden:.4g} s hidden behind compute)" if hidden else ""
        lines.append(f"    {label:<20} {value:>10.4g} s {100 * value / best.step_time:>6.1f}%"
                     f"{extra}")
    mem = best.memory
    where = "" if best.layout.pp == 1 else f" (pipeline rank {mem.rank}, the fullest)"
    lines.append(f"  memory per GPU{where}:")
    held = best.inflight[mem.rank]
    for key, label in (("params", "parameters"), ("grads", "gradients"),
                       ("optimizer", "optimizer state"),
                       ("activations", f"activations ({held} in flight)"),
                       ("transient", "transient")):
        lines.append(f"    {label:<26} {getattr(mem, key) / GB:>8.2f} GB")
    lines.append(f"    {'total':<26} {mem.total / GB:>8.2f} GB of {w.hardware.memory_gb:g} GB "
                 f"({best.headroom / GB:.1f} GB free)")
    lines.append(f"  throughput: {best.tokens_per_s:.4g} tokens/s, {best.tflops_per_gpu:.4g} "
                 f"hardware TFLOP/s per GPU (with recomputation, full attention), HFU "
                 f"{100 * best.hfu:.1f}%")
    lines.append(f"  model FLOPs: {best.model_tflops_per_gpu('full'):.4g} TFLOP/s per GPU, MFU "
                 f"{100 * best.mfu:.1f}% counting attention's s² in full (Megatron-LM); "
                 f"{best.model_tflops_per_gpu('causal'):.4g} TFLOP/s, MFU "
                 f"{100 * best.mfu_causal:.1f}% counting the causal half (Llama 3)")
    lines.append(f"  model state: {RECIPES[w.precision]}")
    if best.layout.stage_layout:
        lines.append(f"  stages: {stage_layout_text(best.layout.stage_layout)} blocks per "
                     "chunk")
    runner = runner_up(plan)
    if runner is not None:
        lines.append("  " + why_better(best, runner, parts))
    return "\n".join(lines)


def runner_up(plan: Plan) -> Estimate | None:
    return plan.ranked[1] if len(plan.ranked) > 1 else None


def why_better(best: Estimate, runner: Estimate, best_parts: dict[str, float] | None = None
               ) -> str:
    """One sentence: where the step-time difference to the runner-up comes from."""
    a = best_parts or breakdown(best)
    b = breakdown(runner)
    gap = runner.step_time - best.step_time
    name = runner.layout.describe()
    if gap <= 1e-9 * best.step_time:
        return (f"It ties with the runner-up ({name}) on step time and needs "
                f"{best.memory.total / GB:.1f} GB instead of {runner.memory.total / GB:.1f} GB.")
    diffs = {k: b[k] - a[k] for k in LABELS}
    main = max(diffs, key=lambda k: diffs[k])
    offset = min(diffs, key=lambda k: diffs[k])
    text = (f"It beats the runner-up ({name}) by {100 * gap / runner.step_time:.1f}% "
            f"({gap:.3g} s per step), mostly through less {LABELS[main]} "
            f"({a[main]:.3g} s vs {b[main]:.3g} s)")
    if diffs[offset] < -0.05 * gap:
        text += f", despite more {LABELS[offset]} ({a[offset]:.3g} s vs {b[offset]:.3g} s)"
    return text + "."


def to_json(plan: Plan, tokens: float | None = None, explain_best: bool = False
            ) -> dict[str, Any]:
    w = plan.workload
    out: dict[str, Any] = {
        "model": w.model.name, "parameters": w.model.param_count, "hardware": w.hardware.name,
        "gpus": w.gpus, "global_batch": w.global_batch, "seq_len": w.seq_len,
        "precision": w.precision, "model_state": RECIPES[w.precision],
        "flops_conventions": FLOPS_NOTE, "considered": plan.considered, "fitting": plan.fitting,
        "simulated": plan.simulated, "search_seconds": plan.seconds,
        "layouts": [_clean(e.row(tokens)) for e in plan.ranked],
    }
    if explain_best:
        out["best_breakdown_s"] = breakdown(plan.best)
        out["best_memory_gb"] = {k: v / GB for k, v in plan.best.memory.as_dict().items()}
        runner = runner_up(plan)
        if runner is not None:
            out["why"] = why_better(plan.best, runner)
    return out


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


def plot(plan: Plan, path: str | Path) -> Path:
    """Predicted model TFLOP/s per GPU (MFU x peak: recomputation not counted, so higher is
    always faster) of the ranked layouts against each parallel degree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_used = [(k, label) for k, label in AXES
                 if len({getattr(e.layout, k) for e in plan.ranked}) > 1] or list(AXES[:3])
    cols = min(3, len(axes_used))
    rows = math.ceil(len(axes_used) / cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    best = plan.best
    for ax, (key, label) in zip(grid.flat, axes_used, strict=False):
        xs = [getattr(e.layout, key) for e in plan.ranked]
        ys = [_model_tflops(e) for e in plan.ranked]
        ax.scatter(xs, ys, s=18, alpha=0.6, color="tab:blue", label="top layouts")
        top: dict[int, float] = {}
        for x, y in zip(xs, ys, strict=True):
            top[x] = max(top.get(x, 0.0), y)
        keys = sorted(top)
        ax.plot(keys, [top[k] for k in keys], color="tab:blue", lw=1)
        ax.scatter([getattr(best.layout, key)], [_model_tflops(best)], s=70, marker="*",
                   color="tab:red", zorder=3, label="best")
        if key != "zero_stage" and max(keys) > 2 * max(1, min(keys)):
            ax.set_xscale("log", base=2)
        ax.set_xticks(keys)
        ax.set_xticklabels([str(k) for k in keys])
        ax.set_xlabel(label)
        ax.set_ylabel("model TFLOP/s per GPU")
        ax.grid(alpha=0.3)
    for ax in list(grid.flat)[len(axes_used):]:
        ax.axis("off")
    grid.flat[0].legend(fontsize=8)
    fig.suptitle(f"Predicted throughput of the top {len(plan.ranked)} layouts\n"
                 f"{describe_workload(plan)}", fontsize=9)
    return save_figure(fig, path)
