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
- ``messages_sent``: non-empty sends. The alpha-beta model charges one alpha per message on the
  critical path.

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

from tessera.config import ConfigError

REDUCE_OPS = ("sum", "avg", "max", "min")


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


def combine_(acc: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """``acc <- acc (op) x`` in place. avg sums here; the caller divides once at the end.

    For a bfloat16 ``acc`` torch computes the add in float32 and rounds once, so a two-operand
    step loses at most one bf16 rounding.
    """
    if op in ("sum", "avg"):
        acc.add_(x)
    elif op == "max":
        torch.maximum(acc, x, out=acc)
    else:
        torch.minimum(acc, x, out=acc)


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
    is how rooted algorithms work in ranks relative to their root.
    """

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None,
                 order: Sequence[int] | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        group_rank = dist.get_rank(self.group)
        if group_rank < 0:
            raise ConfigError("group", "this rank", "is not a member of the group")
        order = list(order) if order is not None else list(range(self.size))
        self.global_ranks = [dist.get_global_rank(self.group, g) for g in order]
        self.rank = order.index(group_rank)
        self.stats = stats
        if stats is not None:
            stats.calls += 1

    def round(self, sends: Sequence[tuple[int, torch.Tensor]] = (),
              recvs: Sequence[tuple[int, torch.Tensor]] = ()) -> None:
        """One schedule step: post every receive and send (peer positions), wait for all."""
        works = [dist.irecv(t, self.global_ranks[p], group=self.group)
                 for p, t in recvs if t.numel() > 0]
        works += [dist.isend(t, self.global_ranks[p], group=self.group)
                  for p, t in sends if t.numel() > 0]
        for w in works:
            w.wait()
        if self.stats is not None and (sends or recvs):
            self.stats.rounds += 1
            self.stats.messages_sent += sum(1 for _, t in sends if t.numel() > 0)
            self.stats.bytes_sent += sum(t.numel() * t.element_size() for _, t in sends)
            self.stats.bytes_received += sum(t.numel() * t.element_size() for _, t in recvs)
