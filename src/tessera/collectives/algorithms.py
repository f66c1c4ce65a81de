"""All-reduce, reduce-scatter and all-gather built from point-to-point rounds.

Algorithms (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1); Chan, Heimlich, Purkayastha & van de Geijn 2007,
"Collective communication: theory, practice, and experience", CCPE 19(13)):

- ``naive``: every rank sends its buffer to rank 0, which folds them in one after another, then
  sends the result to every rank, one after another. 2(N-1) rounds at the root.
- ``parallel``: every rank sends its whole buffer to every other rank in one round and folds
  all N buffers itself, in rank order, so every rank computes bit-identical sums.
- ``ring``: reduce-scatter around the ring (N-1 rounds, each rank ends with its reduced shard),
  then all-gather around the ring (N-1 rounds). Each rank sends 2(N-1)/N of the buffer.
- ``rabenseifner``: reduce-scatter by recursive halving, then all-gather by recursive doubling
  (2 log2 N rounds). When N is not a power of two, the first 2r ranks (r = N - 2^floor(log2 N))
  fold in pairs first, as MPICH does: even rank 2i hands its buffer to 2i+1 and sits out; the
  remaining 2^k ranks run the power-of-two algorithm; 2i+1 hands the result back to 2i.

Reduce-scatter and all-gather come as ``ring`` and ``recursive`` (halving / doubling with the
same fold for non-powers of two). Sharding follows :func:`tessera.collectives.p2p.shard_bounds`
(the ``torch.tensor_split`` rule), which equals torch's ``reduce_scatter_tensor`` when N
divides the size.

Invariants: after an all-reduce every rank holds bit-identical values (each element is reduced
at exactly one place and then copied); reduce-scatter and all-gather use the same shards, so
``all_gather(reduce_scatter(x), numel=x.numel())`` equals ``all_reduce(x)`` for ring and
recursive. Values travel in the tensor's own dtype (bytes are counted in it); each reduction
step computes in float32 for 16-bit floats and rounds once, so a bf16 ring all-reduce rounds
N-1 times per element and a naive or parallel one rounds once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tessera.collectives.cost_model import AlphaBeta, choose_algorithm, default_model
from tessera.collectives.p2p import (
    REDUCE_OPS,
    CommStats,
    PeerGroup,
    check_choice,
    combine_,
    shard_bounds,
    wide_accumulator,
)
from tessera.errors import ConfigError

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ALL_REDUCE_ALGORITHMS = ("naive", "parallel", "ring", "rabenseifner", "auto", "backend")
REDUCE_SCATTER_ALGORITHMS = ("ring", "recursive", "auto", "backend")
ALL_GATHER_ALGORITHMS = ("ring", "recursive", "auto", "backend")

Blocks = list[tuple[int, int]]


# ---------------------------------------------------------------------------------------------
# Building blocks: each works on a flat buffer, addressed by PeerGroup positions.


def _span(blocks: Blocks, first: int, stop: int) -> tuple[int, int]:
    """Element range covered by blocks[first:stop] (blocks are contiguous and in order)."""
    return blocks[first][0], blocks[stop - 1][1]


def ring_reduce_scatter_(pg: PeerGroup, buf: torch.Tensor, blocks: Blocks, op: str,
                         inplace: bool = True) -> torch.Tensor:
    """N-1 rounds; returns block `me` reduced over all ranks.

    Round k: send block (me-k-1) to the right neighbour, receive block (me-k-2) from the left
    and fold it into ours. Each rank sends every block but its own: S - |block me| elements.
    In place, partial sums overwrite buf's blocks; otherwise buf is only read and partial sums
    alternate between two block-sized buffers (2S/N extra memory instead of S).
    """
    n, me = pg.size, pg.rank
    right, left = (me + 1) % n, (me - 1) % n
    widest = max(b - a for a, b in blocks)
    partial = [] if inplace else [torch.empty(widest, dtype=buf.dtype, device=buf.device)
                                  for _ in range(2)]
    a, b = blocks[(me - 1) % n]
    outgoing = buf[a:b]
    for k in range(n - 1):
        a, b = blocks[(me - k - 2) % n]
        dst = buf[a:b] if inplace else partial[k % 2][: b - a]
        pg.reduce_round((right, outgoing), left, src=buf[a:b], dst=dst, op=op)
        outgoing = dst
    return outgoing if n > 1 else buf[blocks[me][0]:blocks[me][1]]


def ring_all_gather_(pg: PeerGroup, buf: torch.Tensor, blocks: Blocks) -> None:
    """buf[blocks[me]] is valid on entry; after N-1 rounds all of buf is.

    Round k: send block (me-k) right, receive block (me-k-1) from the left straight into place.
    Each rank sends every block but its right neighbour's: S - |block me+1| elements.
    """
    n, me = pg.size, pg.rank
    right, left = (me + 1) % n, (me - 1) % n
    for k in range(n - 1):
        s0, s1 = blocks[(me - k) % n]
        r0, r1 = blocks[(me - k - 1) % n]
        pg.round(sends=[(right, buf[s0:s1])], recvs=[(left, buf[r0:r1])])


def fold_layout(n: int) -> tuple[int, int, list[int]]:
    """MPICH's fold for non-powers of two: (p, r, position of each of the p virtual ranks).

    p = 2^floor(log2 n), r = n - p. Positions 2i and 2i+1 (i < r) pair up as virtual rank i,
    played by the odd one; position j >= 2r plays virtual rank j - r.
    """
    p = 1 << (n.bit_length() - 1)
    r = n - p
    return p, r, [2 * v + 1 if v < r else v + r for v in range(p)]


def _virtual_rank(me: int, r: int) -> int:
    return me // 2 if me < 2 * r else me - r


def halving_reduce_scatter_(pg: PeerGroup, buf: torch.Tensor, owned: bool, vblocks: Blocks,
                            v: int, vpos: list[int], op: str) -> tuple[torch.Tensor, int]:
    """Recursive halving over p = len(vblocks) (a power of two) virtual ranks.

    Each round halves the range of blocks this rank is responsible for: it sends the half its
    partner (v xor mask) keeps and folds in the partner's copy of the half it keeps. After
    log2 p rounds vblock v is reduced. Returns (tensor, offset): the tensor holds elements
    [offset, offset + len) and covers vblock v. If `owned`, buf is reduced in place; otherwise
    buf is only read and the first kept half goes to a new buffer (S/2).
    """
    p = len(vblocks)
    lo, hi = 0, p
    cur, base = buf, 0
    mask = p // 2
    while mask:
        partner = v ^ mask
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        k0, k1 = _span(vblocks, *keep)
        g0, g1 = _span(vblocks, *give)
        src = cur[k0 - base:k1 - base]
        dst = src if owned else torch.empty(k1 - k0, dtype=buf.dtype, device=buf.device)
        pg.reduce_round((vpos[partner], cur[g0 - base:g1 - base]), vpos[partner], src=src,
                        dst=dst, op=op)
        if not owned:
            cur, base, owned = dst, k0, True
        lo, hi = keep
        mask //= 2
    return cur, base


def doubling_all_gather_(pg: PeerGroup, buf: torch.Tensor, vblocks: Blocks, v: int,
                         vpos: list[int]) -> None:
    """Recursive doubling over p virtual ranks: round k swaps aligned groups of 2^k blocks."""
    p = len(vblocks)
    mask = 1
    while mask < p:
        partner = v ^ mask
        mine, theirs = (v // mask) * mask, (partner // mask) * mask
        m0, m1 = _span(vblocks, mine, mine + mask)
        t0, t1 = _span(vblocks, theirs, theirs + mask)
        pg.round(sends=[(vpos[partner], buf[m0:m1])], recvs=[(vpos[partner], buf[t0:t1])])
        mask *= 2


def recursive_reduce_scatter_(pg: PeerGroup, buf: torch.Tensor, blocks: Blocks, op: str,
                              inplace: bool = True) -> torch.Tensor:
    """Recursive halving with MPICH's fold; returns block `me` reduced over all ranks."""
    n, me = pg.size, pg.rank
    p, r, vpos = fold_layout(n)
    a, b = blocks[me]
    if me < 2 * r and me % 2 == 0:
        mine = buf[a:b] if inplace else torch.empty(b - a, dtype=buf.dtype, device=buf.device)
        pg.round(sends=[(me + 1, buf)])  # fold: my whole buffer to my odd partner
        pg.round(recvs=[(me + 1, mine)])  # unfold: my reduced shard
        return mine
    owned = inplace
    if me < 2 * r:
        dst = buf if inplace else torch.empty_like(buf)
        pg.reduce_round(None, me - 1, src=buf, dst=dst, op=op)
        buf, owned = dst, True
    # virtual rank v < r owns the shards of both positions 2v and 2v+1
    vblocks = [(blocks[2 * v][0], blocks[2 * v + 1][1]) if v < r else blocks[v + r]
               for v in range(p)]
    cur, base = halving_reduce_scatter_(pg, buf, owned, vblocks, _virtual_rank(me, r), vpos, op)
    if me < 2 * r:
        e0, e1 = blocks[me - 1]
        pg.round(sends=[(me - 1, cur[e0 - base:e1 - base])])
    return cur[a - base:b - base]


def recursive_all_gather_(pg: PeerGroup, buf: torch.Tensor, blocks: Blocks) -> None:
    """Recursive doubling with MPICH's fold; buf[blocks[me]] valid on entry, all of buf after."""
    n, me = pg.size, pg.rank
    p, r, vpos = fold_layout(n)
    if me < 2 * r and me % 2 == 0:
        s0, s1 = blocks[me]
        pg.round(sends=[(me + 1, buf[s0:s1])])
        pg.round(recvs=[(me + 1, buf[:s0]), (me + 1, buf[s1:])])  # all but my own shard
        return
    if me < 2 * r:
        pg.round(recvs=[(me - 1, buf[blocks[me - 1][0]:blocks[me - 1][1]])])
    vblocks = [(blocks[2 * v][0], blocks[2 * v + 1][1]) if v < r else blocks[v + r]
               for v in range(p)]
    doubling_all_gather_(pg, buf, vblocks, _virtual_rank(me, r), vpos)
    if me < 2 * r:
        s0, s1 = blocks[me - 1]
        pg.round(sends=[(me - 1, buf[:s0]), (me - 1, buf[s1:])])


# ---------------------------------------------------------------------------------------------
# All-reduce algorithms: buf is this rank's flat contribution on entry and the result on exit.


def naive_all_reduce_(pg: PeerGroup, buf: torch.Tensor, op: str) -> None:
    n, me = pg.size, pg.rank
    if me != 0:
        pg.round(sends=[(0, buf)])
        pg.round(recvs=[(0, buf)])
        return
    widen = op in ("sum", "avg") and buf.dtype in (torch.bfloat16, torch.float16)
    acc = wide_accumulator(buf, op) if widen else buf
    for src in range(1, n):
        pg.reduce_round(None, src, src=acc, dst=acc, op=op, wire=buf.dtype)
    if acc is not buf:
        buf.copy_(acc)
    for dst in range(1, n):
        pg.round(sends=[(dst, buf)])


def parallel_all_reduce_(pg: PeerGroup, buf: torch.Tensor, op: str) -> None:
    """One round: send buf to every rank, fold all N buffers in rank order (0, 1, ..., N-1) on
    every rank, so all ranks compute the same sums bit for bit. Messages are folded segment by
    segment as they arrive, so the scratch is one S-sized accumulator, not N buffers."""
    n, me = pg.size, pg.rank
    sends = [(p, buf) for p in range(n) if p != me]
    works = pg.post_sends(sends)
    widen = op in ("sum", "avg") and buf.dtype in (torch.bfloat16, torch.float16)
    acc = torch.empty(buf.numel(), dtype=torch.float32 if widen else buf.dtype,
                      device=buf.device)
    for src in range(n):
        if src == me:
            if src == 0:
                acc.copy_(buf)
            else:
                combine_(acc, acc, buf, op)
        else:
            pg.fold_from(src, acc, acc, "copy" if src == 0 else op, wire=buf.dtype)
    for w in works:
        w.wait()
    pg.record_round(sends, (n - 1) * buf.numel() * buf.element_size())
    buf.copy_(acc)


def ring_all_reduce_(pg: PeerGroup, buf: torch.Tensor, op: str) -> None:
    blocks = shard_bounds(buf.numel(), pg.size)
    ring_reduce_scatter_(pg, buf, blocks, op, inplace=True)
    ring_all_gather_(pg, buf, blocks)


def rabenseifner_all_reduce_(pg: PeerGroup, buf: torch.Tensor, op: str) -> None:
    n, me = pg.size, pg.rank
    p, r, vpos = fold_layout(n)
    if me < 2 * r and me % 2 == 0:
        pg.round(sends=[(me + 1, buf)])
        pg.round(recvs=[(me + 1, buf)])
        return
    if me < 2 * r:
        pg.reduce_round(None, me - 1, src=buf, dst=buf, op=op)
    vblocks = shard_bounds(buf.numel(), p)
    v = _virtual_rank(me, r)
    halving_reduce_scatter_(pg, buf, True, vblocks, v, vpos, op)
    doubling_all_gather_(pg, buf, vblocks, v, vpos)
    if me < 2 * r:
        pg.round(sends=[(me - 1, buf)])


_ALL_REDUCE: dict[str, Callable[[PeerGroup, torch.Tensor, str], None]] = {
    "naive": naive_all_reduce_,
    "parallel": parallel_all_reduce_,
    "ring": ring_all_reduce_,
    "rabenseifner": rabenseifner_all_reduce_,
}
_REDUCE_SCATTER = {"ring": ring_reduce_scatter_, "recursive": recursive_reduce_scatter_}
_ALL_GATHER = {"ring": ring_all_gather_, "recursive": recursive_all_gather_}

_TORCH_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN}  # gloo has no AVG: sum, then divide


def _check_reduce_args(tensor: torch.Tensor, op: str, algorithm: str,
                       allowed: tuple[str, ...]) -> None:
    check_choice("algorithm", algorithm, allowed)
    check_choice("op", op, REDUCE_OPS)
    if op == "avg" and not tensor.is_floating_point():
        raise ConfigError("op", op, f"needs a floating-point tensor, got {tensor.dtype}")


def _resolve(collective: str, algorithm: str, tensor_bytes: int, world: int,
             model: AlphaBeta | None) -> str:
    if algorithm != "auto":
        return algorithm
    return choose_algorithm(collective, tensor_bytes, world, model or default_model())


# ---------------------------------------------------------------------------------------------
# Public collectives.


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: str = "sum",
               algorithm: str = "ring", stats: CommStats | None = None, *,
               model: AlphaBeta | None = None) -> torch.Tensor:
    """Reduce `tensor` over `group` in place (any shape, any size) and return it.

    op: "sum", "avg", "max" or "min". algorithm: "naive", "parallel", "ring", "rabenseifner",
    "auto" (cheapest under `model`, default :func:`default_model`) or "backend"
    (``dist.all_reduce``, whose traffic is not counted). `stats` accumulates this rank's bytes
    and rounds. Every rank gets bit-identical values.
    """
    _check_reduce_args(tensor, op, algorithm, ALL_REDUCE_ALGORITHMS)
    if algorithm == "backend":
        world = dist.get_world_size(group)
        if stats is not None:
            stats.calls += 1
        dist.all_reduce(tensor, op=_TORCH_OP[op], group=group)
        if op == "avg":
            tensor.div_(world)
        return tensor
    pg = PeerGroup(group, stats)
    if pg.size == 1:
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    algorithm = _resolve("all_reduce", algorithm, nbytes, pg.size, model)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    _ALL_REDUCE[algorithm](pg, flat, op)
    if op == "avg":
        flat.div_(pg.size)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                   op: str = "sum", algorithm: str = "ring", stats: CommStats | None = None, *,
                   model: AlphaBeta | None = None) -> torch.Tensor:
    """Reduce the full buffer `tensor` (read as flat) over `group`; return this rank's shard.

    The shard of group rank r is ``torch.tensor_split(flat, N)[r]``: with n elements the first
    n % N ranks get n // N + 1 elements, the others n // N (see :func:`shard_bounds`). When N
    divides n this is exactly ``reduce_scatter_tensor``'s output. `tensor` is not modified; the
    result is a new 1-D tensor. algorithm: "ring", "recursive", "auto" or "backend". Scratch
    memory: 2S/N for ring, S/2 for recursive (S when N is not a power of two).
    """
    _check_reduce_args(tensor, op, algorithm, REDUCE_SCATTER_ALGORITHMS)
    world = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    blocks = shard_bounds(flat.numel(), world)
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        me = dist.get_rank(group)
        start, stop = blocks[me]
        if flat.numel() % world == 0:
            out = torch.empty(stop - start, dtype=flat.dtype, device=flat.device)
            reduce_scatter_single(out, flat.contiguous(), op=_TORCH_OP[op], group=group)
        else:  # unequal shards: torch has no such reduce-scatter, so reduce everything
            full = flat.clone()
            dist.all_reduce(full, op=_TORCH_OP[op], group=group)
            out = full[start:stop].clone()
    else:
        pg = PeerGroup(group, stats)
        start, stop = blocks[pg.rank]
        if pg.size == 1:
            out = flat.clone()
        else:
            nbytes = flat.numel() * flat.element_size()
            algorithm = _resolve("reduce_scatter", algorithm, nbytes, pg.size, model)
            shard = _REDUCE_SCATTER[algorithm](pg, flat.contiguous(), blocks, op, inplace=False)
            # a view into scratch of S/N (ring) or up to S (recursive fold): keep only the shard
            out = shard.clone() if shard.untyped_storage().nbytes() > 2 * shard.nbytes \
                else shard
    if op == "avg":
        out.div_(world)
    return out


def all_gather(shard: torch.Tensor, group: dist.ProcessGroup | None = None,
               algorithm: str = "ring", stats: CommStats | None = None, *,
               numel: int | None = None, model: AlphaBeta | None = None) -> torch.Tensor:
    """Concatenate every rank's `shard` in group-rank order; the inverse of reduce_scatter.

    Without `numel` all shards must have the same shape and the result has shape
    ``(N * shard.shape[0], *shard.shape[1:])`` (a 0-d shard counts as shape (1,)), like
    ``all_gather_into_tensor``. With `numel` the shards follow :func:`shard_bounds` (so sizes
    may differ by one element) and the result is flat with `numel` elements.
    algorithm: "ring", "recursive", "auto" or "backend".
    """
    check_choice("algorithm", algorithm, ALL_GATHER_ALGORITHMS)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    piece = shard.reshape(-1)
    if numel is None:
        k = piece.numel()
        blocks = [(i * k, (i + 1) * k) for i in range(world)]
        shape = (world * shard.shape[0], *shard.shape[1:]) if shard.dim() else (world,)
    else:
        blocks = shard_bounds(numel, world)
        shape = (numel,)
        want = blocks[me][1] - blocks[me][0]
        if piece.numel() != want:
            raise ConfigError("shard.numel()", piece.numel(),
                              f"must be {want}: rank {me}'s shard of numel={numel} over "
                              f"{world} ranks")
    total = blocks[-1][1]
    out = torch.empty(total, dtype=shard.dtype, device=shard.device)
    out[blocks[me][0]:blocks[me][1]] = piece
    if algorithm == "backend":
        if stats is not None:
            stats.calls += 1
        _backend_all_gather(out, piece, blocks, group)
        return out.view(shape)
    pg = PeerGroup(group, stats)
    if pg.size > 1:
        algorithm = _resolve("all_gather", algorithm, total * out.element_size(), pg.size, model)
        _ALL_GATHER[algorithm](pg, out, blocks)
    return out.view(shape)


def _backend_all_gather(out: torch.Tensor, piece: torch.Tensor, blocks: Blocks,
                        group: dist.ProcessGroup | None) -> None:
    fn = all_gather_single
    world = len(blocks)
    widest = max(b - a for a, b in blocks)
    if all(b - a == widest for a, b in blocks):
        fn(out, piece.contiguous(), group=group)
        return
    # torch needs equal shards: pad, then trim
    padded = torch.zeros(widest, dtype=piece.dtype, device=piece.device)
    padded[: piece.numel()] = piece
    gathered = torch.empty(world * widest, dtype=piece.dtype, device=piece.device)
    fn(gathered, padded, group=group)
    for i, (a, b) in enumerate(blocks):
        out[a:b] = gathered[i * widest: i * widest + (b - a)]

