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
    """Appends one JSON object per line; only the writing rank opens the file."""

    def __init__(self, path: str | Path | None, append: bool = False):
        """A new file, or with `append` (a resumed run) the existing one continued."""
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not (append and self.path.exists()):
                self.path.write_text("")

    def log(self, record: dict[str, Any]) -> None:
        """Append `record` with `time`, the wall clock in Unix seconds (UTC), when it is written:
        so runs can be lined up with each other and with system logs."""
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
