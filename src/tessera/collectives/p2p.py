"""The one communication primitive every tessera collective is built from: a *round*.

A round is one step of a collective's schedule: this rank posts its receives and sends for the
step (torch.distributed ``irecv``/``isend`` on the given group, addressed by group rank and
mapped to global ranks with ``dist.get_global_rank``), then waits for all of them. Algorithms
are sequences of rounds; nothing else touches the wire.

Counting rules (what :class:`CommStats` records, and what the tests check against formulas):

- ``rounds``: schedule steps in which this rank was scheduled to send or receive. A step whose
  chunk happens to be empty (1 element over 8 ranks) still counts: the schedule, not the data,
  fixes the round count, so round formulas hold for every size.
- ``bytes_sent`` / ``bytes_received``: payload bytes actually put on / taken off the wire by
  this rank (``numel * element_size``); empty chunks are not sent at all.
- ``messages_sent``: point-to-point sends posted. A message longer than ``SEGMENT_BYTES`` goes
  as several sends of at most that size (both ends cut it the same way), so that reductions
  overlap the transfer and scratch buffers stay small; the alpha-beta model charges one alpha
  per logical message on the critical path.

Sharding rule used by reduce-scatter, all-gather (with ``numel``) and the ring/recursive
algorithms: a flat buffer of ``n`` elements over ``N`` ranks is cut like
``torch.tensor_split(buf, N)``: the first ``n % N`` ranks own ``n // N + 1`` elements, the rest
``n // N``, in rank order and contiguous. When ``N`` divides ``n`` every shard has ``n / N``
elements and shard ``r`` is exactly what ``torch.distributed.reduce_scatter_tensor`` gives rank
``r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.errors import ConfigError

REDUCE_OPS = ("sum", "avg", "max", "min")
SEGMENT_BYTES = 1 << 20
"""Longest single send. Fresh multi-MiB buffers cost page faults on every call, and a fold can
start on the first segment while later ones are still on the wire."""


@dataclass
class CommStats:
    """Traffic of the collectives run by this rank (pass one in as ``stats=``; it accumulates)."""

    bytes_sent: int = 0
    """Payload bytes this rank sent."""
    bytes_received: int = 0
    """Payload bytes this rank received."""
    messages_sent: int = 0
    """Non-empty point-to-point sends this rank posted."""
    rounds: int = 0
    """Schedule steps this rank took part in (see the module docstring for the rule)."""
    calls: int = 0
    """Collective calls recorded."""

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.messages_sent = self.rounds = self.calls = 0


def shard_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each rank's shard of a flat buffer (``torch.tensor_split`` rule)."""
    base, extra = divmod(numel, world)
    bounds, start = [], 0
    for r in range(world):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def check_choice(field_name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(field_name, value, f"must be one of {', '.join(allowed)}")


def combine_(dst: torch.Tensor, src: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """``dst <- src (op) x`` (dst may be src). avg sums here; the caller divides at the end.

    For bfloat16 operands torch computes the add in float32 and rounds once, so a two-operand
    step loses at most one bf16 rounding.
    """
    if op in ("sum", "avg"):
        torch.add(src, x, out=dst)
    elif op == "max":
        torch.maximum(src, x, out=dst)
    else:
        torch.minimum(src, x, out=dst)


def wide_accumulator(t: torch.Tensor, op: str) -> torch.Tensor:
    """A copy of `t` to sum several operands into: float32 for 16-bit floats, else `t`'s dtype.

    Used where one rank folds many contributions in one place (naive root, parallel, tree
    reduce): the sum is rounded to the wire dtype once instead of once per operand.
    """
    if op in ("sum", "avg") and t.dtype in (torch.bfloat16, torch.float16):
        return t.to(torch.float32)
    return t.clone()


class PeerGroup:
    """A process group seen by one collective call: ranks by group position, plus rounds.

    ``order`` optionally renumbers the group (position ``i`` is group rank ``order[i]``), which
    is how rooted algorithms work in ranks relative to their root. Tensors handed to a round
    are 1-D and contiguous (slices of flat buffers).
    """

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None,
                 order: Sequence[int] | None = None, segment_bytes: int = SEGMENT_BYTES):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        group_rank = dist.get_rank(self.group)
        if group_rank < 0:
            raise ConfigError("group", "this rank", "is not a member of the group")
        order = list(order) if order is not None else list(range(self.size))
        self.global_ranks = [dist.get_global_rank(self.group, g) for g in order]
        self.rank = order.index(group_rank)
        self.stats = stats
        self.segment_bytes = segment_bytes
        if stats is not None:
            stats.calls += 1

    def _segments(self, t: torch.Tensor, wire: torch.dtype | None = None) -> list[torch.Tensor]:
        """Cut `t` as a message of dtype `wire` (default t's) is cut on the wire."""
        step = max(1, self.segment_bytes // (wire or t.dtype).itemsize)
        return [t[i:i + step] for i in range(0, t.numel(), step)]

    def _isend(self, peer: int, t: torch.Tensor) -> list[dist.Work]:
        return [dist.isend(seg, self.global_ranks[peer], group=self.group)
                for seg in self._segments(t)]

    def _irecv(self, peer: int, t: torch.Tensor) -> dist.Work:
        return dist.irecv(t, self.global_ranks[peer], group=self.group)

    def round(self, sends: Sequence[tuple[int, torch.Tensor]] = (),
              recvs: Sequence[tuple[int, torch.Tensor]] = ()) -> None:
        """One schedule step: post every receive and send (peer positions), wait for all."""
        works = [self._irecv(p, seg) for p, t in recvs for seg in self._segments(t)]
        works += [w for p, t in sends for w in self._isend(p, t)]
        for w in works:
            w.wait()
        if sends or recvs:
            self.record_round(sends, sum(t.numel() * t.element_size() for _, t in recvs))

    def reduce_round(self, send: tuple[int, torch.Tensor] | None, recv_peer: int,
                     src: torch.Tensor, dst: torch.Tensor, op: str,
                     wire: torch.dtype | None = None) -> None:
        """One step that sends `send` and folds a message from `recv_peer` into the data:
        ``dst <- src (op) received`` (dst may be src), one segment at a time as each arrives
        (see :meth:`fold_from`)."""
        sends = self.post_sends([send] if send is not None else [])
        self.fold_from(recv_peer, src, dst, op, wire)
        for w in sends:
            w.wait()
        self.record_round([send] if send is not None else [],
                          src.numel() * (wire or src.dtype).itemsize)

    def post_sends(self, sends: Sequence[tuple[int, torch.Tensor]]) -> list[dist.Work]:
        """Start sends (peer position, tensor) without waiting; wait on what comes back."""
        return [w for p, t in sends for w in self._isend(p, t)]

    def fold_from(self, peer: int, src: torch.Tensor, dst: torch.Tensor, op: str,
                  wire: torch.dtype | None = None) -> None:
        """Receive a message shaped like `src` from `peer`; ``dst <- src (op) message``.

        Segment by segment through two segment-sized scratch buffers, so the fold of one
        segment overlaps the arrival of the next. The message has dtype `wire` (default src's:
        a float32 accumulator folds in bfloat16 messages). op "copy" stores the message.
        """
        wire = wire or src.dtype
        pieces = self._segments(src, wire)
        if not pieces:
            return
        scratch = [torch.empty(pieces[0].numel(), dtype=wire, device=src.device)
                   for _ in range(min(2, len(pieces)))]
        pending = {j: self._irecv(peer, scratch[j][: pieces[j].numel()])
                   for j in range(len(scratch))}
        start = 0
        for j, piece in enumerate(pieces):
            pending.pop(j).wait()
            incoming = scratch[j % 2][: piece.numel()]
            stop = start + piece.numel()
            if op == "copy":
                dst[start:stop].copy_(incoming)
            else:
                combine_(dst[start:stop], piece, incoming, op)
            start = stop
            if j + 2 < len(pieces):  # the buffer is free again: take the next segment
                pending[j + 2] = self._irecv(peer, scratch[j % 2][: pieces[j + 2].numel()])

    def record_round(self, sends: Sequence[tuple[int, torch.Tensor]], received: int) -> None:
        """Count one schedule step with these sends and `received` bytes into the stats."""
        if self.stats is None:
            return
        self.stats.rounds += 1
        self.stats.messages_sent += sum(len(self._segments(t)) for _, t in sends)
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for _, t in sends)
        self.stats.bytes_received += received
