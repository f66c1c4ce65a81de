"""ZeRO's units and their flat buffers: which modules are gathered, reduced and stepped together
(``chunk_units``, ``transformer_units``), and where each parameter sits in its unit's buffer and
which part of it a rank owns (``Slot``, ``FlatUnit``). ``zero.py`` explains the stages and
drives the collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tessera.model import Transformer


def chunk_units(chunk: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The ZeRO units of a pipeline chunk (``tessera.pipeline.partition.Chunk``, any
    tensor-parallel form) in forward order: its embedding, each block, the head.

    Units are named by reference names. The final norm and the LM head form one unit, except
    when the head is a tied copy of an embedding held by another pipeline rank: then the head's
    weight is a unit of its own, laid out exactly like that rank's embedding unit (same numel,
    same padding, same dp shards), so the pair's gradients can be summed shard by shard. A
    chunk holding both the embedding and its tied head keeps them in one unit.
    """
    units: list[tuple[str, list[nn.Module]]] = []
    has_embedding = hasattr(chunk, "tok_embeddings")
    has_output = hasattr(chunk, "output") and "output" in chunk._modules
    tied_here = has_embedding and has_output and \
        chunk.output.weight is chunk.tok_embeddings.weight
    if has_embedding and not tied_here:
        units.append(("tok_embeddings", [chunk.tok_embeddings]))
    units += [(f"layers.{i}", [layer]) for i, layer in chunk.layers.items()]
    if hasattr(chunk, "norm"):
        if tied_here:
            units.append(("embed_head", [chunk.tok_embeddings, chunk.norm, chunk.output]))
        elif has_output and getattr(chunk, "tied_copy", False):
            units += [("norm", [chunk.norm]), ("output", [chunk.output])]
        elif has_output:
            units.append(("head", [chunk.norm, chunk.output]))
        else:  # the head reads an embedding of another chunk on this rank
            units.append(("norm", [chunk.norm]))
    return units


def transformer_units(model: Transformer) -> list[tuple[str, list[nn.Module]]]:
    """The ZeRO units of the reference model in forward order: (name, modules)."""
    head = [model.norm, model.output]
    blocks = [(f"layers.{i}", [layer]) for i, layer in enumerate(model.layers)]
    if model.cfg.tie_embeddings:
        return [("embed_head", [model.tok_embeddings, *head]), *blocks]
    return [("tok_embeddings", [model.tok_embeddings]), *blocks, ("head", head)]


@dataclass(frozen=True)
class Slot:
    """One parameter's place in its unit's flat buffer."""

    name: str
    """Reference name (the first one, for a tied weight)."""
    offset: int
    shape: torch.Size
    decay: bool
    """AdamW weight decay applies (matrices; norm gains are not decayed)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FlatUnit:
    """A unit's flat buffers on one rank; which exist depends on the stage (see module doc)."""

    def __init__(self, name: str, modules: list[nn.Module], slots: list[Slot],
                 params: list[nn.Parameter], *, stage: int, world: int, rank: int,
                 dtype: torch.dtype, group: dist.ProcessGroup | None = None,
                 divisor: int | None = None):
        self.name, self.modules, self.slots, self.params = name, modules, slots, params
        self.stage, self.dtype = stage, dtype
        self.group = group
        """The group this unit is sharded and reduced over."""
        self.divisor = divisor or world
        """The reduced gradient is the sum over the group divided by this (the group's size,
        or dp for expert units reduced over their expert-data group)."""
        self.numel = sum(s.numel for s in slots)
        self.padded = math.ceil(self.numel / world) * world
        self.shard_numel = self.padded // world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        # The optimizer's range: the whole unit at stage 0, the shard otherwise.
        self.own_lo, self.own_hi = (0, self.padded) if stage == 0 else (self.lo, self.hi)
        self.full: torch.Tensor          # (padded,) compute dtype; 0 bytes when freed (stage 3)
        self.shard: torch.Tensor         # (shard_numel,) compute dtype
        self.master: torch.Tensor        # (own_hi - own_lo,) fp32; aliases full/shard in fp32
        self.grad: torch.Tensor          # (padded,) stages 0-1, (shard_numel,) stages 2-3
        self.grad_fresh = True           # grad holds nothing of this step yet (stages 2-3)
        self.resident = True             # full holds the gathered parameters
        self.pending: dist.Work | None = None
        self.grads_ready = 0             # parameters whose gradient this backward delivered
        # An embedding's backward reads only the indices, not the weight: no gather for it.
        self.gather_for_backward = not all(isinstance(m, nn.Embedding) for m in modules)

    def owned_grad(self) -> torch.Tensor:
        """The gradient of the elements the optimizer steps on this rank (compute dtype)."""
        return self.grad[self.own_lo:self.own_hi] if self.stage < 2 else self.grad

    def dp_grad_slice(self) -> torch.Tensor:
        """This rank's dp slice of the reduced gradient: each element counted on one rank."""
        return self.grad[self.lo:self.hi] if self.stage < 2 else self.grad

    def decay_ranges(self) -> list[tuple[int, int]]:
        """Ranges of the master tensor (merged) whose elements get weight decay."""
        out: list[tuple[int, int]] = []
        for s in self.slots:
            a = max(s.offset, self.own_lo) - self.own_lo
            b = min(s.offset + s.numel, self.own_hi) - self.own_lo
            if s.decay and a < b:
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
        return out
