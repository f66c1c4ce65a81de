"""How ``ShardedAdamW`` groups its flat units into multi-tensor updates.

The update runs once per group over the group's tensors (on CUDA one fused AdamW kernel, else
each op as a ``torch._foreach_*`` op), and its temporaries (in bf16 the gradients cast up, and
on the multi-tensor path the denominators: at most 8 bytes an owned element) exist for one
group at a time. Groups are consecutive units whose owned elements add up to at
most ``UPDATE_BATCH_ELEMENTS`` (a larger unit is a group alone): a model of a few hundred
million parameters steps in a few groups, and the step's extra memory stays near 8 bytes ×
max(largest unit, 2²⁶) elements (512 MiB) instead of 8 bytes per owned element. No torch
here: the planner counts the groups too (``tessera.planner.kernels``).
"""

from __future__ import annotations

from collections.abc import Sequence

UPDATE_BATCH_ELEMENTS = 1 << 26
"""Most owned elements one group of the update covers, unless a single unit is larger."""


def update_batches(sizes: Sequence[int], cap: int | None = None) -> list[list[int]]:
    """Indices of consecutive units, `sizes` their owned elements, grouped so that each group's
    sizes sum to at most `cap` (default ``UPDATE_BATCH_ELEMENTS``, read at each call); a unit
    larger than `cap` forms a group alone."""
    cap = UPDATE_BATCH_ELEMENTS if cap is None else cap
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > cap:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        batches.append(current)
    return batches
