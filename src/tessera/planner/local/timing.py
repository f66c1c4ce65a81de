"""Timing on the calibrating rank: the clocks measurements read and the typical repeat.

Compute is timed in the calling thread's CPU time (``time.thread_time``): with one intra-op
thread torch runs every kernel in that thread, so CPU time is what the kernel costs, and other
jobs on a shared machine do not inflate it. On a GPU, whose kernels run asynchronously, times
are wall times after ``torch.cuda.synchronize()``. A measurement is the median of several
repeats: a training step is a typical repeat, not the luckiest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def on_gpu() -> bool:
    return torch.get_default_device().type == "cuda"


def wall_clock() -> float:
    """Wall seconds once the GPU's queued kernels have finished (on a GPU)."""
    if on_gpu():
        torch.cuda.synchronize()
    return time.perf_counter()


def samples(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of `repeats` calls of `fn` after `warmup` untimed ones: this thread's CPU time
    on the CPU, synchronized wall time on a GPU."""
    clock = wall_clock if on_gpu() else time.thread_time
    samples = []
    for i in range(warmup + repeats):
        start = clock()
        fn()
        if i >= warmup:
            samples.append(clock() - start)
    return samples


def typical_time(fn: Callable[[], object], repeats: int = 11) -> float:
    """The median of `repeats` calls of `fn` on :func:`samples`' clock (module docstring)."""
    return statistics.median(samples(fn, repeats))
