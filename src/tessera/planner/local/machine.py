"""This machine's shape as the planner sees it: cores, memory per rank, ranks per node, the
device each calibrating rank measures on, and the share of compute a collective hides."""

from __future__ import annotations

import os

import torch

from tessera.planner.local.terms import ranks_time_share

LOCAL_RANKS = 64
"""Ranks one machine may hold: every local rank is on the same "node" (one loopback link);
`cores` says how many of them compute at full speed."""

def rank_device(device: str, rank: int) -> torch.device:
    """The device a calibrating rank measures on: the CPU, or GPU `rank` mod the GPU count."""
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)

def physical_memory_bytes() -> float:
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return float(pages * page)


def collective_overlap(cores: int, ranks: int) -> float:
    """``dp_overlap`` for `ranks` ranks on `cores` CPU cores (0: a device each, whose
    collectives run on their own stream beside the kernels: 1). With a core or more per rank,
    each core runs a rank's compute thread and, while a collective is in flight, gloo's
    thread beside it: 2·ranks runnable threads on `cores` cores, each getting cores/(2·ranks)
    of one (at most all of it), which is the share of the compute's seconds a collective in
    flight progresses by; with fewer cores than ranks, 0 (every core is busy with some rank's
    compute, and the planner counts all the work over the cores:
    ``terms.shared_cpu_bound``)."""
    if cores <= 0:
        return 1.0
    if ranks_time_share(cores, ranks):
        return 0.0
    return min(1.0, cores / (2 * ranks))


def machine_shape(device: str) -> tuple[int, float, int]:
    """(cores the ranks share, memory bytes per rank, ranks per node) of this machine for
    ranks on `device`: on the CPU every core, the RAM divided among them, and LOCAL_RANKS; on
    GPUs no cores to share (0: one device per rank), one GPU's memory, and the GPU count."""
    if device == "cuda":
        return (0, float(torch.cuda.get_device_properties(0).total_memory),
                torch.cuda.device_count())
    cores = os.cpu_count() or 1
    return cores, physical_memory_bytes() / cores, LOCAL_RANKS
