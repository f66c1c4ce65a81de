"""The LM head and its cross-entropy computed a chunk of tokens at a time, so that the
micro-batch's fp32 logits (B·T·V·4 bytes: 1 GiB for one 2,048-token sequence of Llama 3's
128,256-token vocabulary) are never held whole: ``train.loss_chunk_tokens``.

Forward: for each chunk of c tokens, the logits h_c·Wᵀ (in h's dtype, then fp32, as the
unchunked head and ``tessera.model.cross_entropy`` compute them), their token losses and the
rows' log-sum-exp; only the N log-sum-exps (4 bytes a token) are kept. Backward: each chunk's
logits are computed again, turned into softmax − one-hot with the kept log-sum-exps (no
collective), and give the chunk's rows of dh and its term of dW. At most one chunk's logits
exist at any time: c·V·4 bytes (and their gradient, in place).

Split backward (``pipeline.split_backward``'s splitting nodes): I computes each chunk's
logits again and dh only; W computes them once more and dW only. W's recomputation is the
price of the bound above: skipping it would need each chunk's softmax − one-hot (the
micro-batch's whole fp32 logits) held from I to W, or dW computed in I (W's work moved onto
the critical path, and a V·H fp32 matrix per micro-batch held until W). So the head's matrix
products, in units of one pass of N·V·H, are forward 1, I 2 (logits, dh) and W 2 (logits,
dW): one more than a plain backward's 3.

Under tensor parallelism W holds this rank's rows of the padded vocabulary and each chunk's
loss takes the vocabulary-parallel form's two all-reduces (``vocab_parallel_loss``'s
``token_losses_``, the same code); dh is then this rank's partial sum, which the caller's
entry into the tp region (f, or SP's all-gather) sums in backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.autograd import Function

from tessera.parallel.comm import group_rank
from tessera.parallel.vocab_parallel_loss import (
    local_targets,
    softmax_from_lse_,
    softmax_grad_,
    token_losses_,
)
from tessera.pipeline.split_backward import INPUT, WEIGHT

if TYPE_CHECKING:
    from tessera.parallel.tensor_parallel import TPContext


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the rows h (c, H): the head's matmul in h's dtype, as the unchunked head."""
    return F.linear(h, weight).float()


class ChunkedHeadCrossEntropy(Function):
    """Mean cross-entropy of softmax(h·Wᵀ), `chunk` tokens at a time (see the module doc)."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, chunk, group, stats, tag):
        hf, y = h.flatten(0, -2), targets.flatten()  # (N, H), (N,)
        start = group_rank(group) * weight.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        log_sum_exp = torch.empty(hf.shape[0], dtype=torch.float32, device=h.device)
        for s in range(0, hf.shape[0], chunk):
            x = _chunk_logits(hf[s:s + chunk], weight)
            losses, log_sum_exp[s:s + chunk], _, _ = token_losses_(
                x, y[s:s + chunk], vocab_size, start, group, stats, tag)
            total += losses.sum()
            del x, losses
        ctx.save_for_backward(h, weight, targets, log_sum_exp)
        ctx.vocab_size, ctx.chunk, ctx.start = vocab_size, chunk, start
        ctx.valid = max(0, min(weight.shape[0], vocab_size - start))  # real columns
        ctx.split_phase = ctx.split_kept = None  # pipeline.split_backward's splitting node
        return total / hf.shape[0]

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, targets, log_sum_exp = ctx.saved_tensors
        hf, y = h.flatten(0, -2), targets.flatten()
        n, chunk = hf.shape[0], ctx.chunk
        scale = grad_loss / n
        dh = torch.empty_like(hf) if ctx.split_phase != WEIGHT else None
        dw = None
        if ctx.split_phase != INPUT:
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk):
            hc = hf[s:s + chunk]
            x = softmax_from_lse_(_chunk_logits(hc, weight), log_sum_exp[s:s + chunk],
                                  ctx.vocab_size, ctx.start)
            target, inside = local_targets(y[s:s + chunk], ctx.start, ctx.valid)
            grad = softmax_grad_(x, target, inside, scale)  # (c, V_local) fp32
            if dh is not None:
                dh[s:s + chunk] = grad.to(h.dtype) @ weight
            if dw is not None:
                dw.addmm_(grad.t(), hc.float())
            del x, grad
        return (None if dh is None else dh.view_as(h), None if dw is None else dw.to(weight.dtype),
                None, None, None, None, None, None)


def chunked_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               vocab_size: int, chunk_tokens: int, tp: TPContext | None = None,
                               tag: str = "loss") -> torch.Tensor:
    """Mean next-token loss of the head `weight` (V, H), or this rank's rows of the padded
    vocabulary (V_padded/t, H) under `tp`, applied to the final hidden states h (B, T, H):
    `chunk_tokens` tokens at a time. Equals the head followed by ``tessera.model.cross_entropy``
    (``vocab_parallel_cross_entropy`` under tp) up to the order of sums. Under tp, h is this
    rank's input of the head region, entered here (f, or SP's all-gather of the sequence)."""
    group = stats = None
    if tp is not None and tp.size > 1:
        h = tp.enter(h, "output")
        group, stats = tp.group, tp.stats
    return ChunkedHeadCrossEntropy.apply(h, weight, targets, vocab_size, chunk_tokens, group,
                                         stats, tag)
