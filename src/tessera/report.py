"""The one-screen summary a training run ends with, and the console line of a step.

What it shows, and where each number comes from:

- the layout (``Topology.describe``-style degrees, schedule, ZeRO stage, precision);
- tokens/s and model FLOP/s from the median step (after warm-up), MFU when the peak is known;
- the planner's predicted step time for this very layout (``tessera.planner``: on a GPU the
  catalog entry of that GPU; on CPU the file ``tessera plan calibrate`` writes,
  ``runs/local_hardware.toml``, or where this machine has none, the calibration shipped in
  ``benchmarks/results/local_hardware.toml``, said so) beside the measured median, with a note
  when other work loaded the host (:func:`host_load_note`: the prediction prices an idle one);
- the pipeline bubble measured on the last step's timestamps beside the closed form
  (p−1)/(v·m) of the schedule;
- memory per rank by category: parameters, gradients and optimizer state counted from the
  tensors each rank holds, and the peak of activations saved for backward, counted by the
  runtime on the last step;
- where the timeline picture was written;
- for a mixture of experts, the run's tokens per expert (summed over MoE layers), the busiest
  expert's load over the mean and the share of assignments dropped by capacity.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import Config

SHIPPED_HARDWARE = Path("benchmarks/results/local_hardware.toml")
"""The CPU calibration in the repository (benchmarks/results: the machine the benchmarks ran
on), used where this machine has none of its own."""
MIB = 2**20


def cpu_calibrations(world: int) -> list[tuple[Path, int, bool]]:
    """The CPU hardware files a run on `world` ranks may be priced with, best first, as (path,
    ranks it was measured with, shipped): this machine's calibrations, at the run's rank count
    (``tessera plan calibrate --ranks N`` writes it) and then at two (calibrate measures at
    least 2), before the repository's, in the same order: the machine's own compute rates and
    cores matter more than the rank count the collectives were timed at."""
    from tessera.planner.hardware import CALIBRATED, calibrated_path

    ranks = max(2, world)
    out = [(calibrated_path(ranks), ranks, False), (CALIBRATED, 2, False),
           (calibrated_path(ranks, SHIPPED_HARDWARE), ranks, True),
           (SHIPPED_HARDWARE, 2, True)]
    return list({path: (path, n, shipped) for path, n, shipped in out}.values())


def calibrate_command(world: int, micro_batch: int | None = None) -> str:
    """The command that measures this machine for a run on `world` CPU ranks (at
    `micro_batch`, where given)."""
    return ("`tessera plan calibrate" + (f" --micro-batch {micro_batch}" if micro_batch else "")
            + (f" --ranks {world}" if world > 2 else "") + "`")


def cpu_hardware(world: int) -> tuple[str, str] | None:
    """(file, label) of the CPU hardware a run on `world` ranks is priced with (the first of
    :func:`cpu_calibrations` that exists); the label says when the file is the repository's
    or was measured with another rank count, and which command measures the right one."""
    for path, ranks, shipped in cpu_calibrations(world):
        if not path.is_file():
            continue
        ask = calibrate_command(world)
        if shipped:
            return str(path), f"{path}, the repository's: {ask} measures this machine"
        if ranks != max(2, world):
            return str(path), (f"{path}, measured with {ranks} ranks: {ask} measures this "
                               f"machine with {world}")
        return str(path), str(path)
    return None


def hardware_for(device: torch.device, world: int = 2) -> str | None:
    """The planner's hardware for a run on `world` ranks of `device`: the catalog GPU whose
    name the device's contains (longest match); on CPU this machine's calibration at the run's
    rank count, else the nearest (:func:`cpu_hardware`); None if none applies."""
    if device.type == "cuda":
        from tessera.planner.hardware import known_hardware

        name = torch.cuda.get_device_name(device).lower()
        matches = [k for k in known_hardware() if k.split("-")[0].lower() in name]
        return max(matches, key=len) if matches else None
    found = cpu_hardware(world)
    return found[0] if found else None


def planner_workload(cfg: Config, world: int, hardware):
    """The planner's (Workload, Layout) for cfg's run on `world` ranks of `hardware` (a
    catalog name, a file, or a Hardware): ``Workload.from_config`` and ``engine.layout_of``,
    the planner's one conversion of a tessera Config."""
    from tessera.planner.engine import layout_of
    from tessera.planner.hardware import Hardware, load_hardware
    from tessera.planner.workload import Workload

    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    return Workload.from_config(cfg, hw, name="run", gpus=world), layout_of(cfg)


def planner_prediction(cfg: Config, world: int, device: torch.device
                       ) -> tuple[float | None, str]:
    """The planner's step time for cfg's layout (seconds) and which hardware it assumed;
    None with the reason when it cannot predict."""
    if device.type == "cuda":
        hardware = hardware_for(device, world)
        if hardware is None:
            return None, "GPU not in the planner's catalog"
        label = hardware
    else:
        found = cpu_hardware(world)
        if found is None:
            return None, f"no hardware description (run {calibrate_command(world)})"
        hardware, label = found
    if cfg.train.compile:
        label += "; compiled kernels"
    try:
        from tessera.planner.estimate import estimate
        from tessera.planner.local.terms import local_terms

        w, layout = planner_workload(cfg, world, hardware)
        calibrated_at, micro_batch = (local_terms(w.hardware).calibrated_micro_batch,
                                      cfg.train.micro_batch_size)
        if calibrated_at and calibrated_at != micro_batch:
            label += (f"; calibrated at micro-batch {calibrated_at}, this run's is "
                      f"{micro_batch}: {calibrate_command(world, micro_batch)}")
        from tessera.planner.moe import active_workload

        active, moe = active_workload(w, layout, cfg)
        step = estimate(active, layout).step_time
        if moe is not None:  # a mixture of experts: plus all-to-all and expert sync
            step += moe.alltoall_time + moe.expert_sync_time
        return step, label
    except Exception as e:  # noqa: BLE001 - a summary line, never a failed run
        return None, f"the planner could not price this layout ({e})"


def host_load() -> tuple[float, int] | None:
    """The host's 1-minute load average (runnable threads, over the last minute) and its
    cores; None where the system keeps no load average."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except OSError:
        return None


def own_threads(world: int, device: torch.device) -> int:
    """Runnable threads the run itself keeps on this host: each local rank's torch threads on
    CPU (``tessera train --nproc`` gives each one), one per rank driving a GPU."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local * (torch.get_num_threads() if device.type == "cpu" else 1)


def host_load_note(load: float, cores: int, own: int) -> str | None:
    """A note when others' work loaded the host, beyond the run's own `own` threads: at least
    one other runnable thread on average, and either others hold half the cores or more, or
    with the run the host has more runnable threads than cores (a rank then waits for a core).
    None on a host the run had to itself."""
    others = load - own
    if others < 1 or (others < cores / 2 and load <= cores):
        return None
    return (f"host loaded (load average {load:.2f} on {cores} cores, the run's own threads "
            f"{own}): the prediction assumes an idle host")


def gather_memory(executor) -> list[dict[str, Any]]:
    """Every rank's model-state bytes and peak activation bytes (all ranks call)."""
    record = executor.last_record
    mine = {"rank": executor.topo.rank, "coords": executor.topo.coords(),
            **executor.model.model_state_bytes(),
            "activations": record.peak_activation_bytes if record else 0}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def step_line(record: dict[str, Any]) -> str:
    """A step's console line from its metrics record (``metrics.step_record``, with the MoE
    load and the validation loss where the record has them)."""
    line = (f"step {record['step']:5d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tok/s | "
            f"{record['model_flops_per_s'] / 1e9:.2f} GFLOP/s")
    if record["mfu"] is not None:
        line += f" | MFU {100 * record['mfu']:.1f}%"
    line += f" | peak mem {record['peak_mem_bytes'] / 2**20:.0f} MiB"
    if "moe_max_load_ratio" in record:
        line += (f" | experts max/mean {record['moe_max_load_ratio']:.2f} "
                 f"drop {100 * record['moe_dropped_fraction']:.1f}%")
    if "val_loss" in record:
        line += f" | val {record['val_loss']:.4f}"
    return line


def summary_lines(cfg: Config, world: int, device: torch.device, median_step_s: float,
                  tokens_per_s: float, flops_per_s: float, mfu: float | None,
                  timeline: dict | None, memory: list[dict[str, Any]],
                  moe: dict[str, Any] | None = None,
                  load: tuple[float, int] | None = None,
                  noise: dict[str, Any] | None = None) -> list[str]:
    """The summary's lines. `load`: the host's (load average, cores) over the run's end;
    None: read now (:func:`host_load`). `noise`: the gradient noise scale's last record."""
    p, t = cfg.parallel, cfg.train
    layout = f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}"
    if p.ep > 1:
        layout += f" ep={p.ep}"
    if p.pp > 1:
        layout += f" schedule={p.schedule} v={p.virtual_stages} m={t.grad_accum}"
    layout += f" zero={p.zero_stage} recompute={p.recompute} precision={t.precision}"
    if p.sequence_parallel:
        layout += " sp"
    if p.cp > 1:
        layout += f" cp_method={p.cp_method}"
    lines = ["=" * 72, f"layout      {layout} ({world} ranks)",
             f"throughput  {tokens_per_s:,.0f} tokens/s, {flops_per_s / 1e9:.2f} model "
             f"GFLOP/s" + (f", MFU {100 * mfu:.1f}%" if mfu is not None else "")]
    predicted, source = planner_prediction(cfg, world, device)
    if predicted is None:
        lines.append(f"step time   measured {1e3 * median_step_s:.3g} ms; planner: {source}")
    else:
        lines.append(f"step time   measured {1e3 * median_step_s:.3g} ms, planner predicted "
                     f"{1e3 * predicted:.3g} ms ({predicted / median_step_s:.2f}x; {source})")
        load = load or host_load()
        note = host_load_note(*load, own_threads(world, device)) if load else None
        if note:
            lines.append(f"            {note}")
    if timeline is not None:
        from tessera.pipeline.schedules import closed_form_bubble

        closed = closed_form_bubble(timeline["schedule"], p.pp, t.grad_accum, p.virtual_stages,
                                    p.microbatch_group)
        closed_text = f"{closed:.3f}" if closed is not None else "n/a"
        lines.append(f"bubble      measured {timeline['measured_bubble']:.3f} (last step), "
                     f"closed form {closed_text}")
    lines.append("memory/rank params   grads  optimizer  activations (MiB; peak of saved "
                 "activations, last step)")
    for m in memory:
        c = m["coords"]
        where = f"r{m['rank']} pp{c['pp']} dp{c['dp']} tp{c['tp']}"
        if p.cp > 1:
            where += f" cp{c['cp']}"
        lines.append(f"  {where:<18}{m['params'] / MIB:7.2f} {m['grads'] / MIB:7.2f} "
                     f"{m['optimizer'] / MIB:10.2f} {m['activations'] / MIB:12.2f}")
    if moe is not None:
        m = cfg.model
        load = " ".join(f"{v:.0f}" for v in moe["moe_tokens_per_expert"])
        lines.append(f"experts     E={m.moe_experts} top-{m.moe_top_k} capacity "
                     f"{m.moe_capacity_factor:g}: tokens per expert (all MoE layers, whole run) "
                     f"{load}")
        lines.append(f"            busiest/mean {moe['moe_max_load_ratio']:.2f}, dropped "
                     f"{100 * moe['moe_dropped_fraction']:.2f}%, aux loss "
                     f"{moe['moe_aux_loss']:.4f}")
    if noise is not None and noise["noise_scale"] is not None:
        batch = t.micro_batch_size * t.grad_accum * p.dp
        lines.append(f"noise scale B_simple = tr(Σ)/|G|² = {noise['noise_scale']:,.0f} sequences "
                     f"({noise['noise_scale_tokens']:,.0f} tokens), last step's moving average; "
                     f"global batch {batch}")
    if timeline is not None:
        lines.append(f"timeline    {timeline['png']}")
    lines.append("=" * 72)
    return lines
