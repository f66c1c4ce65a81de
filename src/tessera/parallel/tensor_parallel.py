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
splits its hidden units (w1, w3 column-parallel; w2 row-parallel; tessera's plan, ``tp_plan.py``;
the column-parallel linears of one module enter the region once), so each block costs per
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
head is column-parallel and its logits stay split: ``vocab_parallel_cross_entropy``
(``vocab_parallel_loss.py``) computes the loss with two all-reduces, of the b·s row maxima and
then of the b·s sums of exponentials stacked with the b·s target logits, never gathering the
b·s·V logits. A vocabulary not divisible by t is padded with zero rows whose logits are masked
to −inf, so padding changes neither the loss nor any gradient, and the padding rows' gradients
are exactly zero.

Invariants: the residual stream is replicated on every tp rank (without SP) or split by
sequence (with SP); a parameter shard on rank r is rows/columns r of the reference tensor
(``ShardSpec``), so a sharded model initialized from a seed is the reference model from that
seed, sharded, and `gather_state_dict` returns reference names and values on every rank.
Model code stays rank-unaware: `apply_plan` swaps the modules a plan names (module name ->
``ColwiseParallel``, ``RowwiseParallel`` or ``VocabParallel``) for the parallel layers below,
on any module holding a subset of them (a pipeline stage); tessera's own plan is ``tp_plan.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.optim import add_sums_of_squares
from tessera.parallel import sequence_parallel as sp
from tessera.parallel.comm import (
    CommStats,
    all_gather,
    all_reduce,
    conjugate,
    group_rank,
    group_size,
)

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

    # Both collectives are graph breaks under torch.compile (``parallel.compile``): dynamo does
    # not trace blocking process-group calls, so they run eagerly between compiled graphs.
    @torch.compiler.disable
    def enter(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """Enter a tensor-parallel region: f, or SP's g (all-gather along the sequence)."""
        if self.sequence_parallel:
            return sp.g(x, self.group, self.stats, tag + ":enter")
        return f(x, self.group, self.stats, tag + ":enter")

    @torch.compiler.disable
    def exit(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """Leave a tensor-parallel region: g, or SP's ḡ (reduce-scatter along the sequence)."""
        if self.sequence_parallel:
            return sp.g_bar(x, self.group, self.stats, tag + ":exit")
        return g(x, self.group, self.stats, tag + ":exit")


# ---------------------------------------------------------------------------------------------
# The conjugate operators f and g (Shoeybi et al. 2019, Fig. 3).


def _all_reduce_in_place(x: torch.Tensor, group, stats, tag: str, phase: str) -> torch.Tensor:
    # The input is a fresh matmul output that nothing saved: reduce it in place (a leaf, say in
    # a test, cannot be modified in place and is copied).
    return all_reduce(x, group, stats, tag, phase, inplace=not (x.is_leaf and x.requires_grad))


f = conjugate("CopyToTensorParallelRegion", lambda x, *_: x.view_as(x), all_reduce,
              "Megatron's f: identity forward, all-reduce of the gradient backward.")
g = conjugate("ReduceFromTensorParallelRegion", _all_reduce_in_place, lambda grad, *_: grad,
              "Megatron's g: all-reduce forward, identity backward.")


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


class ShardedLayer(nn.Module):
    """A layer holding this rank's piece `weight` of a reference parameter laid out by `spec`;
    `tag` names its collectives. A given nn.Parameter is kept (a head tied to an embedding)."""

    def __init__(self, weight: torch.Tensor, tp: TPContext, spec: ShardSpec, tag: str = ""):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.tp, self.spec, self.tag = tp, spec, tag

    def extra_repr(self) -> str:
        return f"shard={tuple(self.weight.shape)}, tp={self.tp.size}, spec={self.spec}"


class SharedInput:
    """Column-parallel linears that read one input (a block's wq, wk, wv): the first called
    computes all their outputs with one entry into the region (one f, or one SP all-gather),
    the others take theirs, so a module calling them one by one, as the reference model does,
    pays one collective per region, not one per linear."""

    def __init__(self, tp: TPContext, tag: str):
        self.tp, self.tag = tp, tag
        self.layers: list[ColumnParallelLinear] = []
        self._input: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}

    # A graph break under torch.compile, as TPContext.enter: this bookkeeping keys the pending
    # outputs by id(layer), which dynamo would guard on, compiling every block's code anew.
    @torch.compiler.disable
    def output(self, layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or id(layer) not in self._pending:
            outs = column_parallel(x, self.layers, self.tp, self.tag)
            self._input = x
            self._pending = {id(m): y for m, y in zip(self.layers, outs, strict=True)}
        out = self._pending.pop(id(layer))
        if not self._pending:
            self._input = None
        return out


class ColumnParallelLinear(ShardedLayer):
    """Y_r = X·A_rᵀ with A split by output rows; the input enters the region through f (or SP's
    g), once for all the linears of `shared`; the output stays split over the tp ranks."""

    def __init__(self, weight: torch.Tensor, tp: TPContext, spec: ShardSpec, tag: str = "",
                 shared: SharedInput | None = None):
        super().__init__(weight, tp, spec, tag)
        self.shared = shared
        if shared is not None:
            shared.layers.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared.output(self, x)
        return column_parallel(x, [self], self.tp, self.tag)[0]


class RowParallelLinear(ShardedLayer):
    """Z = Σ_r Y_r·B_rᵀ with B split by input columns; the partial sums leave the region
    through g (or SP's ḡ)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.exit(F.linear(x, self.weight), self.tag)


def column_parallel(x: torch.Tensor, layers: Sequence[ColumnParallelLinear], tp: TPContext,
                    tag: str) -> tuple[torch.Tensor, ...]:
    """Several column-parallel linears reading one input, which enters the region once (one f,
    or one SP all-gather)."""
    weights = [layer.weight for layer in layers]
    if tp.sequence_parallel and tp.regather and tp.size > 1:
        return sp.gather_then_linears(x, weights, tp.group, tp.stats, tag + ":enter")
    x = tp.enter(x, tag)
    return tuple(F.linear(x, w) for w in weights)


class VocabParallelEmbedding(ShardedLayer):
    """The embedding split by vocabulary rows: rank r looks up ids in its range, zeroes the
    others, and the partial embeddings are summed by g (all-reduce) or, under SP, by ḡ
    (reduce-scatter, leaving each rank its sequence chunk)."""

    def __init__(self, weight: torch.Tensor, tp: TPContext, spec: ShardSpec, tag: str = ""):
        super().__init__(weight, tp, spec, tag)
        self.vocab_start = spec.index(tp.rank, tp.size) * weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start  # (B, T)
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, h)
        return self.tp.exit(out.masked_fill(outside[..., None], 0.0), self.tag)

    def extra_repr(self) -> str:
        return f"shard={tuple(self.weight.shape)}, start={self.vocab_start}, tp={self.tp.size}"


# ---------------------------------------------------------------------------------------------
# Plans: which module of a reference model becomes which parallel layer.


def _no_bias(linear: nn.Linear, name: str) -> None:
    if linear.bias is not None:
        raise ValueError(f"{name}: tensor parallelism here supports linears without bias")


@dataclass(frozen=True)
class ColwiseParallel:
    """An nn.Linear split by output rows (`ColumnParallelLinear`). `units` names the attribute
    of the linear's owner that counts the groups of rows kept whole on one rank (attention
    heads); with `replicate`, fewer groups than ranks are each held by tp/groups ranks (their
    gradients are partial sums), else tp must divide them. The column-parallel linears of one
    owner read its input and enter the region once (`SharedInput`); their collectives are
    tagged with the owner's name."""

    units: str | None = None
    replicate: bool = False

    def spec(self, linear: nn.Linear, name: str, owner: nn.Module, t: int) -> ShardSpec:
        _no_bias(linear, name)
        rows = linear.out_features
        n = getattr(owner, self.units) if self.units else rows
        if n % t == 0:
            chunks = t
        elif self.replicate and t % n == 0:
            chunks = n
        else:
            raise ValueError(f"tp={t} must divide {self.units or name + '.out_features'}={n}"
                             + (" or be a multiple of it" if self.replicate else ""))
        return ShardSpec(dim=0, chunks=chunks, full_size=rows, partial_grad=chunks < t)


@dataclass(frozen=True)
class RowwiseParallel:
    """An nn.Linear split by input columns (`RowParallelLinear`), leaving the region its
    owner's column-parallel linears entered; tagged with the owner's name."""

    def spec(self, linear: nn.Linear, name: str, owner: nn.Module, t: int) -> ShardSpec:
        _no_bias(linear, name)
        return ShardSpec(dim=1, chunks=t, full_size=linear.in_features)


@dataclass(frozen=True)
class VocabParallel:
    """An nn.Embedding (`VocabParallelEmbedding`) or an LM head (a `ColumnParallelLinear` whose
    logits stay split) over vocabulary rows, the vocabulary padded to a multiple of tp; tagged
    with the module's own name."""

    def spec(self, module: nn.Module, name: str, owner: nn.Module | None, t: int) -> ShardSpec:
        if isinstance(module, nn.Linear):
            _no_bias(module, name)
        return ShardSpec(dim=0, chunks=t, full_size=module.weight.shape[0], pad=True)


Style = ColwiseParallel | RowwiseParallel | VocabParallel
Plan = dict[str, Style]
"""Module name -> style. A key names every module whose name is the key or ends with "." and
the key ("attention.wq" is that linear in every block); "" names the root module."""


def _style(plan: Plan, name: str) -> Style | None:
    return next((s for key, s in plan.items() if name == key or name.endswith("." + key)), None)


def apply_plan(module: nn.Module, plan: Plan, tp: TPContext,
               full_tensor: FullTensor | None = None) -> nn.Module:
    """Make `module` tensor-parallel in place by `plan` and return it (the new layer when the
    plan names `module` itself). Modules the plan does not name stay whole, replicated over tp;
    a planned name `module` does not hold is skipped, so one plan serves any part of a model (a
    pipeline stage). A weight shared by two planned modules (a tied embedding and head) stays
    shared: both layers hold the same shard.

    `full_tensor(name, shape)` gives each parameter's full value by its name in `module`; by
    default the module's own values are sharded. With a source, or for parameters on the meta
    device, the replicated parameters (norm gains) are also taken from it.
    """
    own = {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)}
    full = full_tensor or (lambda name, shape: own[name])
    shards: dict[int, nn.Parameter] = {}  # id of a reference weight -> its shard
    regions: dict[str, SharedInput] = {}
    root = module
    for name, m in list(root.named_modules()):
        style = _style(plan, name)
        if style is None:
            continue
        owner_name = name.rpartition(".")[0]
        owner = root.get_submodule(owner_name) if name else None
        spec = style.spec(m, name, owner, tp.size)
        if id(m.weight) not in shards:
            weight_name = f"{name}.weight" if name else "weight"
            shards[id(m.weight)] = nn.Parameter(
                shard(full(weight_name, tuple(m.weight.shape)), spec, tp))
        weight = shards[id(m.weight)]
        if isinstance(style, VocabParallel):
            layer_type = VocabParallelEmbedding if isinstance(m, nn.Embedding) else \
                ColumnParallelLinear
            new: nn.Module = layer_type(weight, tp, spec, name)
        elif isinstance(style, RowwiseParallel):
            new = RowParallelLinear(weight, tp, spec, owner_name)
        else:
            shared = regions.setdefault(owner_name, SharedInput(tp, owner_name))
            new = ColumnParallelLinear(weight, tp, spec, owner_name, shared)
        if name:
            setattr(owner, name.rpartition(".")[2], new)
        else:
            module = new
    for name, p in list(module.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if not isinstance(owner, ShardedLayer) and (full_tensor is not None or p.is_meta):
            setattr(owner, attr, nn.Parameter(full(name, tuple(p.shape)).detach().clone()))
    return module


# ---------------------------------------------------------------------------------------------
# What the engine needs: layouts, gradient syncs, norms and full state dicts.


def param_specs(module: nn.Module, tp: TPContext) -> dict[str, ShardSpec]:
    """The ShardSpec of every parameter, by state-dict name (tied names included)."""
    out = {}
    for name, p in module.state_dict(keep_vars=True).items():
        if not isinstance(p, nn.Parameter):
            continue
        owner = module.get_submodule(name.rpartition(".")[0])
        out[name] = owner.spec if isinstance(owner, ShardedLayer) else \
            ShardSpec(partial_grad=tp.sequence_parallel)
    return out


@torch.no_grad()
def sync_partial_grads(module: nn.Module, tp: TPContext) -> None:
    """Sum, over the ranks holding the same piece, the gradients that are partial: norm gains
    under SP (each rank saw its tokens) and replicated key/value heads (each rank's query heads).
    Call after backward; see `sum_partial_pieces`."""
    if tp.size == 1:
        return
    specs = param_specs(module, tp)
    items = [(p, specs[n]) for n, p in module.named_parameters() if specs[n].partial_grad]
    for p, _ in items:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sum_partial_pieces([(p.grad, spec) for p, spec in items], tp)


@torch.no_grad()
def sum_partial_pieces(items: list[tuple[torch.Tensor, ShardSpec]], tp: TPContext) -> None:
    """Sum each gradient (or part of one) over the tp ranks holding the same piece of its
    parameter (`spec`), in place: the gradient stays where it lives (a DDP bucket, a ZeRO
    buffer). One all-reduce over tp of a buffer holding each piece in its slot."""
    if not items:
        return
    slots = []
    for grad, spec in items:
        slot = grad.new_zeros((spec.chunks, grad.numel()))  # (pieces, numel)
        slot[spec.index(tp.rank, tp.size)] = grad.reshape(-1)
        slots.append(slot.flatten())
    flat = all_reduce(torch.cat(slots), tp.group, tp.stats, "grad_sync", "step", inplace=True)
    offset = 0
    for (grad, spec), slot in zip(items, slots, strict=True):
        summed = flat[offset:offset + slot.numel()].view(spec.chunks, *grad.shape)
        grad.copy_(summed[spec.index(tp.rank, tp.size)])
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
