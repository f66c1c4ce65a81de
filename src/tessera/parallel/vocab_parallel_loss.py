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


def token_losses_(x: torch.Tensor, targets: torch.Tensor, vocab_size: int, start: int,
                  group: dist.ProcessGroup | None, stats, tag: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cross-entropy of each token from this rank's fp32 logits x (N, V_local), the columns
    start..start+V_local of the (padded) vocabulary; x becomes, in place, the softmax over the
    whole vocabulary on those columns. Columns past `vocab_size` are padding, left out.

    One all-reduce (max) of the N row maxima and one (sum) of the stacked N sums of
    exponentials and N target logits over `group` (none on one rank). Returns (loss (N,),
    log-sum-exp (N,), local target column (N,), whether the target is local (N,)): the last
    three are what ``softmax_grad_`` and ``softmax_from_lse_`` need."""
    t = group_size(group)
    valid = mask_padding_(x, vocab_size, start)
    row_max = x.max(dim=-1).values
    if t > 1:
        row_max = all_reduce(row_max, group, stats, tag, "forward", op=dist.ReduceOp.MAX,
                             inplace=True)
    x -= row_max[:, None]
    target, inside = local_targets(targets, start, valid)
    target_logit = x.gather(1, target[:, None]).squeeze(1).masked_fill(~inside, 0.0)
    x.exp_()
    sums = torch.stack([x.sum(dim=-1), target_logit])  # (2, N)
    if t > 1:
        sums = all_reduce(sums, group, stats, tag, "forward", inplace=True)
    sum_exp, target_logit = sums
    x /= sum_exp[:, None]  # softmax over the whole vocabulary, local columns
    log_sum_exp = sum_exp.log()
    return log_sum_exp - target_logit, log_sum_exp + row_max, target, inside


def mask_padding_(x: torch.Tensor, vocab_size: int, start: int) -> int:
    """Set the columns of x (N, V_local; columns start.. of the padded vocabulary) past the
    vocabulary to -inf, in place; returns how many columns are real."""
    valid = max(0, min(x.shape[-1], vocab_size - start))
    if valid < x.shape[-1]:
        x[:, valid:] = float("-inf")
    return valid


def local_targets(targets: torch.Tensor, start: int, valid: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(target's local column, 0 where not local; whether it is local) of the flat targets."""
    target = targets - start
    inside = (target >= 0) & (target < valid)
    return target.masked_fill(~inside, 0), inside


def softmax_from_lse_(x: torch.Tensor, log_sum_exp: torch.Tensor, vocab_size: int,
                      start: int) -> torch.Tensor:
    """x (N, V_local) fp32 logits -> in place, the softmax over the whole vocabulary on these
    columns, from the rows' log-sum-exp (``token_losses_``): no collective."""
    mask_padding_(x, vocab_size, start)
    return x.sub_(log_sum_exp[:, None]).exp_()


def softmax_grad_(softmax: torch.Tensor, target: torch.Tensor, inside: torch.Tensor,
                  scale: torch.Tensor | float) -> torch.Tensor:
    """d(scale · Σ token losses)/d(logits) = scale·(softmax − one-hot), in place on `softmax`."""
    rows = torch.arange(softmax.shape[0], device=softmax.device)
    softmax[rows, target] -= inside.to(softmax.dtype)
    return softmax.mul_(scale)


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy of logits split by vocabulary over the tp group.

    Forward: one all-reduce (max) of the per-token maxima, one all-reduce (sum) of the stacked
    per-token sums of exponentials and target logits: 3·b·s numbers, never b·s·V
    (``token_losses_``). Backward: none (softmax − one-hot on the local columns).
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group, stats, tag):
        x = logits.flatten(0, -2).to(torch.float32, copy=True)  # (N, V/t)
        start = group_rank(group) * x.shape[-1]
        losses, _, target, inside = token_losses_(x, targets.flatten(), vocab_size, start,
                                                  group, stats, tag)
        ctx.save_for_backward(x, target, inside)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target, inside = ctx.saved_tensors
        grad = softmax_grad_(softmax.clone(), target, inside, grad_loss / softmax.shape[0])
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 tp: TPContext, tag: str = "loss") -> torch.Tensor:
    """Mean next-token loss from this rank's logits (B, T, V_padded/t); the same on every rank.

    Equals tessera.model.cross_entropy on the gathered, unpadded logits."""
    return VocabParallelCrossEntropy.apply(logits, targets, vocab_size, tp.group, tp.stats, tag)


def gather_logits(logits: torch.Tensor, vocab_size: int, tp: TPContext) -> torch.Tensor:
    """(B, T, V_padded/t) on each rank -> the full (B, T, V) logits (tests and sampling)."""
    return all_gather(logits, -1, tp.group)[..., :vocab_size]
