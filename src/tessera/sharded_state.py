"""What a rank holds, described as boxes of the reference model's tensors: the layout-free view
of a run's state that checkpoints save and load.

Every tensor of a run's state has a name in the reference model's terms and a global shape:

    model.<ref>              the parameter in its training dtype (fp32, or bf16)
    master.<ref>             the fp32 master weights, only when the training dtype is not fp32
    optim.exp_avg.<ref>      AdamW's first moment (fp32)
    optim.exp_avg_sq.<ref>   AdamW's second moment (fp32)
    optim.step.<ref>         AdamW's step count for that parameter (0-d int64)
    buffer.<ref>             a persistent buffer (the MoE routing bias), in its own dtype

where <ref> is the parameter's name in ``Transformer.named_parameters()`` (a tied head is the
embedding). A rank holds some boxes of each: a :class:`Piece` is one box, ``offsets`` into the
global tensor and a ``tensor`` of the box's shape that is a *view* of the rank's own storage
(no copy: saving reads it, loading writes through it). How a rank's tensors map to boxes, one
case per mechanism:

- **tensor parallelism** (``ShardSpec``): the rank's shard is the box starting at
  ``index·rows`` along the split dimension; the vocabulary padding beyond the reference size is
  clipped off. Pieces replicated over tp (norm gains, replicated kv heads) are written by their
  first holder (``ShardSpec.owns``).
- **pipeline chunks**: whole tensors (or their TP boxes) held by the chunk's pp rank. A tied
  head on another rank than the embedding is a copy: it loads ``tok_embeddings.weight`` and
  never writes it.
- **ZeRO** (any stage, or bf16): a rank owns a contiguous range of a unit's flat buffer, which
  may cut a parameter mid-row. ``flat_range_boxes`` cuts a parameter's part of that range into
  row-major boxes of its TP-local shape (a partial first row, whole rows, a partial last row;
  one more level per extra dimension), each a contiguous slice of the flat buffer, then offsets
  them by the TP origin. Padding at a unit's end belongs to no parameter and is never saved.
- **data and context parallelism**: replicas hold identical pieces; each replicated piece is
  written by one replica, chosen by a hash of its key so the writing spreads over the replicas
  (DCP then records every box of a tensor exactly once and checks that they tile it). Every
  replica reads what it holds, so a resumed run in any layout asks for its own boxes and DCP
  reads the overlaps from the saved ones.
- **experts** (``layers.{i}.feed_forward.experts.w1|w3|w2``, stacked (E, ...) tensors): an
  ep rank's slice is one more origin term on dim 0 (``Experts.first``, the reference index of
  its first expert; :func:`expert_placement`). Its replicas are the edp × cp ranks (the same
  position in every ep block), not dp × cp: the writer is chosen among those, and ZeRO's
  expert units own ranges of a flat buffer sharded over edp (MoE refuses cp > 1 today; with
  it, those ranges would be replicated over cp and need a writer chosen there too). A step
  count is one per parameter: written by the ep rank holding expert 0.
- **persistent buffers** (the MoE routing bias ``expert_bias``): ``buffer.<ref>``, whole,
  replicated over every rank of the chunk's pp stage, written by one replica on tp rank 0.

Nothing here communicates; the model's groups are read only for ranks and sizes.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tessera.parallel.expert_parallel import is_expert_param
from tessera.parallel.tensor_parallel import ShardSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a box in some tensor."""


@dataclass(frozen=True)
class Piece:
    """One box of one named global tensor that this rank holds."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    """The box itself, shape = its sizes: a view of the rank's own storage."""
    write: bool
    """This rank writes the box (one holder of every replicated box)."""
    on_load: Callable[[torch.Tensor], None] | None = None
    """For a value that is not a view (a step count): what to do with the loaded `tensor`."""

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Elements [lo, hi) of a row-major tensor of `shape`, as boxes in that tensor, in order;
    each box is a contiguous run of the flattened tensor. At most 2·(ndim−1)+1 boxes."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    row = math.prod(shape[1:])  # elements per index of dim 0
    first, last = lo // row, (hi - 1) // row
    if first == last:  # inside one row: recurse into it
        return [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo - first * row,
                                                                       hi - first * row)]
    boxes: list[Box] = []
    if lo % row:  # the partial first row
        boxes += flat_range_boxes(shape, lo, (first + 1) * row)
        first += 1
    whole_end = hi // row  # rows [first, whole_end) are whole
    if whole_end > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if hi % row:  # the partial last row
        boxes += flat_range_boxes(shape, whole_end * row, hi)
    return boxes


def tp_placement(local_shape: tuple[int, ...], spec: ShardSpec, tp_rank: int, tp_size: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, origin of the rank's local tensor in it) for a parameter laid out by
    `spec`. The last shard of a padded vocabulary reaches past the global shape: clip boxes."""
    if spec.dim is None:
        return tuple(local_shape), (0,) * len(local_shape)
    rows = spec.padded_size // spec.chunks
    global_shape = list(local_shape)
    global_shape[spec.dim] = spec.full_size
    origin = [0] * len(local_shape)
    origin[spec.dim] = spec.index(tp_rank, tp_size) * rows
    return tuple(global_shape), tuple(origin)


def expert_placement(global_shape: tuple[int, ...], origin: tuple[int, ...], first: int,
                     n_experts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, origin) of an ep rank's (E/ep, ...) slice of a stacked expert tensor
    whose first expert is `first` in the reference's (E, ...) tensor, from the placement
    :func:`tp_placement` gave its local shape (experts are never TP-split: dim 0 is free)."""
    return (n_experts, *global_shape[1:]), (origin[0] + first, *origin[1:])


def _place(box: Box, origin: tuple[int, ...], global_shape: tuple[int, ...]
           ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A local box moved to the global tensor and clipped to it: (global offsets, kept sizes),
    or None when nothing of it lies inside (vocabulary padding)."""
    offsets = tuple(o + g for o, g in zip(box[0], origin, strict=True))
    sizes = tuple(max(0, min(s, n - o)) for o, s, n in zip(offsets, box[1], global_shape,
                                                              strict=True))
    return None if 0 in sizes and len(sizes) else (offsets, sizes)


def _narrow(t: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    for d, n in enumerate(sizes):
        if t.shape[d] != n:
            t = t.narrow(d, 0, n)
    return t


def chosen(key: str, replicas: int) -> int:
    """Which of `replicas` identical holders writes `key` (stable across processes)."""
    return zlib.crc32(key.encode()) % replicas


# ---------------------------------------------------------------------------------------------
# A ParallelModel's pieces


@dataclass(frozen=True)
class _Param:
    """One parameter as a rank holds it: reference name, TP placement, and who writes it."""

    ref: str
    global_shape: tuple[int, ...]
    origin: tuple[int, ...]
    copy: bool
    """A tied head holding a copy of the embedding: loads it, never writes it."""
    tp_owner: bool
    expert: bool = False
    """A stacked expert tensor: replicated over edp × cp, not dp × cp."""

    @property
    def counts_step(self) -> bool:
        """Holds the parameter's first element along the expert dim (one step count each)."""
        return not self.expert or self.origin[0] == 0


def _param(model, c: int, name: str, local_shape: tuple[int, ...]) -> _Param:
    chunk = model.chunks[c]
    spec = model.specs[c][name]
    global_shape, origin = tp_placement(tuple(local_shape), spec, model.tp.rank, model.tp.size)
    expert = is_expert_param(name)
    if expert:
        first = chunk.get_submodule(name.rpartition(".")[0]).first
        global_shape, origin = expert_placement(global_shape, origin, first,
                                                model.cfg.model.moe_experts)
    return _Param(chunk.reference_name(name), global_shape, origin,
                  chunk.tied_copy and name == "output.weight",
                  spec.owns(model.tp.rank, model.tp.size), expert)


def _replica(model, expert: bool = False) -> tuple[int, int]:
    """(this rank's index among the replicas of what it holds, how many there are): the dp × cp
    ranks, or for experts the edp × cp ranks (dp index // ep: the same position in every ep
    block holds the same experts)."""
    coords, topo = model.topo.coords(), model.topo
    dp_index, dp_size = coords["dp"], topo.dp
    if expert:
        dp_index, dp_size = dp_index // topo.ep, dp_size // topo.ep
    return dp_index * topo.cp + coords["cp"], dp_size * topo.cp


def _writes(model, key: str, p: _Param, replicated_over_dp: bool) -> bool:
    if p.copy or not p.tp_owner:
        return False
    if not replicated_over_dp:
        return True
    index, n = _replica(model, p.expert)
    return chosen(key, n) == index


def model_pieces(model, optimizer) -> list[Piece]:
    """Every piece of state `model` (a ``ParallelModel``) and its `optimizer` hold on this
    rank, in reference names (module docstring). Parameter-server workers hold no optimizer
    state; the servers (dp rank 0) do."""
    buffers = list(_buffer_pieces(model))
    if model.sharded:
        return list(_sharded_pieces(model, optimizer)) + buffers
    return list(_replicated_pieces(model, optimizer)) + buffers


def _buffer_pieces(model) -> Iterator[Piece]:
    """Persistent buffers (MoE routing biases): whole and identical on every rank holding the
    chunk (every replica applies the same update), written by one replica on tp rank 0."""
    index, n = _replica(model)
    for c in sorted(model.chunks):
        chunk = model.chunks[c]
        for name, b in chunk.state_dict(keep_vars=True).items():
            if isinstance(b, nn.Parameter):
                continue
            key = f"buffer.{chunk.reference_name(name)}"
            yield Piece(key, tuple(b.shape), (0,) * b.dim(), b.detach(),
                        model.tp.rank == 0 and chosen(key, n) == index)


def _replicated_pieces(model, optimizer) -> Iterator[Piece]:
    """DDP, one process or the parameter server: each parameter (or TP shard) whole, fp32."""
    with_state = isinstance(optimizer, torch.optim.AdamW)
    for c, name, param in model.named_chunk_parameters():
        p = _param(model, c, name, tuple(param.shape))
        box = _place(((0,) * param.dim(), tuple(param.shape)), p.origin, p.global_shape)
        if box is None:
            continue
        offsets, sizes = box
        key = f"model.{p.ref}"
        yield Piece(key, p.global_shape, offsets, _narrow(param.data, sizes),
                    _writes(model, key, p, True))
        if not with_state:
            continue
        state = optimizer.state.setdefault(param, {})
        if "exp_avg" not in state:  # a fresh AdamW: its state, as its first step makes it
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param.data),
                         exp_avg_sq=torch.zeros_like(param.data))
        for moment in ("exp_avg", "exp_avg_sq"):
            key = f"optim.{moment}.{p.ref}"
            yield Piece(key, p.global_shape, offsets, _narrow(state[moment], sizes),
                        _writes_optimizer_state(model, key, p))
        key = f"optim.step.{p.ref}"
        # One count per parameter, not per TP shard: tp rank 0 holds a piece of every one.
        yield _step_piece(key, int(state["step"]),
                          _writes_optimizer_state(model, key, p) and model.tp.rank == 0
                          and p.counts_step,
                          lambda t, state=state: state.update(step=torch.tensor(float(t))))


def _writes_optimizer_state(model, key: str, p: _Param) -> bool:
    """Replicated AdamW state: held by every dp × cp replica, or under the parameter server by
    the servers only (dp rank 0, one per cp rank)."""
    if model.server is None:
        return _writes(model, key, p, True)
    coords = model.topo.coords()
    return (_writes(model, key, p, False) and coords["dp"] == 0
            and chosen(key, model.topo.cp) == coords["cp"])


def _step_piece(key: str, step: int, write: bool, on_load: Callable[[torch.Tensor], None]
                ) -> Piece:
    """An optimizer step count as a 0-d int64 tensor (read back through `on_load`)."""
    return Piece(key, (), (), torch.tensor(step, dtype=torch.int64), write, on_load)


def _sharded_pieces(model, optimizer) -> Iterator[Piece]:
    """ZeRO units: each parameter's part of the rank's owned flat range, as boxes."""
    for c, zero in zip(sorted(model.wrappers), model.zeros, strict=True):
        mixed = zero.dtype != torch.float32
        for u in zero.units:
            state = optimizer.state[u.master]
            weights = u.shard if zero.stage == 3 else u.full[u.own_lo:u.own_hi]
            flats = {"model": weights, "optim.exp_avg": state["exp_avg"],
                     "optim.exp_avg_sq": state["exp_avg_sq"]}
            if mixed:
                flats["master"] = u.master
            for s in u.slots:
                a, b = max(s.offset, u.own_lo), min(s.offset + s.numel, u.own_hi)
                if a >= b:
                    continue
                p = _param(model, c, s.name, tuple(s.shape))
                for local in flat_range_boxes(tuple(s.shape), a - s.offset, b - s.offset):
                    placed = _place(local, p.origin, p.global_shape)
                    if placed is None:
                        continue
                    offsets, sizes = placed
                    start = s.offset + _linear(local[0], tuple(s.shape)) - u.own_lo
                    n = math.prod(local[1])
                    for prefix, flat in flats.items():
                        key = f"{prefix}.{p.ref}"
                        view = _narrow(flat[start:start + n].view(local[1]), sizes)
                        yield Piece(key, p.global_shape, offsets, view,
                                    _writes(model, key, p, zero.stage == 0))
                # The unit's step count under each of its parameters' names, written by the
                # holder of the parameter's first element; every holder reads it back.
                key = f"optim.step.{p.ref}"
                first = u.own_lo <= s.offset < u.own_hi
                yield _step_piece(key, int(state["step"]),
                                  first and model.tp.rank == 0 and p.counts_step
                                  and _writes(model, key, p, zero.stage == 0),
                                  lambda t, state=state: state.update(step=int(t)))


def _linear(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Row-major linear index of `offsets` in `shape`."""
    index = 0
    for o, n in zip(offsets, shape, strict=True):
        index = index * n + o
    return index


__all__ = ["Piece", "flat_range_boxes", "tp_placement", "expert_placement", "model_pieces",
           "chosen"]
