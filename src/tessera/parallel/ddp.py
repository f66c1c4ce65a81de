"""Data parallelism: replicate the model, split the batch, average gradients.

Collectives: one all-reduce (sum, then divide by dp) of all gradients per optimizer step, over
the dp group. Invariant: after `finish_gradient_sync()`, every replica holds the gradient of the
mean loss over the whole global batch, so replicas take identical optimizer steps and stay
bit-identical.

This is the simplest correct form: gradients are flattened into one buffer and reduced after
the last backward of the step. `no_sync()` skips reduction during gradient accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self._sync = True
        self._broadcast_parameters()

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Start from one set of weights: the dp group's first rank's."""
        if self.world == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            dist.broadcast(t, src=src, group=self.group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next step outside the context reduces them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Average every gradient over the dp group (call after the step's last backward)."""
        if self.world == 1 or not self._sync:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
