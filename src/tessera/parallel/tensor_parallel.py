"""Megatron tensor parallelism: split each block's matmuls over the tp group.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019, §3. Within a block, the first linear of a pair is split by output columns
(column-parallel: rank r computes Y_r = X·A_rᵀ) and the second by input rows (row-parallel:
rank r computes Z_r = Y_r·B_rᵀ, a partial sum of Z). The pair needs no communication in between,
and two conjugate operators bracket it:

- ``f``: identity forward, all-reduce backward (enters the region: every rank's input gradient
  is a partial sum over its columns);
- ``g``: all-reduce forward, identity backward (leaves the region: sums the partial Z_r).

Attention splits query heads (wq, wk, wv column-parallel; wo row-parallel) and the SwiGLU MLP
splits its hidden units (w1, w3 column-parallel; w2 row-parallel), so each block costs per
micro-batch two all-reduces of b·s·h activations forward and two backward: 4 · 2·(t−1)/t ·
b·s·h elements sent per rank per layer, the paper's 8·b·s·h·(t−1)/t. With sequence parallelism
(``sequence_parallel.py``, Korthikanti et al. 2022) f/g become all-gather/reduce-scatter pairs
along the sequence that move the same volume.

Grouped-query attention: with n_kv_heads >= t the key/value heads are split like the query
heads; with n_kv_heads < t (t a multiple of n_kv_heads) each key/value head is replicated on the
t/n_kv_heads ranks whose query heads read it, and the gradients of those replicas are partial
sums that ``sync_partial_grads`` adds up once per step.

Vocabulary parallelism: the embedding and the LM head are split by vocabulary rows. The
embedding looks up the rows it holds, zeroes the rest and leaves through g (or ḡ under SP); the
head is column-parallel and its logits stay split: ``vocab_parallel_cross_entropy`` computes the
loss with two all-reduces, of the b·s row maxima and then of the b·s sums of exponentials
stacked with the b·s target logits, never gathering the b·s·V logits. A vocabulary not
divisible by t is padded with zero rows whose logits are masked to −inf, so padding changes
neither the loss nor any gradient, and the padding rows' gradients are exactly zero.

Invariants: the residual stream is replicated on every tp rank (without SP) or split by
sequence (with SP); a parameter shard on rank r is rows/columns r of the reference tensor
(``ShardSpec``), so a sharded model initialized from a seed is the reference model from that
seed, sharded, and `gather_state_dict` returns reference names and values on every rank.
Model code stays rank-unaware: `apply_tensor_parallel` swaps a module's blocks, embedding and
head for the parallel versions below, and works on any module holding a subset of them (a
pipeline stage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from tessera.config import ModelConfig
from tessera.model import (
    Attention,
    AttentionCore,
    Block,
    FeedForward,
    Transformer,
    apply_rope,
    init_tensor,
    rope_tables,
)
from tessera.optim import add_sums_of_squares
from tessera.parallel import sequence_parallel as sp
from tessera.parallel.comm import CommStats, all_gather, all_reduce, group_rank, group_size

FullTensor = Callable[[str, tuple[int, ...]], torch.Tensor]
"""Gives the full (reference) value of a parameter from its name and full shape."""


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group and how its regions communicate; handed to every TP layer."""

    group: dist.ProcessGroup | None
    """The tp process group; None means a single rank (every collective is the identity)."""
    sequence_parallel: bool = False
    """Megatron-SP: activations outside TP regions hold 1/t of the sequence."""
    regather: bool = True
    """Under SP, column-parallel layers store their input's local sequence chunk and all-gather
    it again in backward (Korthikanti §4.2.2: less memory, one extra all-gather per region)."""
    stats: CommStats | None = None
    """Where collectives are counted; None counts nothing."""
    size: int = field(init=False)
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", group_size(self.group))
        object.__setattr__(self, "rank", group_rank(self.group))

    def enter(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """Enter a tensor-parallel region: f, or SP's g (all-gather along the sequence)."""
        if self.sequence_parallel:
            return sp.g(x, self.group, self.stats, tag + ":enter")
        return f(x, self.group, self.stats, tag + ":enter")

    def exit(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """Leave a tensor-parallel region: g, or SP's ḡ (reduce-scatter along the sequence)."""
        if self.sequence_parallel:
            return sp.g_bar(x, self.group, self.stats, tag + ":exit")
        return g(x, self.group, self.stats, tag + ":exit")


# ---------------------------------------------------------------------------------------------
# The conjugate operators f and g (Shoeybi et al. 2019, Fig. 3).


class CopyToTensorParallelRegion(Function):
    """Megatron's f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group, stats, tag):
        ctx.group, ctx.stats, ctx.tag = group, stats, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group, ctx.stats, ctx.tag, "backward"), None, None, None


class ReduceFromTensorParallelRegion(Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, stats, tag):
        # The input is a fresh matmul output that nothing saved: reduce it in place (a leaf,
        # say in a test, cannot be modified in place and is copied).
        inplace = not (x.is_leaf and x.requires_grad)
        out = all_reduce(x, group, stats, tag, "forward", inplace=inplace)
        if out is x:  # reduced in place: tell autograd
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def f(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None,
      tag: str = "") -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    if group_size(group) == 1:
        return x
    return CopyToTensorParallelRegion.apply(x, group, stats, tag)


def g(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None,
      tag: str = "") -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    if group_size(group) == 1:
        return x
    return ReduceFromTensorParallelRegion.apply(x, group, stats, tag)


# ---------------------------------------------------------------------------------------------
# How a parameter is laid out over the tp group.


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of the reference model is held by the tp ranks.

    The reference tensor is cut along `dim` into `chunks` equal pieces (after zero-padding to a
    multiple of `chunks` when `pad`); with t ranks, each piece is held by t/chunks consecutive
    ranks. dim=None: every rank holds the whole tensor (chunks=1).
    """

    dim: int | None = None
    chunks: int = 1
    full_size: int = 0
    """Size of the reference tensor along `dim`."""
    pad: bool = False
    partial_grad: bool = False
    """Ranks holding the same piece each compute part of its gradient; sum them once per step."""

    def replicas(self, tp_size: int) -> int:
        return tp_size // self.chunks

    def index(self, rank: int, tp_size: int) -> int:
        """Which piece rank `rank` holds."""
        return rank // self.replicas(tp_size)

    def owns(self, rank: int, tp_size: int) -> bool:
        """Is `rank` the first holder of its piece (counts it once in norms)?"""
        return rank % self.replicas(tp_size) == 0

    @property
    def padded_size(self) -> int:
        return self.chunks * math.ceil(self.full_size / self.chunks)


def shard(full: torch.Tensor, spec: ShardSpec, tp: TPContext) -> torch.Tensor:
    """This rank's piece of the reference tensor `full` (a fresh tensor)."""
    if spec.dim is None:
        return full.detach().clone()
    size = full.shape[spec.dim]
    if size != spec.full_size:
        raise ValueError(f"tensor has size {size} along dim {spec.dim}, spec says "
                         f"{spec.full_size}")
    if not spec.pad and size % spec.chunks:
        raise ValueError(f"size {size} of dim {spec.dim} is not divisible into {spec.chunks} "
                         "tensor-parallel shards")
    if spec.padded_size != size:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padded_size - size
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    rows = spec.padded_size // spec.chunks
    return full.detach().narrow(spec.dim, spec.index(tp.rank, tp.size) * rows, rows).clone()


def gather_full(local: torch.Tensor, spec: ShardSpec, tp: TPContext) -> torch.Tensor:
    """The reference tensor from every rank's piece (padding removed), on every rank."""
    if spec.dim is None:
        return local.detach().clone()
    pieces = all_gather(local.detach().unsqueeze(0), 0, tp.group)  # (t, *local.shape)
    pieces = pieces[::spec.replicas(tp.size)]  # one holder per piece: (chunks, *local.shape)
    full = pieces.movedim(0, spec.dim).flatten(spec.dim, spec.dim + 1)
    return full.narrow(spec.dim, 0, spec.full_size).clone()


# ---------------------------------------------------------------------------------------------
# Layers.


class ColumnParallelLinear(nn.Module):
    """Y_r = X·A_rᵀ with A split by output rows; the input enters the region through f (or SP's
    g), the output stays split over the tp ranks."""

    def __init__(self, weight: torch.Tensor, tp: TPContext, spec: ShardSpec, tag: str = ""):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.tp, self.spec, self.tag = tp, spec, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel(x, [self], self.tp, self.tag)[0]

    def extra_repr(self) -> str:
        return f"shard={tuple(self.weight.shape)}, tp={self.tp.size}, spec={self.spec}"


class RowParallelLinear(nn.Module):
    """Z = Σ_r Y_r·B_rᵀ with B split by input columns; the partial sums leave the region
    through g (or SP's ḡ)."""

    def __init__(self, weight: torch.Tensor, tp: TPContext, spec: ShardSpec, tag: str = ""):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.tp, self.spec, self.tag = tp, spec, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.exit(F.linear(x, self.weight), self.tag)

    def extra_repr(self) -> str:
        return f"shard={tuple(self.weight.shape)}, tp={self.tp.size}, spec={self.spec}"


def column_parallel(x: torch.Tensor, layers: Sequence[ColumnParallelLinear], tp: TPContext,
                    tag: str) -> tuple[torch.Tensor, ...]:
    """Several column-parallel linears reading one input, which enters the region once (one f,
    or one SP all-gather), so a block pays one collective per region, not one per linear."""
    weights = [layer.weight for layer in layers]
    if tp.sequence_parallel and tp.regather and tp.size > 1:
        return sp.gather_then_linears(x, weights, tp.group, tp.stats, tag + ":enter")
    x = tp.enter(x, tag)
    return tuple(F.linear(x, w) for w in weights)


class VocabParallelEmbedding(nn.Module):
    """The embedding split by vocabulary rows: rank r looks up ids in its range, zeroes the
    others, and the partial embeddings are summed by g (all-reduce) or, under SP, by ḡ
    (reduce-scatter, leaving each rank its sequence chunk)."""

    def __init__(self, weight: torch.Tensor, tp: TPContext, spec: ShardSpec, tag: str = ""):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.tp, self.spec, self.tag = tp, spec, tag
        self.vocab_start = spec.index(tp.rank, tp.size) * weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start  # (B, T)
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, h)
        return self.tp.exit(out.masked_fill(outside[..., None], 0.0), self.tag)

    def extra_repr(self) -> str:
        return f"shard={tuple(self.weight.shape)}, start={self.vocab_start}, tp={self.tp.size}"


class ParallelAttention(nn.Module):
    """tessera.model.Attention on this rank's heads: wq, wk, wv column-parallel, wo row-parallel.
    The head counts come from the shard shapes, as in the reference."""

    def __init__(self, wq: ColumnParallelLinear, wk: ColumnParallelLinear,
                 wv: ColumnParallelLinear, wo: RowParallelLinear, head_dim: int, tp: TPContext,
                 tag: str = ""):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.head_dim, self.tp, self.tag = head_dim, tp, tag
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        q, k, v = column_parallel(x, (self.wq, self.wk, self.wv), self.tp, self.tag)
        T = q.shape[1]  # the full sequence, also under SP (the region gathered it)
        if cos.shape[0] != T:
            raise ValueError(f"RoPE tables cover {cos.shape[0]} positions but attention sees {T}"
                             " tokens; under sequence parallelism pass the full sequence's tables")
        q = q.view(B, T, -1, self.head_dim)  # (B, T, nh_local, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, nkv_local, hd)
        v = v.view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh|nkv, T, hd)
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T|T/t, h)


class ParallelFeedForward(nn.Module):
    """SwiGLU w2(silu(w1 x) * w3 x) on this rank's hidden units: w1, w3 column-parallel, w2
    row-parallel."""

    def __init__(self, w1: ColumnParallelLinear, w3: ColumnParallelLinear, w2: RowParallelLinear,
                 tp: TPContext, tag: str = ""):
        super().__init__()
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.tp, self.tag = tp, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = column_parallel(x, (self.w1, self.w3), self.tp, self.tag)  # (B, T, f/t) each
        return self.w2(F.silu(a) * b)


PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


# ---------------------------------------------------------------------------------------------
# Loss over vocabulary-split logits.


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


# ---------------------------------------------------------------------------------------------
# Turning reference modules into parallel ones.


def _no_bias(linear: nn.Linear, name: str) -> None:
    if linear.bias is not None:
        raise ValueError(f"{name}: tensor parallelism here supports linears without bias")


def _kv_chunks(n_kv_heads: int, tp: TPContext) -> int:
    if n_kv_heads % tp.size == 0:
        return tp.size
    if tp.size % n_kv_heads == 0:
        return n_kv_heads  # each kv head replicated on tp/n_kv_heads ranks
    raise ValueError(f"tp={tp.size} must divide n_kv_heads={n_kv_heads} or be a multiple of it")


def parallelize_attention(attn: Attention, tp: TPContext, full: FullTensor,
                          prefix: str = "") -> ParallelAttention:
    """Split query heads over tp; key/value heads split, or replicated when n_kv_heads < tp."""
    a, kv, hd, t = attn.n_heads, attn.n_kv_heads, attn.head_dim, tp.size
    if a % t:
        raise ValueError(f"tp={t} must divide n_heads={a}")
    q_spec = ShardSpec(dim=0, chunks=t, full_size=a * hd)
    kv_chunks = _kv_chunks(kv, tp)
    kv_spec = ShardSpec(dim=0, chunks=kv_chunks, full_size=kv * hd, partial_grad=kv_chunks < t)
    o_spec = ShardSpec(dim=1, chunks=t, full_size=a * hd)

    def piece(name: str, spec: ShardSpec) -> torch.Tensor:
        linear = getattr(attn, name)
        _no_bias(linear, prefix + name)
        return shard(full(f"{prefix}{name}.weight", tuple(linear.weight.shape)), spec, tp)

    tag = prefix.rstrip(".")
    return ParallelAttention(
        ColumnParallelLinear(piece("wq", q_spec), tp, q_spec, tag),
        ColumnParallelLinear(piece("wk", kv_spec), tp, kv_spec, tag),
        ColumnParallelLinear(piece("wv", kv_spec), tp, kv_spec, tag),
        RowParallelLinear(piece("wo", o_spec), tp, o_spec, tag), hd, tp, tag)


def parallelize_feed_forward(ff: FeedForward, tp: TPContext, full: FullTensor,
                             prefix: str = "") -> ParallelFeedForward:
    """Split the SwiGLU hidden units over tp: w1, w3 by rows, w2 by columns."""
    hidden = ff.w1.weight.shape[0]
    if hidden % tp.size:
        raise ValueError(f"tp={tp.size} must divide the MLP hidden size ffn_hidden={hidden}")
    col = ShardSpec(dim=0, chunks=tp.size, full_size=hidden)
    row = ShardSpec(dim=1, chunks=tp.size, full_size=hidden)

    def piece(name: str, spec: ShardSpec) -> torch.Tensor:
        linear = getattr(ff, name)
        _no_bias(linear, prefix + name)
        return shard(full(f"{prefix}{name}.weight", tuple(linear.weight.shape)), spec, tp)

    tag = prefix.rstrip(".")
    return ParallelFeedForward(ColumnParallelLinear(piece("w1", col), tp, col, tag),
                               ColumnParallelLinear(piece("w3", col), tp, col, tag),
                               RowParallelLinear(piece("w2", row), tp, row, tag), tp, tag)


def parallelize_block(block: Block, tp: TPContext, full: FullTensor, prefix: str = "") -> Block:
    """Swap a block's attention and MLP for their tensor-parallel versions (in place). The norms
    stay: replicated, or under SP run on the local sequence chunk. A mixture-of-experts
    feed-forward stays whole (replicated over tp; ``tessera.parallel.expert_parallel``)."""
    block.attention = parallelize_attention(block.attention, tp, full, prefix + "attention.")
    if isinstance(block.feed_forward, FeedForward):
        block.feed_forward = parallelize_feed_forward(block.feed_forward, tp, full,
                                                      prefix + "feed_forward.")
    return block


def parallelize_embedding(emb: nn.Embedding, tp: TPContext, full: FullTensor,
                          name: str = "tok_embeddings",
                          weight_name: str | None = None) -> VocabParallelEmbedding:
    """Split the embedding by vocabulary rows (the vocabulary padded to a multiple of tp).
    `name` tags its collectives; `weight_name` (default name + '.weight') is asked of `full`."""
    spec = ShardSpec(dim=0, chunks=tp.size, full_size=emb.num_embeddings, pad=True)
    weight_name = weight_name or f"{name}.weight"
    weight = shard(full(weight_name, tuple(emb.weight.shape)), spec, tp)
    return VocabParallelEmbedding(weight, tp, spec, name)


def parallelize_head(head: nn.Linear, tp: TPContext, full: FullTensor, name: str = "output",
                     tied_to: VocabParallelEmbedding | None = None,
                     weight_name: str | None = None) -> ColumnParallelLinear:
    """The LM head as a column-parallel linear over (padded) vocabulary rows; logits stay split.
    With `tied_to`, the head uses that embedding's shard, whose rows are the same vocabulary."""
    _no_bias(head, name)
    spec = ShardSpec(dim=0, chunks=tp.size, full_size=head.out_features, pad=True)
    if tied_to is not None:
        return ColumnParallelLinear(tied_to.weight, tp, spec, name)
    weight_name = weight_name or f"{name}.weight"
    weight = shard(full(weight_name, tuple(head.weight.shape)), spec, tp)
    return ColumnParallelLinear(weight, tp, spec, name)


def parallelize_module(module: nn.Module, tp: TPContext,
                       full_tensor: FullTensor | None = None) -> nn.Module:
    """Make `module` tensor-parallel in place and return it (a new module only when `module`
    itself is an embedding or a head).

    Every `Block` gets parallel attention and MLP; every `nn.Embedding` becomes vocab-parallel;
    every `nn.Linear` outside a block (the LM head) becomes a vocab-parallel column-parallel
    head, sharing the embedding's shard when its weight was the embedding's. The module may hold
    any subset of these (a pipeline stage).

    `full_tensor(name, shape)` gives each parameter's full value by its name in `module`; by
    default the module's own values are sharded. With a source, or for parameters on the meta
    device, the replicated parameters (norm gains) are also taken from it.
    """
    own = {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)}
    full = full_tensor or (lambda name, shape: own[name])
    named = dict(module.named_modules())
    blocks = [n for n, m in named.items() if isinstance(m, Block)]

    def in_block(name: str) -> bool:
        return any(name == b or name.startswith(b + ".") or b == "" for b in blocks)

    def replace(name: str, new: nn.Module) -> None:
        nonlocal module
        if not name:
            module = new
            return
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent), attr, new)

    def param_name(owner: str) -> str:
        return f"{owner}.weight" if owner else "weight"

    for name in blocks:
        parallelize_block(named[name], tp, full, name + "." if name else "")
    embeddings: dict[int, VocabParallelEmbedding] = {}
    for name, m in named.items():
        if isinstance(m, nn.Embedding) and not in_block(name):
            new = parallelize_embedding(m, tp, full, name, weight_name=param_name(name))
            embeddings[id(m.weight)] = new
            replace(name, new)
    for name, m in named.items():
        if isinstance(m, nn.Linear) and not in_block(name):
            replace(name, parallelize_head(m, tp, full, name, weight_name=param_name(name),
                                           tied_to=embeddings.get(id(m.weight))))
    for name, p in list(module.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if not isinstance(owner, PARALLEL_LAYERS) and (full_tensor is not None or p.is_meta):
            setattr(owner, attr, nn.Parameter(full(name, tuple(p.shape)).detach().clone()))
    return module


def apply_tensor_parallel(module: nn.Module, tp_group: dist.ProcessGroup | None,
                          sequence_parallel: bool = False, *, regather: bool = True,
                          stats: CommStats | None = None,
                          full_tensor: FullTensor | None = None) -> nn.Module:
    """Make the reference `module` (a Transformer, or any part of one) tensor-parallel in place
    over `tp_group`; see `parallelize_module`. Under sequence parallelism its input activations
    (if it starts past the embedding) and outputs are (B, T/t, h), and its blocks must still be
    given the RoPE tables of the full sequence."""
    tp = TPContext(group=tp_group, sequence_parallel=sequence_parallel, regather=regather,
                   stats=stats)
    return parallelize_module(module, tp, full_tensor)


def build_tensor_parallel_model(cfg: ModelConfig, seed: int, tp: TPContext) -> Transformer:
    """This rank's shard of `build_model(cfg, seed)`, made without building the full model: each
    parameter's full initial value comes from `init_tensor(cfg, name, shape, seed)` and is cut."""
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize_module(model, tp, lambda name, shape: init_tensor(cfg, name, shape, seed))
    model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                                 cfg.rope_scaling)
    return model


# ---------------------------------------------------------------------------------------------
# What the engine needs: layouts, gradient syncs, norms and full state dicts.


def param_specs(module: nn.Module, tp: TPContext) -> dict[str, ShardSpec]:
    """The ShardSpec of every parameter, by state-dict name (tied names included)."""
    out = {}
    for name, p in module.state_dict(keep_vars=True).items():
        if not isinstance(p, nn.Parameter):
            continue
        owner = module.get_submodule(name.rpartition(".")[0])
        out[name] = owner.spec if isinstance(owner, PARALLEL_LAYERS) else \
            ShardSpec(partial_grad=tp.sequence_parallel)
    return out


@torch.no_grad()
def sync_partial_grads(module: nn.Module, tp: TPContext) -> None:
    """Sum, over the ranks holding the same piece, the gradients that are partial: norm gains
    under SP (each rank saw its tokens) and replicated key/value heads (each rank's query heads).
    One all-reduce over tp of a buffer holding each piece in its slot; call after backward."""
    if tp.size == 1:
        return
    specs = param_specs(module, tp)
    items = [(p, specs[n]) for n, p in module.named_parameters() if specs[n].partial_grad]
    if not items:
        return
    slots = []
    for p, spec in items:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        slot = grad.new_zeros((spec.chunks, *grad.shape))  # (pieces, *shard)
        slot[spec.index(tp.rank, tp.size)] = grad
        slots.append(slot.flatten())
    flat = all_reduce(torch.cat(slots), tp.group, tp.stats, "grad_sync", "step", inplace=True)
    offset = 0
    for (p, spec), slot in zip(items, slots, strict=True):
        summed = flat[offset:offset + slot.numel()].view(spec.chunks, *p.shape)
        mine = summed[spec.index(tp.rank, tp.size)]
        if p.grad is None:
            p.grad = mine.clone()
        else:  # in place: the gradient stays where it lives (e.g. a DDP bucket), not a copy
            p.grad.copy_(mine)
        offset += slot.numel()


def owned_grad_sq(module: nn.Module, tp: TPContext) -> torch.Tensor:
    """Σ grad² over the entries this rank owns: sharded pieces on every rank, replicated pieces
    on their first holder only, so an all-reduce over tp gives the full model's squared norm."""
    specs = param_specs(module, tp)
    sq = torch.zeros((), dtype=torch.float64, device=next(module.parameters()).device)
    add_sums_of_squares(sq, [p.grad.detach() for name, p in module.named_parameters()
                             if p.grad is not None and specs[name].owns(tp.rank, tp.size)])
    return sq


@torch.no_grad()
def gather_state_dict(module: nn.Module, tp: TPContext) -> dict[str, torch.Tensor]:
    """The reference state dict (names and full values) on every rank."""
    specs = param_specs(module, tp)
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        out[name] = gather_full(value, specs[name], tp) if name in specs else \
            value.detach().clone()
    return out
