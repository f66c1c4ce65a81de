"""Keeping freed host memory (tessera.host_memory): a freed block is reused without page
faults, and a CPU training rank applies it unless the config says not to."""

from __future__ import annotations

import ctypes
import platform
import resource

import pytest

import tessera.trainer
from tessera.config_io import make_config
from tessera.host_memory import keep_freed_memory
from tessera.testing import run_ranks
from tessera.trainer import run

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

BLOCK = 16 * 2**20
PAGES = BLOCK // 4096


def _second_round_faults() -> int:
    """Allocate a 16 MiB block with malloc, touch every page, free it, twice: the minor page
    faults of the second round. glibc maps a block that large on its own (above its starting
    128 KiB mmap threshold) and unmaps it when freed, then serves the second from fresh heap
    pages: ~4096 faults (16 MiB / 4 KiB). Kept, the first block comes from the heap and stays
    mapped, and the second reuses its pages: none."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    faults = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(BLOCK)
        ctypes.memset(block, 1, BLOCK)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults[1]


@pytest.mark.multiprocess
@pytest.mark.skipif(not GLIBC, reason="the switches are glibc's; elsewhere nothing changes")
def test_ranks_that_keep_freed_memory_reuse_a_freed_block_without_page_faults():
    # Test ranks keep it by default, as training ranks do (both calibrate and the benchmarks
    # run in them); keep_host_memory=False leaves malloc as it comes.
    released = run_ranks(_second_round_faults, 2, keep_host_memory=False)
    kept = run_ranks(_second_round_faults, 2)
    # As it comes, the second block is faulted in afresh: at least half its pages (the exact
    # count moves by a few with what else the interpreter allocates).
    assert all(f > PAGES // 2 for f in released), released
    # Kept: a handful at most (the interpreter's own small allocations), not the block's.
    assert all(f < PAGES // 16 for f in kept), kept


@pytest.mark.multiprocess
def test_keep_freed_memory_says_whether_it_applied():
    # Run in a rank, not here, so this test process's malloc stays as it comes.
    assert run_ranks(keep_freed_memory, 1) == [GLIBC]


def test_a_cpu_training_rank_keeps_freed_memory_unless_told_not_to(tiny_data, tmp_path,
                                                                   monkeypatch):
    calls = []
    monkeypatch.setattr(tessera.trainer, "keep_freed_memory", lambda: calls.append(1))
    for keep, expected in ((True, 1), (False, 0)):
        calls.clear()
        cfg = make_config("tiny", overrides=[f"data.path={tiny_data}", "data.seq_len=16",
                                             "data.val_tokens=512"],
                          train=dict(steps=1, eval_interval=0, sample_tokens=0,
                                     out_dir=str(tmp_path / str(keep)), keep_host_memory=keep))
        run(cfg, progress=False)
        assert len(calls) == expected
