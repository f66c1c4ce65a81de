"""``tessera plan``: rank the parallel layouts of a model on a cluster; ``tessera plan calibrate``.

    tessera plan --model NAME|FILE --gpus N --hardware NAME|FILE --global-batch B --seq S
                 [--top K] [--explain] [--json] [--plot PNG] [--tokens T]
    tessera plan --model M --gpus N --critical-batch B|--from-run DIR --tokens T
                 [--gpu-counts ..] [--batch-per-gpu ..] [--explain] [--plot PNG] [--json]
    tessera plan ... --layout "dp=64,tp=8,pp=16,v=1,mb=1,zero=1,recompute=selective,sp"
                 [--explain]      (evaluate one layout instead of searching)
    tessera plan calibrate [--model NAME|FILE] [--ranks N] [--out FILE]
        (default runs/local_hardware.toml; runs/local_hardware_N.toml for --ranks N > 2)

Bad input (an unknown model or hardware, a request no layout can satisfy) prints one line,
``error: ...``, and exits with code 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Annotated

import typer

from tessera.config import CP_METHODS, DP_MODES
from tessera.errors import ConfigError
from tessera.planner.hardware import calibrated_path

plan_app = typer.Typer(add_completion=False, invoke_without_command=True,
                       pretty_exceptions_enable=False, rich_markup_mode=None,
                       help="Predict speed and memory of parallel layouts and pick the best.")

def _degrees(text: str | None, name: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--{name}", text, "must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--{name}", text, "must be positive integers")
    return values


def _choices(text: str, option: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """Comma-separated values of `option`, each one of `allowed`."""
    values = tuple(x.strip() for x in text.split(","))
    for value in values:
        if value not in allowed:
            raise ConfigError(option, value, f"must be one of {', '.join(allowed)}")
    return values


LAYOUT_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "v": "virtual_stages",
               "virtual": "virtual_stages", "mb": "micro_batch", "b": "micro_batch",
               "micro_batch": "micro_batch", "zero": "zero_stage", "recompute": "recompute",
               "schedule": "schedule", "sp": "sequence_parallel", "cp_method": "cp_method",
               "cp_ulysses": "cp_ulysses", "dp_mode": "dp_mode", "stages": "stage_layout",
               "stage_layout": "stage_layout", "g": "microbatch_group",
               "microbatch_group": "microbatch_group"}
INT_KEYS = ("dp", "tp", "pp", "cp", "virtual_stages", "micro_batch", "zero_stage",
            "microbatch_group", "cp_ulysses")


def _continues_stages(token: str) -> bool:
    """Whether a token after `stages=` is more of its value: the stage layouts hold commas
    ('7,8*14,7'; Megatron's cosmetic ones, 'Et*3|(tt|)*29,tL'), and no key starts with a
    digit or is spelt only in layout characters."""
    return token[:1].isdigit() or set(token) <= set("0123456789*|() ELtm")


def parse_layout(text: str, gpus: int, layers: int):
    """``--layout "dp=64,tp=8,pp=16,v=1,mb=1,zero=1,recompute=selective,sp"`` as a Layout.

    Keys: dp, tp, pp, cp, v, mb (or b), zero, recompute, schedule, sp (a flag, or sp=0/1),
    cp_method, cp_ulysses (hybrid's Ulysses degree, default 2), dp_mode, g (interleaved's
    micro-batch group, Llama 3's N; default pp), stages (blocks per chunk, '7,8*14,7',
    Megatron-LM's layout form 'Et*7|(t*8|)*14t*7L', or 'first-last-fewer'). dp defaults to
    what the GPUs leave, the schedule to interleaved when v > 1, else 1f1b."""
    from tessera.pipeline.split import first_last_fewer, parse_stage_layout
    from tessera.planner.workload import Layout

    fields: dict[str, object] = {}
    last = None
    for token in (t.strip() for t in text.split(",") if t.strip()):
        key, eq, value = token.partition("=")
        key = key.strip().lower()
        if not eq and last == "stage_layout" and _continues_stages(token):
            fields["stage_layout"] = f"{fields['stage_layout']},{token}"  # '7,8*14,7'
            continue
        if key not in LAYOUT_KEYS:
            raise ConfigError("--layout", token, f"unknown key {key!r}; known: "
                              f"{', '.join(sorted(LAYOUT_KEYS))}")
        name = LAYOUT_KEYS[key]
        last = name
        if name == "sequence_parallel":
            if eq and value.strip() not in ("0", "1", "true", "false"):
                raise ConfigError("--layout", token, "sp is a flag (sp, sp=1 or sp=0)")
            fields[name] = not eq or value.strip() in ("1", "true")
        elif name in INT_KEYS:
            try:
                fields[name] = int(value)
            except ValueError:
                raise ConfigError("--layout", token, f"{key} must be an integer") from None
        else:
            fields[name] = value.strip()
    stages = fields.pop("stage_layout", None)
    t, p, c = (int(fields.get(k, 1)) for k in ("tp", "pp", "cp"))  # type: ignore[call-overload]
    if "dp" not in fields:
        if gpus % (t * p * c):
            raise ConfigError("--layout", text, f"tp*pp*cp={t * p * c} must divide --gpus "
                              f"{gpus} (or give dp=)")
        fields["dp"] = gpus // (t * p * c)
    v = int(fields.get("virtual_stages", 1))  # type: ignore[call-overload]
    fields.setdefault("schedule", "interleaved" if v > 1 else "1f1b")
    if stages:
        fields["stage_layout"] = (first_last_fewer(layers, p * v)
                                  if stages == "first-last-fewer"
                                  else parse_stage_layout(str(stages), "--layout stages"))
    return Layout(**fields)  # type: ignore[arg-type]


@plan_app.callback()
def plan(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(
        help="Catalog model name (e.g. gpt3-175b, megatron-1t, llama3-70b, demo) or a "
             "TOML/YAML file.")] = None,
    gpus: Annotated[int | None, typer.Option(help="Number of GPUs (devices).")] = None,
    hardware: Annotated[str, typer.Option(
        help="Catalog hardware (V100, A100-40GB, A100-80GB, H100-SXM, H200) or a file "
             "written by `tessera plan calibrate`.")] = "A100-80GB",
    global_batch: Annotated[int | None, typer.Option(help="Sequences per optimizer step.")
                            ] = None,
    seq: Annotated[int | None, typer.Option(help="Sequence length (default: the model's).")
                   ] = None,
    top: Annotated[int, typer.Option(help="Layouts to show.")] = 10,
    explain: Annotated[bool, typer.Option(
        "--explain", help="Break the best layout's step and memory down and compare it with "
                          "the runner-up.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    plot: Annotated[str | None, typer.Option(
        help="Write a PNG of predicted throughput against each degree.")] = None,
    tokens: Annotated[float | None, typer.Option(
        help="Training tokens, for the days-to-train column.")] = None,
    precision: Annotated[str, typer.Option(
        help="Model-state recipe: bf16 (bf16 params, fp32 master + Adam: 16 B/param), "
             "bf16-fp32grads (and fp32 gradients: 18 B, Megatron-LM's default), bf16-states "
             "(bf16 Adam moments: 12 B), fp32 (16 B).")] = "bf16",
    kernels: Annotated[str, typer.Option(
        help="Kernels of Llama-form models: tessera (its reference block, eager), fused "
             "(Megatron-LM / Llama 3 kernels, Korthikanti et al. 2022) or compiled (tessera's "
             "block under torch.compile: fused memory-bound runs, fewer launches).")
    ] = "tessera",
    layout: Annotated[str | None, typer.Option(
        help="Evaluate this one layout instead of searching, e.g. "
             "'dp=64,tp=8,pp=16,v=1,mb=1,zero=1,recompute=selective,sp' (also cp, "
             "cp_method, cp_ulysses, schedule, stages=7,8*14,7 or "
             "stages=first-last-fewer).")] = None,
    flash_attention: Annotated[bool, typer.Option(
        "--flash-attention/--no-flash-attention",
        help="Attention without stored s x s scores.")] = True,
    tp: Annotated[str | None, typer.Option(help="Only these TP degrees (e.g. 1,2,4,8).")
                  ] = None,
    pp: Annotated[str | None, typer.Option(help="Only these PP degrees.")] = None,
    dp: Annotated[str | None, typer.Option(help="Only these DP degrees.")] = None,
    cp: Annotated[str, typer.Option(help="Context-parallel degrees to consider.")] = "1",
    cp_method: Annotated[str, typer.Option(
        help="Context-parallel attention methods to consider where cp > 1: ring, allgather, "
             "ulysses, hybrid (comma-separated).")] = "ring",
    cp_ulysses: Annotated[str | None, typer.Option(
        help="Ulysses degrees to consider for --cp-method hybrid (default: every divisor of "
             "cp the layout rules allow).")] = None,
    dp_mode: Annotated[str, typer.Option(
        help="Data-parallel modes to consider: allreduce, ps, ps-async (comma-separated; the "
             "parameter server needs fp32 and pure data parallelism).")] = "allreduce",
    reserve_gb: Annotated[float, typer.Option(
        help="Memory per GPU kept free for the framework.")] = 0.0,
    critical_batch: Annotated[float | None, typer.Option(
        help="Critical batch B_crit in sequences: plan the time/cost frontier over GPU "
             "counts and batches (needs --tokens; --gpus is the largest count).")] = None,
    from_run: Annotated[str | None, typer.Option(
        help="Like --critical-batch, with the noise scale a run measured (its last "
             "noise_scale in metrics.jsonl) and its train.lr_scaling.")] = None,
    gpu_counts: Annotated[str | None, typer.Option(
        help="Critical-batch plan: GPU counts (default: powers of two up to --gpus).")] = None,
    batch_per_gpu: Annotated[str | None, typer.Option(
        help="Critical-batch plan: sequences per GPU (default 0.125,...,8).")] = None,
    lr_scaling: Annotated[str | None, typer.Option(
        help="Critical-batch plan: the train.lr_scaling rule (none, linear, sqrt).")] = None,
    reference_batch: Annotated[int | None, typer.Option(
        help="Critical-batch plan: train.reference_batch of the lr rule.")] = None,
) -> None:
    """Rank the layouts of --model on --gpus x --hardware by predicted step time."""
    if ctx.invoked_subcommand is not None:
        return
    from tessera.planner.estimate import estimate
    from tessera.planner.hardware import load_hardware
    from tessera.planner.models import load_model
    from tessera.planner.moe import active_layouts, ep_table, moe_for_model
    from tessera.planner.report import describe_workload, table, to_json
    from tessera.planner.report import explain as explain_plan
    from tessera.planner.report import plot as plot_plan
    from tessera.planner.search import Plan, SearchSpace, search
    from tessera.planner.workload import Workload

    if critical_batch is not None or from_run is not None:
        from tessera.planner.critical_batch_report import run_critical_batch

        for name, value in (("--layout", layout), ("--global-batch", global_batch)):
            if value is not None:
                raise ConfigError(name, value, "does not combine with --critical-batch or "
                                  "--from-run, which try every layout and batch "
                                  "(--batch-per-gpu)")

        return run_critical_batch(
            model=model, gpus=gpus, hardware=hardware, seq=seq, tokens=tokens,
            critical_batch=critical_batch, from_run=from_run, gpu_counts=gpu_counts,
            batch_per_gpu=batch_per_gpu, lr_scaling=lr_scaling, reference_batch=reference_batch,
            precision=precision, kernels=kernels, flash_attention=flash_attention,
            reserve_gb=reserve_gb, tp=_degrees(tp, "tp"), pp=_degrees(pp, "pp"),
            in_words=explain, as_json=as_json, plot_path=plot)
    for name, value in (("--model", model), ("--gpus", gpus),
                        ("--global-batch", global_batch)):
        if value is None:
            raise ConfigError(name, None, "is required")
    if top < 1:
        raise ConfigError("--top", top, "must be a positive integer")
    spec = load_model(model)
    hw = load_hardware(hardware)
    w = Workload(model=spec, hardware=hw, gpus=gpus, global_batch=global_batch,
                 seq_len=seq or spec.max_seq_len, precision=precision,
                 flash_attention=flash_attention, reserve_gb=reserve_gb, kernels=kernels)
    if layout is not None:
        if plot:
            raise ConfigError("--plot", plot, "needs a search, not one --layout")
        t0 = time.perf_counter()
        est = estimate(w, parse_layout(layout, w.gpus, spec.layers))
        result = Plan(workload=w, ranked=[est], considered=1, simulated=1,
                      fitting=int(est.headroom >= 0), seconds=time.perf_counter() - t0)
    else:
        space = SearchSpace(tp=_degrees(tp, "tp"), pp=_degrees(pp, "pp"),
                            dp=_degrees(dp, "dp"), cp=_degrees(cp, "cp"),
                            dp_mode=_choices(dp_mode, "--dp-mode", DP_MODES),
                            cp_method=_choices(cp_method, "--cp-method", CP_METHODS),
                            cp_ulysses=_degrees(cp_ulysses, "cp-ulysses"))
        moe = moe_for_model(model)
        if moe is not None:  # rank the active model's layouts with ep (tessera.planner.moe)
            print(ep_table(w, moe, active_layouts(w, moe, space, max(top, 30)), top))
            return
        result = search(w, space, top=max(top, 30) if plot else top)
    shown = result.ranked[:top]
    if plot:
        path = plot_plan(result, plot)
    result.ranked = shown
    if as_json:
        out = to_json(result, tokens, explain_best=explain)
        if plot:
            out["plot"] = str(path)
        print(json.dumps(out, indent=1))
        return
    print(describe_workload(result))
    if layout is not None:
        best = result.best
        fits = "fits" if best.headroom >= 0 else "does NOT fit"
        print(f"one layout evaluated: {best.layout.describe()} ({fits} in "
              f"{w.hardware.memory_gb:g} GB)\n")
    else:
        print(f"{result.considered} layouts considered, {result.fitting} fit in memory, "
              f"{result.simulated} simulated, {result.seconds:.2f} s\n")
    print(table(result, tokens))
    if explain:
        print()
        print(explain_plan(result))
    if plot:
        print(f"\nplot: {path}")


def calibration_target(device: str | None, backend: str | None) -> tuple[str, str]:
    """(device, backend) to calibrate: what `tessera train` would use here unless given."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError("--device", device, "must be cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", device, "no CUDA device on this machine")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ConfigError("--backend", backend, "must be gloo or nccl")
    if backend == "nccl" and device != "cuda":
        raise ConfigError("--backend", backend, f"NCCL needs --device cuda, not {device}")
    return device, backend


@plan_app.command("calibrate")
def calibrate_cmd(
    model: Annotated[str, typer.Option(
        help="Model whose shapes the matrix multiplies are timed at.")] = "demo",
    seq: Annotated[int | None, typer.Option(help="Sequence length (default: the model's).")
                   ] = None,
    micro_batch: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 16,
    out: Annotated[str | None, typer.Option(
        help="Hardware file to write (TOML); default runs/local_hardware.toml for 2 ranks, "
             "runs/local_hardware_N.toml for N (git ignores runs/; a training run on N CPU "
             "ranks reads it).")] = None,
    ranks: Annotated[int, typer.Option(help="Ranks for the collective measurement.")] = 2,
    device: Annotated[str | None, typer.Option(
        help="cpu or cuda: where to measure; default cuda if this machine has a GPU.")] = None,
    backend: Annotated[str | None, typer.Option(
        help="gloo or nccl: the collectives' backend; default nccl on cuda, else gloo.")] = None,
) -> None:
    """Measure this machine (matmul and attention rates at the model's shapes, memory
    bandwidth, per-kernel overhead, collective alpha and beta over gloo) and write a hardware
    file for --hardware."""
    from tessera.planner.hardware import save_hardware
    from tessera.planner.local.calibrate import calibrate
    from tessera.planner.models import load_model

    spec = load_model(model)
    if micro_batch < 1 or ranks < 2:
        raise ConfigError("--micro-batch" if micro_batch < 1 else "--ranks",
                          micro_batch if micro_batch < 1 else ranks,
                          "must be >= 1 (ranks >= 2)")
    device, backend = calibration_target(device, backend)
    hw = calibrate(spec, seq or spec.max_seq_len, micro_batch, ranks=ranks, device=device,
                   backend=backend)
    path = save_hardware(hw, out or calibrated_path(ranks))
    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        print(f"warning: the 1-minute load average is {os.getloadavg()[0]:.1f} on {cores} "
              f"cores: other jobs slowed the measurement; calibrate on an idle machine",
              file=sys.stderr)
    for key, value in hw.to_dict().items():
        print(f"{key:>22} = {value}")
    print(f"wrote {path}")
