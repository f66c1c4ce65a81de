"""Keeping freed host memory (tessera.host_memory): a freed block is reused without page
faults, and a CPU training rank applies it unless the config says not to."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import tessera.trainer
from tessera.config import make_config
from tessera.trainer import run

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Allocates 16 MiB with malloc, touches every page, frees it, twice; prints the minor page
# faults of the second round. glibc maps a block that large on its own (above its starting
# 128 KiB mmap threshold) and unmaps it on free, then serves the second one from fresh heap:
# about 4096 faults (16 MiB / 4 KiB). Kept, the first block comes from the heap and stays
# there, so the second reuses its pages: none.
ROUNDS = """
import ctypes, resource, sys
from tessera.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 16 * 2**20
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1])
"""


def _second_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="the switches are glibc's; elsewhere nothing changes")
def test_a_freed_block_is_reused_without_page_faults():
    pages = 16 * 2**20 // 4096
    # Without the switches the second block is faulted in afresh: at least half its pages
    # (the exact count moves by a few with what else the interpreter allocates).
    assert _second_round_faults("release") > pages // 2
    # Kept: a handful at most (the interpreter's own small allocations), not the block's.
    assert _second_round_faults("keep") < pages // 16


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
