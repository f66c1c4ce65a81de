"""Counted collectives for tensor and sequence parallelism, and the accounting they feed.

A :class:`CommStats` object is handed to the layers that communicate (there is no global
counter); every collective they issue through this module adds one :class:`CommRecord` with the
bytes one rank puts on the wire under the bandwidth-optimal (ring) algorithms that the Megatron
papers use for their volume arguments (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.3):

- all-reduce of n elements: 2·(t−1)/t · n  (a reduce-scatter followed by an all-gather),
- all-gather producing n elements: (t−1)/t · n,
- reduce-scatter consuming n elements: (t−1)/t · n,
- all-to-all of n elements (this rank's input): (t−1)/t · n (the 1/t kept is not sent),
- a point-to-point send of n elements: n (context parallelism's ring),

each times the element size in bytes, for a group of t ranks. Gloo may run other algorithms;
these are the bytes-equivalents the papers compare, not a packet capture.

A group of None or of one rank makes every collective here the identity, recorded as nothing.

`conjugate` builds the differentiable operators of tensor, sequence and context parallelism
from a pair of these collectives: one runs on the input forward, its conjugate on the gradient
backward (Megatron's ``f`` and ``g``, sequence parallelism's ``g`` and ``ḡ``, Ulysses'
all-to-alls).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd import Function

from tessera.collectives.algorithms import all_gather_single, reduce_scatter_single

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def ring_bytes_sent(op: str, numel: int, element_size: int, group_size: int) -> float:
    """Bytes one rank sends for `op` over `numel` elements (the full, unsharded tensor)."""
    if op not in OPS:
        raise ValueError(f"op={op!r}: must be one of {', '.join(OPS)}")
    if op == "send":
        return float(numel * element_size)
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size * numel * element_size
    return 2 * share if op == "all_reduce" else share


@dataclass(frozen=True)
class CommRecord:
    tag: str
    """Where the collective was called, e.g. 'layers.0.attention:exit'."""
    op: str
    """all_reduce, all_gather, reduce_scatter, all_to_all or send."""
    phase: str
    """'forward', 'backward', or 'step' for once-per-step gradient syncs."""
    numel: int
    """Elements of the full tensor: the all-reduced tensor, the gather's output, the scatter's
    input."""
    element_size: int
    group_size: int

    @property
    def bytes_sent(self) -> float:
        return ring_bytes_sent(self.op, self.numel, self.element_size, self.group_size)


@dataclass
class CommStats:
    """A log of the collectives one rank issued; pass it to the layers explicitly."""

    records: list[CommRecord] = field(default_factory=list)

    def record(self, tag: str, op: str, phase: str, numel: int, element_size: int,
               group_size: int) -> None:
        self.records.append(CommRecord(tag, op, phase, numel, element_size, group_size))

    def bytes_sent(self, prefix: str = "", phase: str | None = None,
                   contains: str = "") -> float:
        """Bytes sent by collectives whose tag starts with `prefix` and contains `contains`."""
        return sum(r.bytes_sent for r in self.records
                   if r.tag.startswith(prefix) and contains in r.tag
                   and (phase is None or r.phase == phase))

    def by_tag(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for r in self.records:
            out[r.tag] += r.bytes_sent
        return dict(out)

    def count(self, prefix: str = "") -> int:
        return sum(1 for r in self.records if r.tag.startswith(prefix))

    def reset(self) -> None:
        self.records.clear()


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


Collective = Callable[..., torch.Tensor]
"""``collective(x, group, stats, tag, phase) -> tensor``: one side of a conjugate pair."""


def conjugate(name: str, forward: Collective, backward: Collective,
              doc: str) -> Callable[..., torch.Tensor]:
    """The operator ``op(x, group, stats=None, tag="")`` that applies `forward` to `x` and, in
    backward, `backward` to the gradient (with phase "forward" and "backward"); the identity on
    a group of one rank. `name` names its autograd Function (and so its grad_fn). A `forward`
    that returns its input has modified it in place and marks it dirty; an identity forward
    returns ``x.view_as(x)``."""

    def fwd(ctx, x, group, stats, tag):
        ctx.group, ctx.stats, ctx.tag = group, stats, tag
        out = forward(x, group, stats, tag, "forward")
        if out is x:  # modified in place: tell autograd
            ctx.mark_dirty(x)
        return out

    def bwd(ctx, grad):
        return backward(grad, ctx.group, ctx.stats, ctx.tag, "backward"), None, None, None

    function = type(name, (Function,), {"forward": staticmethod(fwd),
                                        "backward": staticmethod(bwd), "__doc__": doc})

    def op(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None,
           tag: str = "") -> torch.Tensor:
        if group_size(group) == 1:
            return x
        return function.apply(x, group, stats, tag)

    op.__doc__ = doc
    return op


def _log(stats: CommStats | None, tag: str, op: str, phase: str, numel: int, x: torch.Tensor,
         t: int) -> None:
    if stats is not None:
        stats.record(tag, op, phase, numel, x.element_size(), t)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None,
               tag: str = "", phase: str = "forward",
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               inplace: bool = False) -> torch.Tensor:
    """All-reduce `x` and return the result; `x` itself is reduced only with ``inplace=True``
    (autograd may hand the same gradient tensor to several branches, so the default copies)."""
    t = group_size(group)
    if t == 1:
        return x
    out = x.contiguous() if inplace else x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    _log(stats, tag, "all_reduce", phase, out.numel(), out, t)
    return out


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
               stats: CommStats | None = None, tag: str = "", phase: str = "forward",
               async_op: bool = False) -> torch.Tensor | Callable[[], torch.Tensor]:
    """Concatenate every rank's `x` along `dim` (rank order).

    With ``async_op=True`` the collective is started and a function that waits for it and
    returns the result comes back instead, so the caller can compute in the meantime.
    """
    t = group_size(group)
    if t == 1:
        return (lambda: x) if async_op else x
    dim = dim % x.dim()
    x = x.detach().contiguous()  # collectives are not differentiable; the autograd Functions are
    # Gloo wants the concatenated form, (t·n_0, ...); viewed as the stack (t, *x.shape).
    flat = torch.empty((t * x.numel(),), dtype=x.dtype, device=x.device)
    work = all_gather_single(flat, x.view(-1), group=group, async_op=async_op)
    stacked = flat.view(t, *x.shape)
    _log(stats, tag, "all_gather", phase, stacked.numel(), x, t)

    def finish() -> torch.Tensor:
        if async_op:
            work.wait()
        # (t, ..., n_dim, ...) -> (..., t, n_dim, ...) -> (..., t·n_dim, ...); a view when dim=0.
        return stacked.movedim(0, dim).flatten(dim, dim + 1)

    return finish if async_op else finish()


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                   stats: CommStats | None = None, tag: str = "", phase: str = "forward",
                   async_op: bool = False
                   ) -> torch.Tensor | Callable[[], torch.Tensor]:
    """Sum `x` over ranks and keep this rank's 1/t slice along `dim` (rank order).

    With ``async_op=True``, returns a function that waits and returns the result (as
    `all_gather`).
    """
    t = group_size(group)
    if t == 1:
        return (lambda: x) if async_op else x
    dim = dim % x.dim()
    if x.shape[dim] % t:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by "
                         f"the group size {t}")
    # (..., T, ...) -> (..., t, T/t, ...) -> (t, ..., T/t, ...): rank i's slice is row i.
    chunks = x.unflatten(dim, (t, x.shape[dim] // t)).movedim(dim, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    # Gloo wants the concatenated forms: output (n,), input (t·n,).
    work = reduce_scatter_single(out.view(-1), chunks.detach().view(-1), group=group,
                                  async_op=async_op)
    _log(stats, tag, "reduce_scatter", phase, x.numel(), x, t)

    def finish() -> torch.Tensor:
        if async_op:
            work.wait()
        return out

    return finish if async_op else out
