"""Keep the host memory a CPU rank frees, rather than handing it back to the kernel every step.

glibc's malloc gives large freed blocks back to the kernel: a block above its mmap threshold
(128 KiB at first, raised as large blocks are freed) is unmapped when freed, and free space at
the top of the heap beyond the trim threshold is trimmed. A training step frees and allocates
the same sizes every step (activations, gradients, the optimizer's temporaries), so memory
given back in one step is faulted in again in the next, the kernel zero-filling every 4 KiB
page on its first touch. What it costs is measured in ``benchmarks/host_memory.py``: both a
rank's whole step and DataParallel's gradient hook, which frees each fresh gradient right
after copying it into its bucket. CPU training under PyTorch is often run with jemalloc or
tcmalloc preloaded for the same reason; this sets glibc's own switches instead
(``mallopt``), so nothing has to be installed or preloaded.

The switches: never trim the heap (``M_TRIM_THRESHOLD`` at its largest), and serve every block
up to glibc's largest allowed mmap threshold (32 MiB on 64-bit Linux) from the heap, where a
freed block stays mapped and is reused; setting either also stops glibc from moving the
threshold by itself. Larger blocks are still mapped and unmapped. The price is that a rank's
resident memory stays at its peak, which every step reaches anyway.

Only glibc has these switches: elsewhere (macOS, musl) nothing changes. On a GPU the tensors
live in CUDA's caching allocator, which keeps what it frees already; the host side of a GPU
rank allocates little, so the trainer applies this on CPU ranks only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
TRIM_NEVER = 2**31 - 1
"""The largest value mallopt takes (its argument is a C int): never trim the heap."""
MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's largest allowed mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, 4 · 1 MiB ·
sizeof(long)); mallopt refuses larger ones."""


def keep_freed_memory() -> bool:
    """Make this process's malloc keep what it frees (see the module docstring). Returns
    whether it was applied: False where the C library is not glibc, or refuses a switch."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER)
                and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
