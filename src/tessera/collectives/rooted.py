"""Broadcast, reduce, scatter, gather and all-to-all built from point-to-point rounds.

Rooted collectives use binomial trees (Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH", sections 3-4): ranks are renumbered relative to
the root (position = (group rank - root) mod N); position i's parent is i minus its lowest set
bit, and its subtree is positions [i, i + lowbit(i)). A tree collective takes ceil(log2 N)
rounds on its critical path.

- broadcast ``binomial``: the root's buffer goes down the tree, ceil(log2 N)(alpha + S beta).
- broadcast ``scatter_allgather`` (van de Geijn; Chan et al. 2007): binomial scatter of N
  shards, then ring all-gather: about 2(N-1)/N S beta instead of log2 N S beta, for long messages.
- reduce ``binomial``: partial results go up the tree; each node folds its children in fixed
  order (float32 for 16-bit floats) and rounds once before sending up.
- scatter / gather ``binomial``: subtrees' blocks go down / up; (N-1)/N S beta in total.
- all-to-all ``pairwise``: in round k = 1..N-1 rank r sends block r+k to rank r+k and receives
  block r-k from rank r-k (N-1 rounds, (N-1)/N S beta).

Roots are GROUP ranks (torch's ``group_src``/``group_dst``), not global ranks. Every
algorithm also has ``"backend"``, which calls torch.distributed's own collective (uncounted).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.collectives.algorithms import _TORCH_OP, ring_all_gather_
from tessera.collectives.p2p import (
    REDUCE_OPS,
    CommStats,
    PeerGroup,
    check_choice,
    shard_bounds,
    wide_accumulator,
)
from tessera.errors import ConfigError

BROADCAST_ALGORITHMS = ("binomial", "scatter_allgather", "backend")
REDUCE_ALGORITHMS = ("binomial", "backend")
SCATTER_ALGORITHMS = ("binomial", "backend")
GATHER_ALGORITHMS = ("binomial", "backend")
ALL_TO_ALL_ALGORITHMS = ("pairwise", "backend")


def _relative(group: dist.ProcessGroup | None, root: int, stats: CommStats | None) -> PeerGroup:
    """The group renumbered so that `root` is position 0."""
    world = dist.get_world_size(group)
    return PeerGroup(group, stats, order=[(root + i) % world for i in range(world)])


def _check_root(group: dist.ProcessGroup | None, root: int) -> None:
    world = dist.get_world_size(group)
    if not 0 <= root < world:
        raise ConfigError("root", root, f"must be a group rank in [0, {world})")


def _lowbit(i: int) -> int:
    return i & -i


def binomial_broadcast_(pg: PeerGroup, buf: torch.Tensor) -> None:
    """Position 0's buf reaches every position: receive from the parent, then feed children."""
    n, me = pg.size, pg.rank
    mask = _lowbit(me) if me else 1 << n.bit_length()
    if me:
        pg.round(recvs=[(me - mask, buf)])
    mask >>= 1
    while mask:
        if me + mask < n:
            pg.round(sends=[(me + mask, buf)])
        mask >>= 1


def binomial_scatter_(pg: PeerGroup, buf: torch.Tensor, blocks: list[tuple[int, int]],
                      offset: int) -> None:
    """Position 0 holds every block; afterwards position i holds blocks[i].

    `buf` covers elements [offset, offset + len) of the blocks' index space: the whole space at
    the root, the rank's subtree elsewhere.
    """
    n, me = pg.size, pg.rank

    def subtree(i: int, width: int) -> torch.Tensor:
        a, b = blocks[i][0], blocks[min(i + width, n) - 1][1]
        return buf[a - offset:b - offset]

    mask = _lowbit(me) if me else 1 << n.bit_length()
    if me:
        pg.round(recvs=[(me - mask, subtree(me, mask))])
    mask >>= 1
    while mask:
        if me + mask < n:
            pg.round(sends=[(me + mask, subtree(me + mask, mask))])
        mask >>= 1


def binomial_gather_(pg: PeerGroup, buf: torch.Tensor, blocks: list[tuple[int, int]],
                     offset: int) -> None:
    """Mirror of binomial_scatter_: position i's subtree blocks flow up to position 0."""
    n, me = pg.size, pg.rank

    def subtree(i: int, width: int) -> torch.Tensor:
        a, b = blocks[i][0], blocks[min(i + width, n) - 1][1]
        return buf[a - offset:b - offset]

    mask = 1
    while mask < n:
        if me & mask:
            pg.round(sends=[(me - mask, subtree(me, mask))])
            return
        if me + mask < n:
            pg.round(recvs=[(me + mask, subtree(me + mask, mask))])
        mask <<= 1


def binomial_reduce_(pg: PeerGroup, buf: torch.Tensor, op: str) -> torch.Tensor:
    """Fold every position's buf up the tree; returns the result (meaningful at position 0).

    `buf` itself is not modified.
    """
    n, me = pg.size, pg.rank
    acc: torch.Tensor | None = None
    mask = 1
    while mask < n:
        if me & mask:
            partial = buf if acc is None else acc.to(buf.dtype)
            pg.round(sends=[(me - mask, partial)])
            return partial
        if me + mask < n:
            if acc is None:
                acc = wide_accumulator(buf, op)
            pg.reduce_round(None, me + mask, src=acc, dst=acc, op=op, wire=buf.dtype)
        mask <<= 1
    return buf.clone() if acc is None else acc.to(buf.dtype)


def broadcast(tensor: torch.Tensor, root: int = 0, group: dist.ProcessGroup | None = None,
              algorithm: str = "binomial", stats: CommStats | None = None) -> torch.Tensor:
    """Copy group rank `root`'s `tensor` into `tensor` on every rank (in place); returns it."""
    check_choice("algorithm", algorithm, BROADCAST_ALGORITHMS)
    _check_root(group, root)
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        dist.broadcast(tensor, src=_global(group, root), group=group)
        return tensor
    pg = _relative(group, root, stats)
    if pg.size == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    if algorithm == "binomial":
        binomial_broadcast_(pg, flat)
    else:  # scatter_allgather: shard i belongs to position i (root-relative)
        blocks = shard_bounds(flat.numel(), pg.size)
        binomial_scatter_(pg, flat, blocks, offset=0)
        ring_all_gather_(pg, flat, blocks)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def reduce(tensor: torch.Tensor, root: int = 0, group: dist.ProcessGroup | None = None,
           op: str = "sum", algorithm: str = "binomial",
           stats: CommStats | None = None) -> torch.Tensor:
    """Reduce `tensor` over the group into `tensor` on group rank `root` (in place).

    Other ranks' tensors are left unchanged. Returns `tensor`.
    """
    check_choice("algorithm", algorithm, REDUCE_ALGORITHMS)
    check_choice("op", op, REDUCE_OPS)
    if op == "avg" and not tensor.is_floating_point():
        raise ConfigError("op", op, f"needs a floating-point tensor, got {tensor.dtype}")
    _check_root(group, root)
    world = dist.get_world_size(group)
    is_root = dist.get_rank(group) == root
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        work = tensor if is_root else tensor.clone()  # gloo may scribble on non-root inputs
        dist.reduce(work, dst=_global(group, root), op=_TORCH_OP[op], group=group)
    else:
        pg = _relative(group, root, stats)
        flat = tensor.reshape(-1)
        result = binomial_reduce_(pg, flat.contiguous(), op)
        if is_root:
            tensor.copy_(result.view(tensor.shape))
    if is_root and op == "avg":
        tensor.div_(world)
    return tensor


def scatter(output: torch.Tensor, input: torch.Tensor | None = None, root: int = 0,
            group: dist.ProcessGroup | None = None, algorithm: str = "binomial",
            stats: CommStats | None = None) -> torch.Tensor:
    """Group rank `root`'s `input` (N * output.numel() elements, rank order) is cut into N
    equal blocks; block r lands in `output` on group rank r. Returns `output`."""
    check_choice("algorithm", algorithm, SCATTER_ALGORITHMS)
    _check_root(group, root)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    k = output.numel()
    if me == root:
        if input is None or input.numel() != world * k:
            got = None if input is None else input.numel()
            raise ConfigError("input.numel()", got, f"must be N * output.numel() = {world * k} "
                              "on the root")
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        pieces = list(input.reshape(world, k)) if me == root else None
        out = torch.empty(k, dtype=output.dtype, device=output.device)
        dist.scatter(out, pieces, src=_global(group, root), group=group)
        output.copy_(out.view(output.shape))
        return output
    pg = _relative(group, root, stats)
    blocks = [(i * k, (i + 1) * k) for i in range(world)]
    if pg.rank == 0:  # rotate so that block i belongs to position i
        flat = input.reshape(-1)
        work = torch.cat([flat[root * k:], flat[:root * k]])
    else:  # room for my subtree's blocks; my own block comes first
        width = min(_lowbit(pg.rank), world - pg.rank)
        work = torch.empty(width * k, dtype=output.dtype, device=output.device)
    binomial_scatter_(pg, work, blocks, offset=pg.rank * k)
    output.copy_(work[:k].view(output.shape))
    return output


def gather(tensor: torch.Tensor, root: int = 0, group: dist.ProcessGroup | None = None,
           algorithm: str = "binomial", stats: CommStats | None = None) -> torch.Tensor | None:
    """Concatenate every rank's equally shaped `tensor` in group-rank order on rank `root`.

    Returns shape ``(N * tensor.shape[0], *tensor.shape[1:])`` on the root (0-d counts as
    (1,)) and None elsewhere.
    """
    check_choice("algorithm", algorithm, GATHER_ALGORITHMS)
    _check_root(group, root)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    k = tensor.numel()
    shape = (world * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (world,)
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        out = (torch.empty(world * k, dtype=tensor.dtype, device=tensor.device) if me == root
               else None)
        pieces = list(out.view(world, k)) if out is not None else None
        dist.gather(tensor.reshape(-1).contiguous(), pieces, dst=_global(group, root),
                    group=group)
        return out.view(shape) if out is not None else None
    pg = _relative(group, root, stats)
    blocks = [(i * k, (i + 1) * k) for i in range(world)]
    width = min(_lowbit(pg.rank), world - pg.rank) if pg.rank else world
    # my subtree's blocks, position order
    work = torch.empty(width * k, dtype=tensor.dtype, device=tensor.device)
    work[:k] = tensor.reshape(-1)
    binomial_gather_(pg, work, blocks, offset=pg.rank * k)
    if pg.rank != 0:
        return None
    shift = (world - root) % world * k  # position order -> group-rank order
    return torch.cat([work[shift:], work[:shift]]).view(shape)


def all_to_all(input: torch.Tensor, group: dist.ProcessGroup | None = None,
               algorithm: str = "pairwise", stats: CommStats | None = None) -> torch.Tensor:
    """Block j of this rank's `input` (flat, N equal blocks) goes to group rank j; returns the
    tensor whose block i came from rank i (same shape as `input`)."""
    check_choice("algorithm", algorithm, ALL_TO_ALL_ALGORITHMS)
    world = dist.get_world_size(group)
    if input.numel() % world:
        raise ConfigError("input.numel()", input.numel(),
                          f"must be divisible by the group size {world}")
    flat = input.reshape(-1).contiguous()
    out = torch.empty_like(flat)
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        dist.all_to_all_single(out, flat, group=group)
        return out.view(input.shape)
    pg = PeerGroup(group, stats)
    n, me, k = pg.size, pg.rank, flat.numel() // world
    out[me * k:(me + 1) * k] = flat[me * k:(me + 1) * k]
    for step in range(1, n):
        dst, src = (me + step) % n, (me - step) % n
        pg.round(sends=[(dst, flat[dst * k:(dst + 1) * k])],
                 recvs=[(src, out[src * k:(src + 1) * k])])
    return out.view(input.shape)


def all_to_all_v(input: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                 group: dist.ProcessGroup | None = None, algorithm: str = "pairwise",
                 stats: CommStats | None = None) -> torch.Tensor:
    """All-to-all with variable split sizes along dim 0: rows [sum(send_splits[:j]), ...) of
    `input` go to group rank j; returns (sum(recv_splits), *input.shape[1:]) whose i-th block of
    recv_splits[i] rows came from rank i (torch's ``all_to_all_single`` with split sizes).
    ``pairwise``: in round k = 1..N-1 send to r+k and receive from r-k; empty blocks are not
    sent."""
    check_choice("algorithm", algorithm, ALL_TO_ALL_ALGORITHMS)
    rest = tuple(input.shape[1:])
    inp = input.contiguous()
    out = inp.new_empty((sum(recv_splits), *rest))
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        dist.all_to_all_single(out, inp, output_split_sizes=list(recv_splits),
                               input_split_sizes=list(send_splits), group=group)
        return out
    pg = PeerGroup(group, stats)
    n, me = pg.size, pg.rank
    send_at = [0]
    for c in send_splits:
        send_at.append(send_at[-1] + c)
    recv_at = [0]
    for c in recv_splits:
        recv_at.append(recv_at[-1] + c)
    flat_in, flat_out = inp.view(inp.shape[0], -1), out.view(out.shape[0], -1)
    flat_out[recv_at[me]:recv_at[me + 1]] = flat_in[send_at[me]:send_at[me + 1]]
    for step in range(1, n):
        dst, src = (me + step) % n, (me - step) % n
        send = flat_in[send_at[dst]:send_at[dst + 1]].reshape(-1)
        recv = flat_out[recv_at[src]:recv_at[src + 1]].reshape(-1)
        pg.round(sends=[(dst, send)] if send.numel() else [],
                 recvs=[(src, recv)] if recv.numel() else [])
    return out


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)
