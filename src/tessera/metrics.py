"""Per-step metrics: throughput, model FLOP/s and MFU, peak memory, and a JSONL log.

A resumed run (``--resume``, or a restart by the elastic launcher) continues the log of the run
it resumes: it first writes a marker ``{"event": "restart", "from_step": N, ...}`` and then
records from step N + 1 on, so the steps run between the checkpoint at N and the failure appear
twice in the file. ``read_metrics`` keeps, for each step, the record written last, after the
newest marker whose ``from_step`` is below it: every reader of ``metrics.jsonl`` goes through
it. TensorBoard gets the same rule from ``purge_step``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Dense (not sparse) 16-bit peak TFLOP/s by GPU name fragment, for MFU when the user gives none.
DEVICE_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "V100": 125.0,
                      "L40S": 362.0, "A10": 125.0, "4090": 165.0}


def device_peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s if it is a known GPU; None on CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DEVICE_PEAK_TFLOPS.items() if k in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def mfu(flops_per_s: float, peak_tflops: float | None, n_devices: int) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over the devices' combined peak."""
    if not peak_tflops:
        return None
    return flops_per_s / (peak_tflops * 1e12 * n_devices)


@dataclass(frozen=True)
class StepWork:
    """What each step of a run does, for its rates: tokens and model FLOPs per step, the
    number of devices, and one device's peak TFLOP/s (None: unknown, no MFU)."""

    tokens: int
    flops: float
    devices: int
    peak_tflops: float | None


def step_record(step: int, done, lr: float, work: StepWork,
                device: torch.device) -> dict[str, Any]:
    """A step's record in metrics.jsonl, from ``Executor.train_step``'s result `done`: its
    loss, learning rate, gradient norm and seconds, the rates those give (tokens/s, model
    FLOP/s, MFU), this rank's peak device memory so far, and this rank's waits on DP
    collectives and its compute actions' seconds (``step.py``); with the gradient noise scale
    measured, its record (``noise_scale``, ``noise_scale_tokens``, ``grad_sq_est``,
    ``grad_trace_est``: ``tessera.noise_scale``)."""
    return {
        "step": step, "loss": done.loss, "lr": lr, "grad_norm": done.grad_norm,
        "step_s": done.seconds, "tokens_per_s": work.tokens / done.seconds,
        "model_flops_per_s": work.flops / done.seconds,
        "mfu": mfu(work.flops / done.seconds, work.peak_tflops, work.devices),
        "peak_mem_bytes": peak_memory_bytes(device),
        "comm_wait_s": done.comm_wait_s,
        "compute_s": done.compute_s,
    } | (done.noise or {})


class JsonlLogger:
    """Appends one JSON object per line; only the writing rank opens the file. With
    `tensorboard` (a directory) every number of a record also goes there as a scalar.

    A new file; or for a resumed run (`resumed_from`: the step it restored; `restart`: the
    launcher's restart count, 0 for a resume by hand; `checkpoint`: the one it restored) the
    existing file, if any, continued, with a restart marker first; TensorBoard drops its own
    records of the steps after `resumed_from` (the resumed run writes them again)."""

    def __init__(self, path: str | Path | None, resumed_from: int | None = None,
                 tensorboard: str | Path | None = None, restart: int = 0,
                 checkpoint: str | Path | None = None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_from is None or not self.path.exists():
                self.path.write_text("")
        self.tensorboard = (TensorBoardWriter(tensorboard, resumed_from)
                            if self.path and tensorboard else None)
        if self.path and resumed_from is not None:
            marker: dict[str, Any] = {"event": "restart", "from_step": resumed_from,
                                      "restart": restart}
            if checkpoint is not None:
                marker["checkpoint"] = str(checkpoint)
            self._write(marker)

    def log(self, record: dict[str, Any]) -> None:
        """Append `record` with `time`, the wall clock in Unix seconds (UTC), when it is written:
        so runs can be lined up with each other and with system logs."""
        self._write(record)
        if self.tensorboard is not None:
            self.tensorboard.log(record)

    def _write(self, record: dict[str, Any]) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")


def read_log(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A metrics.jsonl file as (step records, events): one record per step, in step order, the
    one written last after the newest restart marker below its step (a marker with
    ``from_step`` N drops every earlier record of a step after N: the resumed run went on from
    the state at N); and the event records (restart markers), in file order. A last line cut
    off mid-write (a reader racing the writer, or a killed one) is left out."""
    steps: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    lines = Path(path).read_text().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the unfinished last line, with no newline yet
                continue
            raise
        if "event" in record:
            events.append(record)
            if record["event"] == "restart":
                steps = {s: r for s, r in steps.items() if s <= record["from_step"]}
        else:
            steps[record["step"]] = record
    return [steps[s] for s in sorted(steps)], events


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl file: one per step, in step order, each the latest
    (see `read_log`); restart markers left out."""
    return read_log(path)[0]


def tensorboard_missing() -> str | None:
    """Why TensorBoard scalars cannot be written here, or None if they can."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return ("needs the tensorboard package "
                "(pip install -c constraints.txt 'tessera[tensorboard]')")
    return None


class TensorBoardWriter:
    """A record's numbers as TensorBoard scalars at its step ("loss", "val_loss", "lr", ...),
    flushed at every record so a crashed run's curves survive. For a run resumed at step N,
    TensorBoard hides the directory's records of steps after N (``purge_step`` N + 1: the
    resumed run writes them again)."""

    def __init__(self, directory: str | Path, resumed_from: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resumed_from is None else resumed_from + 1
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()


def memory_snapshot_refusal(device: torch.device) -> str | None:
    """Why `train.memory_snapshot` cannot run on `device`, or None if it can."""
    if device.type != "cuda":
        return ("needs CUDA (torch.cuda.memory records the GPU caching allocator's history); "
                f"this run's device is {device.type}")
    return None


class MemorySnapshot:
    """The CUDA caching allocator's history, recorded from `start()`; `dump()` writes the
    pickle that https://pytorch.org/memory_viz reads."""

    MAX_ENTRIES = 100_000

    def __init__(self, path: Path):
        self.path = path

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.MAX_ENTRIES)

    def dump(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.path))
        torch.cuda.memory._record_memory_history(enabled=None)
        return self.path
