"""Expert parallelism: each rank of an ep group holds E/ep experts of every MoE layer; tokens
travel to their experts' ranks and back with all-to-all.

Papers: Lepikhin et al. 2021, "GShard" (experts sharded over devices, dispatch and combine as
all-to-all); Fedus et al. 2022, "Switch Transformers" (expert + data, expert + model + data
parallelism); Rajbhandari et al. 2022, "DeepSpeed-MoE" (expert-data groups: replicas of the
same experts reduce their gradients among themselves only).

Groups (``tessera.topology``): the ep group of a rank is a block of ep consecutive dp ranks at
the same (pp, cp, tp); dp = ep × edp, and the edp group holds the replicas of the same experts
(the same position in every ep block). The MoE layer's ``dispatcher`` submodule becomes an
:class:`ExpertParallelDispatcher` holding the ep group (as context parallelism swaps
``AttentionCore``), and its ``experts`` keep rows [r·E/ep, (r+1)·E/ep) of the reference's
stacked weights (cut from ``init_tensor``'s full value, so every layout starts from the
reference weights). The router and every dense parameter stay replicated.

Collectives of one MoE layer, over the ep group:

- forward: all-to-all of the (E,) per-expert counts (so each rank learns the split sizes it
  will receive), all-to-all of the token rows to their experts' ranks (variable splits:
  dispatch), and after the experts all-to-all of the outputs back (combine);
- backward: the two token all-to-alls again, transposed (combine's gradient is dispatched to
  the experts, dispatch's gradient returns to the tokens' ranks).

The all-to-all is torch.distributed's (``ep_alltoall='backend'``, ``all_to_all_single`` with
split sizes; gloo supports it on CPU) or ours (``'pairwise'``,
``tessera.collectives.all_to_all_v``).

Gradients (:class:`ExpertDataParallel`, the data-parallel wrapper of a chunk with experts):
dense parameters are averaged over dp as always. An expert's gradient on its owner already
sums what every ep rank's tokens contributed (each rank's loss is the mean over its own batch),
so it is summed over edp — the other replicas of that expert — and divided by dp: the mean over
edp, times 1/ep. Both equal the gradient of the mean loss over the global batch.

ZeRO (``tessera.parallel.zero``): each MoE layer's experts form a unit of their own, sharded
and reduced over edp with the divisor dp (``ZeroModel(unit_groups=...)``); dense units as
always over dp. The global norm then needs nothing more: over the dp group the expert units'
edp shards of every ep position are every expert once.

Tensor parallelism: attention and dense MLPs are TP-split as usual; the MoE layers are left
whole on every tp rank (router, experts, shared expert replicated over tp), each tp rank
dispatching its (identical) copy of the tokens within its own ep group. Simple and exact; it
spends tp× the expert FLOPs, which a TP split of the experts would save (not built).

Invariants: the same tokens are dropped as in the reference (capacity is decided per
sequence before dispatch); an expert's rows are processed in the order they arrive, which
changes only the order of the sums in its weight gradient.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.collectives import CommStats, all_to_all_v
from tessera.moe import Experts, moe_layers
from tessera.parallel.ddp import DataParallel


def is_expert_param(name: str) -> bool:
    """Is the parameter named `name` (reference or chunk name) an expert weight?"""
    return ".experts." in f".{name}"


@dataclass
class A2AStats:
    """What the token all-to-alls of this rank moved: rows and bytes sent to other ranks (self
    excluded), calls, and the seconds spent in them (forward and backward)."""

    rows_sent: int = 0
    bytes_sent: int = 0
    calls: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.rows_sent = self.bytes_sent = self.calls = 0
        self.seconds = 0.0


@dataclass
class EPContext:
    """The ep group and how tokens cross it."""

    group: dist.ProcessGroup | None
    algorithm: str = "backend"
    stats: A2AStats = field(default_factory=A2AStats)
    comm: CommStats | None = None
    """Byte counters of our all-to-all (algorithm 'pairwise'), if given."""

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], ctx: EPContext) -> torch.Tensor:
    start = time.perf_counter()
    out = all_to_all_v(x, send, recv, ctx.group, algorithm=ctx.algorithm, stats=ctx.comm)
    s, me = ctx.stats, ctx.rank
    rows = sum(send) - send[me]
    s.rows_sent += rows
    s.bytes_sent += rows * math.prod(x.shape[1:]) * x.element_size()
    s.calls += 1
    s.seconds += time.perf_counter() - start
    return out


class AllToAll(torch.autograd.Function):
    """Rows to ranks by `send` split sizes, `recv` from each; backward sends the gradient back
    the way it came (the same all-to-all with the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], ep: EPContext):
        ctx.send, ctx.recv, ctx.ep = send, recv, ep
        return _exchange(x, send, recv, ep)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.ep), None, None, None


class ExpertParallelDispatcher(nn.Module):
    """Dispatch the sorted rows to the ranks of their experts, run the local experts, combine
    the outputs back (module doc)."""

    def __init__(self, ctx: EPContext):
        super().__init__()
        self.ctx = ctx

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """x (S, h) sorted by expert, counts (E,) -> expert outputs (S, h) in x's order."""
        ep = self.ctx.size
        local = counts.numel() // ep
        send_counts = counts.view(ep, local)  # [destination rank, its held expert]
        recv_counts = all_to_all_v(send_counts, [1] * ep, [1] * ep, self.ctx.group,
                                   algorithm=self.ctx.algorithm)  # [source rank, my expert]
        send = send_counts.sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        arrived = AllToAll.apply(x, send, recv, self.ctx)  # by source, then held expert
        # regroup expert-major: for each held expert, its rows from every source in turn
        starts = torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten()
        starts, sizes = starts.view(ep, local), recv_counts
        index = torch.cat([torch.arange(int(starts[s, e]), int(starts[s, e] + sizes[s, e]))
                           for e in range(local) for s in range(ep)]).to(x.device)
        out = experts(arrived[index], sizes.sum(0).tolist())
        back = torch.empty_like(out).index_copy(0, index, out)  # by source again
        return AllToAll.apply(back, recv, send, self.ctx)


def apply_expert_parallel(chunk: nn.Module, ctx: EPContext) -> None:
    """Keep this ep rank's slice of every MoE layer's experts and swap its dispatcher."""
    for moe in moe_layers(chunk):
        e = moe.experts
        n = e.w1.shape[0]
        if n % ctx.size:
            raise ValueError(f"ep={ctx.size} must divide the experts {n}")
        local = n // ctx.size
        lo = ctx.rank * local
        for name in ("w1", "w3", "w2"):
            full = getattr(e, name)
            setattr(e, name, nn.Parameter(full.detach()[lo:lo + local].clone()))
        e.first = lo
        moe.dispatcher = ExpertParallelDispatcher(ctx)


def expert_units(chunk: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO units of a chunk's experts, one per MoE layer (reference names), to be listed
    before the chunk's other units: they are sharded and reduced over the edp group, not dp."""
    return [(name, [m]) for name, m in chunk.named_modules() if isinstance(m, Experts)]


def gather_experts(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The reference (E, ...) tensor from every ep rank's (E/ep, ...) slice."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


class ExpertDataParallel(nn.Module):
    """The data-parallel wrapper of a chunk holding experts: dense parameters averaged over
    `dp_group`, expert parameters summed over `edp_group` and divided by dp (module doc). Both
    halves are ``DataParallel`` bucketed all-reduces, overlapped with backward."""

    def __init__(self, chunk: nn.Module, dp_group: dist.ProcessGroup | None,
                 edp_group: dist.ProcessGroup | None, ep: int, bucket_mb: float = 25.0,
                 algorithm: str = "backend"):
        super().__init__()
        self.module = chunk
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
        dense = [p for n, p in named if not is_expert_param(n)]
        self.expert_params = [p for n, p in named if is_expert_param(n)]
        self.dense = DataParallel(chunk, dp_group, bucket_mb, algorithm, params=dense)
        self.experts = DataParallel(chunk, edp_group, bucket_mb, algorithm,
                                    params=self.expert_params, buffers=False)
        self.ep = ep

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        self.dense.finish_gradient_sync()
        if not self.experts._sync:
            return
        self.experts.finish_gradient_sync()  # the mean over edp
        for p in self.expert_params:
            if p.grad is not None:
                p.grad.div_(self.ep)
