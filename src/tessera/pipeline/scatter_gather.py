"""Scatter/gather between pipeline stages under tensor parallelism.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §4.1. Without sequence parallelism every tp rank of a stage holds the same block
output (b, s, h): the residual stream is replicated over tp. Sending it whole from each tp rank
to the same tp rank of the next stage moves t identical copies over the (inter-node) pipeline
link. With scatter/gather each tp rank sends only its 1/t slice of the flattened tensor, and
the receiving stage all-gathers the slices over its tp group (the fast intra-node link) before
use. Backward is the same: the gradient of a chunk's input is the full gradient on every tp
rank (Megatron's ``f`` all-reduces it over tp where the block enters its tensor-parallel
region, and the residual path adds the same replicated values), so sending a slice and
all-gathering rebuilds it exactly.

Collectives: per message, one point-to-point send of b·s·h/t elements (instead of b·s·h) on the
pipeline link and one all-gather producing b·s·h elements over tp on the receiving stage
((t−1)/t · b·s·h sent per rank, recorded in the tp group's ``CommStats`` when it has one).

Invariants: slicing is along the flattened tensor, rank r of tp taking elements
[r·n/t, (r+1)·n/t) (so a slice is contiguous and needs no copy); a tensor whose element count
t does not divide is refused with a ValueError (tessera's layouts never make one: layout
rules make t divide n_heads, which divides d_model). Under sequence parallelism the tensor
that crosses the boundary is already the rank's own T/t tokens, 1/t of the activation and
different on each rank: there is nothing to split, and the boundary is the identity (the same
code path with one part). Autograd is untouched: the runtime detaches each chunk's input, so
the gathered tensor is the input the receiving chunk differentiates against, and its
gradient is what gets sliced on the way back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.parallel.comm import CommStats, all_gather, group_rank, group_size


@dataclass(frozen=True)
class StageBoundary:
    """How a tensor crossing a pipeline stage boundary travels: whole (one part), or as this
    rank's 1/parts slice, all-gathered over `group` by the receiver."""

    group: dist.ProcessGroup | None = None
    """The tp group the slices are gathered over (None: one part, the identity)."""
    parts: int = 1
    rank: int = 0
    """This rank's index in `group`: which slice it sends."""
    stats: CommStats | None = None
    """Where the all-gathers are counted (the tp group's stats); None counts nothing."""

    @classmethod
    def over_tp(cls, group: dist.ProcessGroup | None, sequence_parallel: bool,
                enabled: bool, stats: CommStats | None = None) -> StageBoundary:
        """The boundary of a stage whose tp group is `group`: split over it when scatter/gather
        is `enabled` and the boundary tensor is replicated over tp (no sequence parallelism,
        more than one tp rank), else whole."""
        t = group_size(group)
        if not enabled or sequence_parallel or t == 1:
            return cls()
        return cls(group=group, parts=t, rank=group_rank(group), stats=stats)

    def _piece(self, shape: torch.Size | tuple[int, ...]) -> int:
        numel = math.prod(shape)
        if numel % self.parts:
            raise ValueError(f"scatter/gather: a tensor of shape {tuple(shape)} ({numel} "
                             f"elements) does not split into {self.parts} equal parts")
        return numel // self.parts

    def wire_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape that travels for a tensor of `shape`: itself, or (numel/parts,)."""
        return tuple(shape) if self.parts == 1 else (self._piece(shape),)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """What this rank sends of `x`: `x`, or its slice of the flattened tensor (a view)."""
        if self.parts == 1:
            return x
        n = self._piece(x.shape)
        return x.contiguous().view(-1)[self.rank * n:(self.rank + 1) * n]  # (numel/t,)

    def gather(self, piece: torch.Tensor, shape: tuple[int, ...],
               phase: str = "forward") -> torch.Tensor:
        """The full tensor of `shape` from every rank's received `piece` (all-gather over the
        group, rank order); `piece` itself with one part."""
        if self.parts == 1:
            return piece
        if piece.numel() != self._piece(shape):
            raise ValueError(f"scatter/gather: a piece of {piece.numel()} elements is not "
                             f"1/{self.parts} of shape {tuple(shape)}")
        full = all_gather(piece.view(-1), 0, self.group, self.stats, tag="pipeline:gather",
                          phase=phase)
        return full.view(shape)  # (B, T, h)
