"""Megatron sequence parallelism: the conjugate collectives along the sequence dimension.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, §4.2.
Tensor parallelism (Shoeybi et al. 2019, see ``tensor_parallel.py``) leaves the norms, residual
adds and dropouts replicated on every tensor-parallel rank; they are cheap in FLOPs but their
activations are the replicated 10·s·b·h of the per-layer memory. Sequence parallelism splits
those regions along the sequence: each rank holds tokens [r·s/t, (r+1)·s/t) of every sequence.

The paper's conjugate pair replaces Megatron's f/g (activations are (B, T, h) here, so the
sequence is dim 1):

- ``g``: all-gather along the sequence forward, reduce-scatter backward. Enters a tensor-parallel
  region (attention, MLP, LM head) from a sequence-parallel one.
- ``g_bar``: reduce-scatter along the sequence forward, all-gather backward. Leaves a
  tensor-parallel region: the row-parallel partial sums are summed and split in one collective.

An all-reduce is a reduce-scatter plus an all-gather, so replacing each f/g all-reduce with one
of these moves the same bytes: 8·b·s·h·(t−1)/t elements (times the element size) per layer per
micro-batch, forward and backward together (§4.2.3). `gather_then_linears` is the memory-saving
form of ``g`` followed by column-parallel linears: it keeps only this rank's s/t slice of the
gathered input for backward and all-gathers it again there (the paper's "extra all-gather" of
§4.2.2), which is what makes the per-layer activations s·b·h/t·(34 + 5·a·s/h). That extra
all-gather costs 2·b·s·h·(t−1)/t elements per layer; pass ``regather=False`` to the
tensor-parallel layers to store the gathered input instead and move exactly the
tensor-parallel volume.

Invariants: outside tensor-parallel regions every activation is (B, T/t, h) and rank r holds
sequence chunk r; parameters of those regions (norm gains) are replicated, and each rank's
gradient for them covers only its tokens, so those gradients are summed over the tp group once
per step (``tensor_parallel.sync_partial_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from tessera.parallel.comm import (
    CommStats,
    all_gather,
    conjugate,
    group_rank,
    group_size,
    reduce_scatter,
)
from tessera.pipeline.split_backward import INPUT, WEIGHT

SEQ_DIM = 1
"""Activations are (batch, sequence, hidden), as in tessera.model."""


def _gather(x: torch.Tensor, group, stats, tag: str, phase: str) -> torch.Tensor:
    return all_gather(x, SEQ_DIM, group, stats, tag, phase)


def _reduce_scatter(x: torch.Tensor, group, stats, tag: str, phase: str) -> torch.Tensor:
    return reduce_scatter(x, SEQ_DIM, group, stats, tag, phase)


g = conjugate("GatherFromSequenceParallelRegion", _gather, _reduce_scatter,
              "Korthikanti's g, (B, T/t, h) -> (B, T, h): all-gather along the sequence "
              "forward, reduce-scatter backward.")
g_bar = conjugate("ReduceScatterToSequenceParallelRegion", _reduce_scatter, _gather,
                  "Korthikanti's ḡ, (B, T, h) partial sums -> (B, T/t, h) summed: reduce-scatter "
                  "along the sequence forward, all-gather backward.")
scatter = conjugate("ScatterToSequenceParallelRegion",
                    lambda x, group, *_: sequence_chunk(x, group), _gather,
                    "(B, T, h) replicated -> (B, T/t, h): this rank's sequence chunk (no "
                    "communication), all-gather backward. Enters sequence parallelism from "
                    "replicated activations.")


def sequence_chunk(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous 1/t of `x` along the sequence dimension (a copy)."""
    t = group_size(group)
    if x.shape[SEQ_DIM] % t:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by tp={t}")
    return x.chunk(t, SEQ_DIM)[group_rank(group)].contiguous()


class GatherThenLinears(Function):
    """y_i = g(x)·W_iᵀ for several column-parallel weights reading the same gathered input,
    storing only the local (B, T/t, h) input and all-gathering it again in backward.

    Backward overlaps that all-gather with the input-gradient matmuls, and the reduce-scatter of
    the input gradient with the weight-gradient matmuls (Korthikanti et al. §4.2.2). Under
    autocast the matmuls run in the forward's compute dtype in both directions.

    Split backward (``pipeline.split_backward``'s nodes that split their own backward): I does
    the all-gather, the input-gradient matmuls and the reduce-scatter, a plain backward's
    collectives, and keeps the gathered input (B·T, h) in the compute dtype; W does only the
    weight-gradient matmuls, from it and the output gradients: no collective. Between I and W
    the node holds that gathered input in place of the (B, T/t, h) slice it saved (dropped
    after I): t times the elements. Gathering in W instead would hold only the slice, at the
    price of a collective in W that every tp rank must enter there.
    """

    @staticmethod
    def forward(ctx, x_local, group, stats, tag, *weights):
        ctx.group, ctx.stats, ctx.tag = group, stats, tag
        x_full = all_gather(x_local, SEQ_DIM, group, stats, tag, "forward")  # (B, T, h)
        outs = tuple(F.linear(x_full, w) for w in weights)
        ctx.compute_dtype = outs[0].dtype
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.split_phase = ctx.split_kept = None
        ctx.save_for_backward(x_local, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):
        dtype = ctx.compute_dtype
        grads = [gy.to(dtype) for gy in grad_outs]  # (B, T, out_i); materialized, never None
        if ctx.split_phase == WEIGHT:
            (x_full,), ctx.split_kept = ctx.split_kept, None
            return None, None, None, None, *_weight_grads(grads, x_full, ctx.weight_dtypes)
        x_local, *weights = ctx.saved_tensors
        finish_gather = all_gather(x_local, SEQ_DIM, ctx.group, ctx.stats, ctx.tag + ":regather",
                                   "backward", async_op=True)
        grad_x = sum(gy @ w.to(dtype) for gy, w in zip(grads, weights, strict=True))  # (B, T, h)
        x_full = finish_gather().to(dtype).flatten(0, -2)  # (B·T, h)
        finish_scatter = reduce_scatter(grad_x, SEQ_DIM, ctx.group, ctx.stats, ctx.tag,
                                        "backward", async_op=True)
        if ctx.split_phase == INPUT:
            ctx.split_kept = (x_full,)
            grad_ws = [None] * len(weights)
        else:
            grad_ws = _weight_grads(grads, x_full, ctx.weight_dtypes)
        return finish_scatter().to(x_local.dtype), None, None, None, *grad_ws


def _weight_grads(grads: list[torch.Tensor], x_full: torch.Tensor,
                  dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """dW_i = dY_iᵀ·X: (out_i, B·T) @ (B·T, h), in each weight's dtype."""
    return [(gy.flatten(0, -2).t() @ x_full).to(dt) for gy, dt in zip(grads, dtypes, strict=True)]


def gather_then_linears(x_local: torch.Tensor, weights: list[torch.Tensor],
                        group: dist.ProcessGroup | None, stats: CommStats | None = None,
                        tag: str = "") -> tuple[torch.Tensor, ...]:
    """``[F.linear(g(x_local), w) for w in weights]`` keeping only x_local for backward."""
    if group_size(group) == 1:
        return tuple(F.linear(x_local, w) for w in weights)
    return GatherThenLinears.apply(x_local, group, stats, tag, *weights)
