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
(``check_layout``); padding would change the loss normalization of every rank.
Every function here takes positions, not a layout: a rank's tokens are identified by their
global positions (``sequence_positions``), which also index the RoPE tables.

Invariants: masking is causal in global positions; a query row that has seen no key yet keeps
log-sum-exp −inf and contributes nothing (``merge_`` guards −inf − −inf), and every row sees at
least its own position, so the final log-sum-exp is finite; blocks whose keys are all later
than all their queries are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from tessera.model import AttentionCore
from tessera.parallel.comm import CommStats, all_gather, group_rank, group_size, reduce_scatter

METHODS = ("ring", "allgather", "ulysses", "hybrid")
LAYOUTS = ("zigzag", "contiguous")
SEQ = 2
"""Attention tensors are (B, heads, T, head_dim): the sequence is dim 2."""


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
# Block products with a log-sum-exp: the pieces every method merges.


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, nkv, L, d) -> (B, nh, L, d): query head i reads kv head i // (nh/nkv) (SDPA's GQA)."""
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _fold_kv(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Gradient of _expand_kv: (B, nh, L, d) -> (B, nkv, L, d), summing each kv head's group."""
    B, nh, L, d = x.shape
    return x if nh == n_kv else x.view(B, n_kv, nh // n_kv, L, d).sum(2)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
    """Boolean (Lq, Lk) 'may not attend' mask, or None when every key precedes every query."""
    if int(k_pos.max()) <= int(q_pos.min()):
        return None
    return k_pos[None, :] > q_pos[:, None]


def skipped(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """A block wholly above the causal diagonal: every key is after every query."""
    return int(k_pos.min()) > int(q_pos.max())


def _scores(q, k, q_pos, k_pos, scale):
    s = torch.matmul(q, _expand_kv(k, q.shape[1]).transpose(-1, -2)) * scale  # (B, nh, Lq, Lk)
    mask = _mask(q_pos, k_pos)
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def _fused_causal(q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool | None:
    """Whether torch's fused CPU attention kernel (which returns the log-sum-exp) can compute
    this block: True for a diagonal block (the same positions: causal, top-left aligned),
    False for a block wholly below the diagonal (no mask), None otherwise (explicit path)."""
    if q.device.type != "cpu":
        return None
    if _mask(q_pos, k_pos) is None:
        return False
    if q_pos.numel() == k_pos.numel() and torch.equal(q_pos, k_pos) \
            and bool((q_pos[1:] == q_pos[:-1] + 1).all()):
        return True
    return None


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def block_forward(q, k, v, q_pos, k_pos, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale, causal in positions)·v and its row log-sum-exp:
    (B, nh, Lq, d) and (B, nh, Lq)."""
    causal = _fused_causal(q, q_pos, k_pos)
    if causal is not None:
        nh = q.shape[1]
        out, lse = _FLASH_CPU(q.contiguous(), _expand_kv(k, nh).contiguous(),
                              _expand_kv(v, nh).contiguous(), 0.0, causal, scale=scale)
        return out, lse.float()
    return explicit_block_forward(q, k, v, q_pos, k_pos, scale)


def explicit_block_forward(q, k, v, q_pos, k_pos, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """block_forward by a masked matmul, any mask and any device."""
    s = _scores(q, k, q_pos, k_pos, scale)
    lse = torch.logsumexp(s, dim=-1)  # -inf on rows whose keys are all later (masked)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.matmul(p, _expand_kv(v, q.shape[1])), lse


def block_backward(q, k, v, out, dout, delta, lse, q_pos, k_pos, scale):
    """Gradients of one block given the merged output, its lse and delta = rowsum(dO·O)
    (FlashAttention-2, Dao 2023, Alg. 2): P = e^(S−lse), dV = Pᵀ·dO, dS = P∘(dO·Vᵀ − delta)."""
    nh, nkv = q.shape[1], k.shape[1]
    causal = _fused_causal(q, q_pos, k_pos)
    if causal is not None:
        ke, ve = _expand_kv(k, nh), _expand_kv(v, nh)
        dq, dk, dv = _FLASH_CPU_BACKWARD(dout.contiguous(), q.contiguous(), ke.contiguous(),
                                         ve.contiguous(), out.contiguous(), lse.contiguous(),
                                         0.0, causal, scale=scale)
        return dq, _fold_kv(dk, nkv), _fold_kv(dv, nkv)
    return explicit_block_backward(q, k, v, dout, delta, lse, q_pos, k_pos, scale)


def explicit_block_backward(q, k, v, dout, delta, lse, q_pos, k_pos, scale):
    """block_backward by masked matmuls, any mask and any device."""
    nh, nkv = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, nh), _expand_kv(v, nh)
    p = torch.exp(_scores(q, k, q_pos, k_pos, scale) - lse[..., None])  # (B, nh, Lq, Lk)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, ve.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, _fold_kv(dk, nkv), _fold_kv(dv, nkv)


def merge_(out, lse, b_out, b_lse) -> None:
    """Online-softmax merge of a block result into the running (out, lse), in place."""
    new = torch.logaddexp(lse, b_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows that have seen no key yet
    out.mul_(torch.exp(lse - safe)[..., None]).add_(b_out * torch.exp(b_lse - safe)[..., None])
    lse.copy_(new)


def _segments(pos: torch.Tensor, chunk: int) -> list[tuple[slice, torch.Tensor]]:
    """A rank's tokens as runs of `chunk` consecutive positions (the zig-zag chunks):
    (slice, their positions). Work is counted, and skipped, per pair of such runs."""
    return [(slice(a, a + chunk), pos[a:a + chunk]) for a in range(0, pos.numel(), chunk)]


def attend_blocks_(q, k, v, q_pos, k_pos, chunk, scale, out, lse, work=None) -> None:
    """Merge q's attention to the keys k (positions k_pos) into the running (out, lse), pair of
    `chunk`-token runs by pair, skipping pairs wholly above the diagonal."""
    for ks, kpos in _segments(k_pos, chunk):
        for qs, qpos in _segments(q_pos, chunk):
            if skipped(qpos, kpos):
                if work is not None:
                    work.skipped += 1
                continue
            if work is not None:
                work.products += 1
            b_out, b_lse = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], qpos, kpos,
                                         scale)
            merge_(out[:, :, qs], lse[:, :, qs], b_out, b_lse)


def attend_blocks_backward_(q, k, v, out, dout, delta, lse, q_pos, k_pos, chunk, scale,
                            dq, dk, dv) -> None:
    """The gradients of attend_blocks_, accumulated into dq and (for these keys) dk, dv."""
    for ks, kpos in _segments(k_pos, chunk):
        for qs, qpos in _segments(q_pos, chunk):
            if skipped(qpos, kpos):
                continue
            dq_b, dk_b, dv_b = block_backward(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], dout[:, :, qs],
                delta[:, :, qs], lse[:, :, qs], qpos, kpos, scale)
            dq[:, :, qs] += dq_b
            dk[:, :, ks] += dk_b
            dv[:, :, ks] += dv_b


# ---------------------------------------------------------------------------------------------
# Ring attention


@dataclass
class WorkLog:
    """Chunk-pair products one rank computed (forward), for the balance tests."""

    products: int = 0
    skipped: int = 0


def _ring_peers(group) -> tuple[int, int, int, int]:
    n, r = group_size(group), group_rank(group)
    nxt, prv = (r + 1) % n, (r - 1) % n
    return n, r, dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)


def _start_send_recv(x: torch.Tensor, to: int, frm: int, group, tag: int):
    """Post the send of x to `to` and the receive of a like tensor from `frm`; returns
    (requests, receive buffer)."""
    buf = torch.empty_like(x)
    reqs = [dist.isend(x, to, group=group, tag=tag), dist.irecv(buf, frm, group=group, tag=tag)]
    return reqs, buf


class RingAttention(Function):
    """Liu et al.'s ring attention; positions (n, L) hold every ring member's global positions
    of its local tokens, so any layout (zig-zag, contiguous, hybrid's groups) works; `chunk`
    is the layout's run of consecutive positions, T/(2·cp): block products (and skips) are per
    pair of such runs."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group, scale, stats, tag, work, chunk):
        n, r, to, frm = _ring_peers(group)
        kv = torch.stack([k, v]).contiguous()  # (2, B, nkv, L, d): one message per hop
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        q_pos = positions[r].to(q.device)
        for s in range(n):
            reqs = []
            if s < n - 1:  # the next hop travels while this block computes
                reqs, nxt = _start_send_recv(kv, to, frm, group, tag=0)
                if stats is not None:
                    stats.record(tag, "send", "forward", kv.numel(), kv.element_size(), n)
            src = (r - s) % n
            attend_blocks_(q, kv[0], kv[1], q_pos, positions[src].to(q.device), chunk, scale,
                           out, lse, work)
            for req in reqs:
                req.wait()
            if reqs:
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.group, ctx.scale, ctx.stats, ctx.tag, ctx.chunk = group, scale, stats, tag, chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions = ctx.saved_tensors
        group, scale, stats, tag = ctx.group, ctx.scale, ctx.stats, ctx.tag
        chunk = ctx.chunk
        n, r, to, frm = _ring_peers(group)
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # (B, nh, L)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        q_pos = positions[r].to(q.device)
        grad_reqs: list = []
        dkv_in = dkv
        for s in range(n):
            kv_reqs = []
            if s < n - 1:
                kv_reqs, nxt = _start_send_recv(kv, to, frm, group, tag=0)
                if stats is not None:
                    stats.record(tag, "send", "backward", kv.numel(), kv.element_size(), n)
            if s > 0:  # the accumulator for this block arrives from the previous rank
                for req in grad_reqs:
                    req.wait()
                dkv = dkv_in
            src = (r - s) % n
            attend_blocks_backward_(q, kv[0], kv[1], out, dout, delta, lse, q_pos,
                                    positions[src].to(q.device), chunk, scale, dq, dkv[0],
                                    dkv[1])
            # pass the accumulator on; after the n-th hop it is back with its owner
            if n > 1:
                grad_reqs, dkv_in = _start_send_recv(dkv, to, frm, group, tag=1)
                if stats is not None:
                    stats.record(tag, "send", "backward", dkv.numel(), dkv.element_size(), n)
            else:
                dkv_in = dkv
            for req in kv_reqs:
                req.wait()
            if kv_reqs:
                kv = nxt
        for req in grad_reqs:
            req.wait()
        dk, dv = dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# All-gather attention (Llama 3)


class AllGatherAttention(Function):
    """K/V all-gathered over the cp group, local queries attend (chunk pairs above the diagonal
    skipped, as the ring); dK/dV reduce-scattered."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group, scale, stats, tag, work, chunk):
        r = group_rank(group)
        kv = torch.stack([k, v])  # (2, B, nkv, L, d)
        kv_full = all_gather(kv, SEQ + 1, group, stats, tag, "forward")  # (2, B, nkv, T, d)
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        attend_blocks_(q, kv_full[0], kv_full[1], positions[r].to(q.device),
                       positions.reshape(-1).to(q.device), chunk, scale, out, lse, work)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse, positions)
        ctx.group, ctx.scale, ctx.stats, ctx.tag, ctx.chunk = group, scale, stats, tag, chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, positions = ctx.saved_tensors
        group, stats, tag = ctx.group, ctx.stats, ctx.tag
        r = group_rank(group)
        # gathered again rather than kept: activations stay 1/cp of the sequence
        kv_full = all_gather(kv, SEQ + 1, group, stats, tag, "backward")
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv_full, dtype=torch.float32)
        attend_blocks_backward_(q, kv_full[0], kv_full[1], out, dout, delta, lse,
                                positions[r].to(q.device), positions.reshape(-1).to(q.device),
                                ctx.chunk, ctx.scale, dq, dkv[0], dkv[1])
        dkv = reduce_scatter(dkv.to(kv.dtype), SEQ + 1, group, stats, tag, "backward")
        return dq.to(q.dtype), dkv[0], dkv[1], None, None, None, None, None, None, None


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


def seq_to_heads(x, group, stats=None, tag="", phase="forward"):
    """(B, H, L, d) sequence-sharded -> (B, H/n, n·L, d) head-sharded, ranks' tokens in rank
    order."""
    n = group_size(group)
    B, H, L, d = x.shape
    rows = x.view(B, n, H // n, L, d).movedim(1, 0)  # (n, B, H/n, L, d): head group j to rank j
    got = _all_to_all(rows, group, stats, tag, phase)  # (n[src], B, H/n, L, d)
    return got.movedim(0, 2).reshape(B, H // n, n * L, d)


def heads_to_seq(x, group, stats=None, tag="", phase="forward"):
    """Inverse of seq_to_heads: (B, H/n, n·L, d) -> (B, H, L, d)."""
    n = group_size(group)
    B, h, T, d = x.shape
    rows = x.view(B, h, n, T // n, d).movedim(2, 0)  # (n, B, H/n, L, d): tokens of rank j
    got = _all_to_all(rows, group, stats, tag, phase)  # (n[head group], B, H/n, L, d)
    return got.movedim(0, 1).reshape(B, n * h, T // n, d)


class SeqToHeads(Function):
    @staticmethod
    def forward(ctx, x, group, stats, tag):
        ctx.group, ctx.stats, ctx.tag = group, stats, tag
        return seq_to_heads(x, group, stats, tag, "forward")

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group, ctx.stats, ctx.tag, "backward"), None, None, None


class HeadsToSeq(Function):
    @staticmethod
    def forward(ctx, x, group, stats, tag):
        ctx.group, ctx.stats, ctx.tag = group, stats, tag
        return heads_to_seq(x, group, stats, tag, "forward")

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group, ctx.stats, ctx.tag, "backward"), None, None, None


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
    return (SeqToHeads.apply(q, group, stats, tag), SeqToHeads.apply(k, group, stats, tag),
            SeqToHeads.apply(v, group, stats, tag))


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
            return HeadsToSeq.apply(y, c.group, c.stats, self.tag)
        # hybrid: Ulysses inside the group, ring across groups
        u = group_size(c.ulysses_group)
        qh, kh, vh = ulysses_split(q, k, v, c.ulysses_group, c.stats, self.tag)
        ring_pos = pos.view(-1, u * pos.shape[1])  # ring member j holds Ulysses group j's tokens
        y = RingAttention.apply(qh, kh, vh, ring_pos, c.ring_group, scale, c.stats, self.tag,
                                c.work, chunk)
        return HeadsToSeq.apply(y, c.ulysses_group, c.stats, self.tag)


def bytes_per_layer(method: str, cp: int, batch: int, n_heads: int, n_kv_heads: int,
                    local_len: int, head_dim: int, element_size: int = 4,
                    ulysses: int = 2) -> dict[str, float]:
    """Bytes one rank sends per attention layer and micro-batch, forward and backward: the
    formulas of the module doc (heads per tp rank; L = local_len = T/cp tokens; the ring's
    dK/dV accumulators travel in fp32 whatever `element_size` the activations have)."""
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    kv = 2 * batch * n_kv_heads * local_len * head_dim * element_size  # |K|+|V| local
    share = (cp - 1) / cp
    if method == "ring":
        return {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv + cp * kv * 4 // element_size}
    if method == "allgather":
        return {"forward": share * cp * kv, "backward": 2 * share * cp * kv}
    if method == "ulysses":
        q = batch * n_heads * local_len * head_dim * element_size
        kv_sent = kv * ulysses_kv_repeat(n_heads, n_kv_heads, cp)
        one_way = share * (2 * q + kv_sent)  # q, k, v in; the output back
        return {"forward": one_way, "backward": one_way}
    if method == "hybrid":
        a = bytes_per_layer("ulysses", ulysses, batch, n_heads, n_kv_heads, local_len,
                            head_dim, element_size)
        kv_rep = n_kv_heads * ulysses_kv_repeat(n_heads, n_kv_heads, ulysses)
        b = bytes_per_layer("ring", cp // ulysses, batch, n_heads // ulysses,
                            kv_rep // ulysses, local_len * ulysses, head_dim, element_size)
        return {k: a[k] + b[k] for k in a}
    raise ValueError(f"cp_method={method!r}: must be one of {', '.join(METHODS)}")


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
