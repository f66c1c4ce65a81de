"""Causal attention over keys and values held by other ranks: block products that carry their
log-sum-exp, merged by the online-softmax rule, and the two context-parallel methods built on
them, ring attention and all-gather attention (``context_parallel.py`` explains the methods,
the layouts and the bytes each sends).

Every function takes global positions, not a layout. Masking is causal in global positions; a
query row that has seen no key yet keeps log-sum-exp −inf and contributes nothing (``merge_``
guards −inf − −inf), and every row sees at least its own position, so the final log-sum-exp is
finite; blocks whose keys are all later than all their queries are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function

from tessera.parallel.comm import all_gather, group_rank, group_size, reduce_scatter

SEQ = 2
"""Attention tensors are (B, heads, T, head_dim): the sequence is dim 2."""


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
