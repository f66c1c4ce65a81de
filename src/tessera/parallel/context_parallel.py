"""Context parallelism: causal attention over a sequence split across the cp group.

Every rank of a cp group holds 1/cp of each sequence: its tokens go through the embedding,
norms, MLP and head alone, and only attention needs the other ranks' keys and values. Four ways
to get them, each an autograd Function (or a pair) so that backward is as explicit as forward:

- **ring** (Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers", 2023): each
  rank keeps its queries; the (K, V) blocks travel around the ring, one p2p send to the next
  rank per step, posted before the step's block product so the transfer overlaps compute.
  Partial results merge by the online-softmax rule (Milakov & Gimelshein 2018; FlashAttention):
  ``lse = logaddexp(lse₁, lse₂)``, ``o = o₁·e^(lse₁−lse) + o₂·e^(lse₂−lse)``. Backward sends
  the (K, V) blocks around again with their gradient accumulators (dK, dV), which arrive back at
  their owner after cp hops; the whole K/V is never gathered. Each pair of T/(2·cp)-token
  chunks is one block: on CPU torch's fused attention kernel (it returns the log-sum-exp;
  causal on the diagonal, unmasked below), elsewhere an explicit masked product. Per rank per
  layer, forward sends (cp−1)·|KV_local| and backward (cp−1)·|KV_local| + cp·|dKV_local|.
- **allgather** (Llama 3, Dubey et al. 2024, §3.3.2): K/V of the whole sequence are all-gathered,
  local queries attend to them (chunk pairs above the diagonal skipped, as in the ring), dK/dV
  are reduce-scattered back. Backward all-gathers K/V again
  instead of keeping the full copy (the memory-saving form): forward (cp−1)/cp·|KV_full|,
  backward (cp−1)/cp·|KV_full| gathered + (cp−1)/cp·|dKV_full| reduce-scattered.
- **ulysses** (Jacobs et al., "DeepSpeed Ulysses", 2023): an all-to-all turns sequence-sharded
  q, k, v (B, H, T/cp, d) into head-sharded full sequences (B, H/cp, T, d); attention is local;
  the inverse all-to-all returns the output. Query heads (after tp) must divide by cp; kv heads
  fewer than cp are replicated to cp (each rank needs one); otherwise refused. Bytes per rank
  per layer: forward (cp−1)/cp·(|q|+|k|+|v|+|o|) of local tensors (k, v after replication),
  backward the same.
- **hybrid** (USP, Fang & Zhao 2024): Ulysses inside groups of ``cp_ulysses`` consecutive cp
  ranks, ring across the groups (``hybrid_groups``).

Sequence layout. The sequence is cut into 2·cp chunks of T/(2·cp) tokens; rank r holds chunks
r and 2·cp−1−r (**zig-zag**, the load balancing of Llama 3's context parallelism), so every
rank does the same number of causal block products (2·cp+1 chunk pairs per layer).
``layout='contiguous'`` (rank r holds chunks 2r, 2r+1) is kept to show the imbalance it causes
(4r+3 pairs on rank r). Sequence lengths that are not a multiple of 2·cp are refused
(``tessera.layout.validate``); padding would change the loss normalization of every rank.
A rank's tokens are identified by their global positions (``sequence_positions``), which also
index the RoPE tables; the attention kernels take positions, not a layout.

The ring and all-gather kernels, and the blockwise causal products with a log-sum-exp they
share, are in ``ring_attention.py``; this module holds the layouts, Ulysses' all-to-alls and the
attention core a cp rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.model import AttentionCore
from tessera.parallel.comm import CommStats, conjugate, group_rank, group_size
from tessera.parallel.ring_attention import SEQ, AllGatherAttention, RingAttention, WorkLog

METHODS = ("ring", "allgather", "ulysses", "hybrid")
LAYOUTS = ("zigzag", "contiguous")


# ---------------------------------------------------------------------------------------------
# Sequence layout


def sequence_positions(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Global positions (in local order) of the tokens cp rank `rank` holds: (seq_len/cp,)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} must be a multiple of 2*cp={2 * cp}")
    c = seq_len // (2 * cp)
    chunks = (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int,
                   layout: str = "zigzag") -> torch.Tensor:
    """This cp rank's tokens of `x` along `dim` (which has the whole sequence)."""
    pos = sequence_positions(x.shape[dim], cp, rank, layout).to(x.device)
    return x.index_select(dim, pos)


def unshard_sequence(parts: list[torch.Tensor], dim: int, layout: str = "zigzag"
                     ) -> torch.Tensor:
    """Inverse of shard_sequence: the whole sequence from every rank's part (rank order)."""
    cp = len(parts)
    T = parts[0].shape[dim] * cp
    pos = torch.cat([sequence_positions(T, cp, r, layout) for r in range(cp)])
    out = torch.cat(parts, dim)
    return out.index_select(dim, torch.argsort(pos).to(out.device))


# ---------------------------------------------------------------------------------------------
# Ulysses


def _all_to_all(x: torch.Tensor, group, stats, tag, phase) -> torch.Tensor:
    """x (n, ...) -> (n, ...): row j goes to rank j, row j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    if stats is not None:
        stats.record(tag, "all_to_all", phase, x.numel(), x.element_size(), x.shape[0])
    return out


def _seq_to_heads(x, group, stats, tag, phase):
    """(B, H, L, d) sequence-sharded -> (B, H/n, n·L, d) head-sharded, ranks' tokens in rank
    order."""
    n = group_size(group)
    B, H, L, d = x.shape
    rows = x.view(B, n, H // n, L, d).movedim(1, 0)  # (n, B, H/n, L, d): head group j to rank j
    got = _all_to_all(rows, group, stats, tag, phase)  # (n[src], B, H/n, L, d)
    return got.movedim(0, 2).reshape(B, H // n, n * L, d)


def _heads_to_seq(x, group, stats, tag, phase):
    """Inverse of _seq_to_heads: (B, H/n, n·L, d) -> (B, H, L, d)."""
    n = group_size(group)
    B, h, T, d = x.shape
    rows = x.view(B, h, n, T // n, d).movedim(2, 0)  # (n, B, H/n, L, d): tokens of rank j
    got = _all_to_all(rows, group, stats, tag, phase)  # (n[head group], B, H/n, L, d)
    return got.movedim(0, 1).reshape(B, n * h, T // n, d)


seq_to_heads = conjugate("SeqToHeads", _seq_to_heads, _heads_to_seq,
                         "Ulysses' all-to-all, sequence-sharded -> head-sharded; the inverse "
                         "all-to-all backward.")
heads_to_seq = conjugate("HeadsToSeq", _heads_to_seq, _seq_to_heads,
                         "Ulysses' inverse all-to-all, head-sharded -> sequence-sharded; the "
                         "forward all-to-all backward.")


def ulysses_kv_repeat(n_heads: int, n_kv_heads: int, n: int) -> int:
    """How many times each kv head is repeated before the all-to-all (1: none). Raises with
    the rule when the heads cannot be split n ways."""
    if n_heads % n:
        raise ValueError(f"ulysses: query heads per tp rank ({n_heads}) must be divisible by "
                         f"the Ulysses degree {n}")
    if n_kv_heads % n == 0:
        return 1
    if n % n_kv_heads == 0:
        return n // n_kv_heads  # each rank gets one copy of the kv head its queries read
    raise ValueError(f"ulysses: kv heads per tp rank ({n_kv_heads}) must divide or be a "
                     f"multiple of the Ulysses degree {n}")


def ulysses_split(q, k, v, group, stats, tag):
    """q, k, v sequence-sharded -> head-sharded over the whole group's tokens."""
    rep = ulysses_kv_repeat(q.shape[1], k.shape[1], group_size(group))
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return tuple(seq_to_heads(x, group, stats, tag) for x in (q, k, v))


def _local_attention(q, k, v, pos_all, scale):
    """Causal attention over a whole gathered sequence given its positions: permuted into
    position order and run through SDPA (differentiable, as the reference)."""
    order = torch.argsort(pos_all).to(q.device)
    inv = torch.argsort(order)
    q, k, v = (t.index_select(SEQ, order) for t in (q, k, v))
    y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])
    return y.index_select(SEQ, inv)


# ---------------------------------------------------------------------------------------------
# The attention core a cp rank runs


@dataclass
class CPContext:
    """What a context-parallel attention core needs: groups are passed in, never looked up."""

    group: dist.ProcessGroup | None
    """The cp group (all methods)."""
    method: str = "ring"
    layout: str = "zigzag"
    ulysses_group: dist.ProcessGroup | None = None
    """hybrid: this rank's Ulysses group (consecutive cp ranks)."""
    ring_group: dist.ProcessGroup | None = None
    """hybrid: this rank's ring group (one rank of each Ulysses group)."""
    stats: CommStats | None = None
    work: WorkLog = field(default_factory=WorkLog)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"cp_method={self.method!r}: must be one of {', '.join(METHODS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: must be one of {', '.join(LAYOUTS)}")

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def positions(self, local_len: int) -> torch.Tensor:
        """(cp, L): global positions of every cp rank's tokens."""
        T = local_len * self.size
        return torch.stack([sequence_positions(T, self.size, r, self.layout)
                            for r in range(self.size)])


class ContextParallelAttention(AttentionCore):
    """Drop-in for ``model.AttentionCore`` on a cp rank: q (B, nh, L, d), k/v (B, nkv, L, d)
    of this rank's tokens -> (B, nh, L, d). No parameters; rank-aware only through `ctx`. A
    subclass of the core so selective recomputation still finds it (recomputing re-runs the
    method's forward communication in backward)."""

    def __init__(self, ctx: CPContext, tag: str = "attention"):
        super().__init__()
        self.ctx, self.tag = ctx, tag

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.ctx
        scale = q.shape[-1] ** -0.5
        pos = c.positions(q.shape[SEQ])  # (cp, L)
        chunk = q.shape[SEQ] // 2  # T/(2·cp) tokens: the zig-zag chunk
        if c.method == "ring":
            return RingAttention.apply(q, k, v, pos, c.group, scale, c.stats, self.tag, c.work,
                                      chunk)
        if c.method == "allgather":
            return AllGatherAttention.apply(q, k, v, pos, c.group, scale, c.stats, self.tag,
                                            c.work, chunk)
        if c.method == "ulysses":
            qh, kh, vh = ulysses_split(q, k, v, c.group, c.stats, self.tag)
            y = _local_attention(qh, kh, vh, pos.reshape(-1), scale)
            return heads_to_seq(y, c.group, c.stats, self.tag)
        # hybrid: Ulysses inside the group, ring across groups
        u = group_size(c.ulysses_group)
        qh, kh, vh = ulysses_split(q, k, v, c.ulysses_group, c.stats, self.tag)
        ring_pos = pos.view(-1, u * pos.shape[1])  # ring member j holds Ulysses group j's tokens
        y = RingAttention.apply(qh, kh, vh, ring_pos, c.ring_group, scale, c.stats, self.tag,
                                c.work, chunk)
        return heads_to_seq(y, c.ulysses_group, c.stats, self.tag)


def phase_bytes(method: str, cp: int, batch: int, n_heads: int, n_kv_heads: int,
                local_len: int, head_dim: int, element_size: int = 4, ulysses: int = 2
                ) -> list[tuple[str, int, dict[str, float]]]:
    """(pure method, group size, bytes) of each communication phase of one attention layer:
    one phase for ring, allgather and ulysses (over the cp group); for hybrid Ulysses'
    all-to-alls over `ulysses` ranks, then the ring over cp/ulysses ranks, which carries
    n_heads/ulysses query heads (and the replicated kv heads split as many ways) of
    ulysses·local_len tokens. A phase over one rank sends nothing and is left out. Bytes per
    rank and micro-batch, forward and backward: the formulas of the module doc."""
    if method not in METHODS:
        raise ValueError(f"cp_method={method!r}: must be one of {', '.join(METHODS)}")
    if cp == 1:
        return []
    if method == "hybrid":
        kv_rep = n_kv_heads * ulysses_kv_repeat(n_heads, n_kv_heads, ulysses)
        return (phase_bytes("ulysses", ulysses, batch, n_heads, n_kv_heads, local_len,
                            head_dim, element_size)
                + phase_bytes("ring", cp // ulysses, batch, n_heads // ulysses,
                              kv_rep // ulysses, local_len * ulysses, head_dim, element_size))
    kv = 2 * batch * n_kv_heads * local_len * head_dim * element_size  # |K|+|V| local
    share = (cp - 1) / cp
    if method == "ring":
        sent = {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv + cp * kv * 4 // element_size}
    elif method == "allgather":
        sent = {"forward": share * cp * kv, "backward": 2 * share * cp * kv}
    else:  # ulysses
        q = batch * n_heads * local_len * head_dim * element_size
        kv_sent = kv * ulysses_kv_repeat(n_heads, n_kv_heads, cp)
        one_way = share * (2 * q + kv_sent)  # q, k, v in; the output back
        sent = {"forward": one_way, "backward": one_way}
    return [(method, cp, sent)]


def bytes_per_layer(method: str, cp: int, batch: int, n_heads: int, n_kv_heads: int,
                    local_len: int, head_dim: int, element_size: int = 4,
                    ulysses: int = 2) -> dict[str, float]:
    """Bytes one rank sends per attention layer and micro-batch, forward and backward: the
    formulas of the module doc (heads per tp rank; L = local_len = T/cp tokens; the ring's
    dK/dV accumulators travel in fp32 whatever `element_size` the activations have), summed
    over the method's phases (:func:`phase_bytes`)."""
    total = {"forward": 0.0, "backward": 0.0}
    for _, _, sent in phase_bytes(method, cp, batch, n_heads, n_kv_heads, local_len, head_dim,
                                  element_size, ulysses):
        total = {k: total[k] + sent[k] for k in total}
    return total


def apply_context_parallel(module: nn.Module, ctx: CPContext) -> int:
    """Swap every ``AttentionCore`` under `module` for a ContextParallelAttention over `ctx`
    (tagged by the core's name, for byte counts); returns how many were swapped. The module's
    owner must also feed RoPE the global positions (``Chunk.context_parallel``)."""
    swapped = 0
    for name, core in list(module.named_modules()):
        if isinstance(core, AttentionCore) and not isinstance(core, ContextParallelAttention):
            owner_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner_name), attr, ContextParallelAttention(ctx, name))
            swapped += 1
    return swapped


def hybrid_groups(cp_ranks: list[list[int]], ulysses: int, my_rank: int
                  ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(Ulysses group, ring group) of `my_rank` for every cp group in `cp_ranks` (global
    ranks, cp order). Every rank must call this with the same arguments (dist.new_group)."""
    mine_u = mine_r = None
    for ranks in cp_ranks:
        if len(ranks) % ulysses:
            raise ValueError(f"hybrid: the Ulysses degree {ulysses} must divide cp={len(ranks)}")
        for i in range(0, len(ranks), ulysses):
            g = dist.new_group(ranks[i:i + ulysses])
            if my_rank in ranks[i:i + ulysses]:
                mine_u = g
        for j in range(ulysses):
            g = dist.new_group(ranks[j::ulysses])
            if my_rank in ranks[j::ulysses]:
                mine_r = g
    return mine_u, mine_r
