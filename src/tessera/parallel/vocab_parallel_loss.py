"""The loss over logits split by vocabulary across the tp group (Megatron's vocabulary-parallel
cross-entropy): two all-reduces of per-token numbers, never the b·s·V logits; see
``tensor_parallel.py`` for the vocabulary-parallel embedding and head that produce them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.autograd import Function

from tessera.parallel.comm import all_gather, all_reduce, group_rank, group_size

if TYPE_CHECKING:
    from tessera.parallel.tensor_parallel import TPContext


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy of logits split by vocabulary over the tp group.

    Forward: one all-reduce (max) of the per-token maxima, one all-reduce (sum) of the stacked
    per-token sums of exponentials and target logits: 3·b·s numbers, never b·s·V. Backward: none
    (softmax − one-hot on the local columns).
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group, stats, tag):
        t, rank = group_size(group), group_rank(group)
        n_local = logits.shape[-1]
        start = rank * n_local
        valid = max(0, min(n_local, vocab_size - start))  # columns past the vocabulary: padding
        x = logits.flatten(0, -2).to(torch.float32, copy=True)  # (N, V/t)
        if valid < n_local:
            x[:, valid:] = float("-inf")
        row_max = x.max(dim=-1).values
        if t > 1:
            row_max = all_reduce(row_max, group, stats, tag, "forward", op=dist.ReduceOp.MAX,
                                 inplace=True)
        x -= row_max[:, None]
        target = targets.flatten() - start
        inside = (target >= 0) & (target < valid)
        target = target.masked_fill(~inside, 0)
        target_logit = x.gather(1, target[:, None]).squeeze(1).masked_fill(~inside, 0.0)
        x.exp_()
        sums = torch.stack([x.sum(dim=-1), target_logit])  # (2, N)
        if t > 1:
            sums = all_reduce(sums, group, stats, tag, "forward", inplace=True)
        sum_exp, target_logit = sums
        x /= sum_exp[:, None]  # softmax over the whole vocabulary, local columns
        ctx.save_for_backward(x, target, inside)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target, inside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, target] -= inside.to(grad.dtype)
        grad *= grad_loss / grad.shape[0]
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 tp: TPContext, tag: str = "loss") -> torch.Tensor:
    """Mean next-token loss from this rank's logits (B, T, V_padded/t); the same on every rank.

    Equals tessera.model.cross_entropy on the gathered, unpadded logits."""
    return VocabParallelCrossEntropy.apply(logits, targets, vocab_size, tp.group, tp.stats, tag)


def gather_logits(logits: torch.Tensor, vocab_size: int, tp: TPContext) -> torch.Tensor:
    """(B, T, V_padded/t) on each rank -> the full (B, T, V) logits (tests and sampling)."""
    return all_gather(logits, -1, tp.group)[..., :vocab_size]
