"""Per-step metrics: throughput, model FLOP/s and MFU, peak memory, and a JSONL log."""

from __future__ import annotations

import json
import resource
import sys
import time
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


class JsonlLogger:
    """Appends one JSON object per line; only the writing rank opens the file. With
    `tensorboard` (a directory) every number of a record also goes there as a scalar."""

    def __init__(self, path: str | Path | None, append: bool = False,
                 tensorboard: str | Path | None = None):
        """A new file, or with `append` (a resumed run) the existing one continued."""
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not (append and self.path.exists()):
                self.path.write_text("")
        self.tensorboard = TensorBoardWriter(tensorboard) if self.path and tensorboard else None

    def log(self, record: dict[str, Any]) -> None:
        """Append `record` with `time`, the wall clock in Unix seconds (UTC), when it is written:
        so runs can be lined up with each other and with system logs."""
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.log(record)


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
    flushed at every record so a crashed run's curves survive."""

    def __init__(self, directory: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

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
