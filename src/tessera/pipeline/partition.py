"""Stage partitioning: cut the reference model into p·v contiguous chunks of layers.

Chunk 0 also holds the token embedding, the last chunk the final norm, the LM head and the
loss. The split balances an estimated forward cost per token (matmul FLOPs, as in
``tessera.model.flops_per_token``): each block costs 2·N_block + 4·a·d·T, the head 2·V·h, and
the embedding lookup h (a copy, no FLOPs). Among contiguous splits with at least one block per
chunk, the one with the smallest most-expensive chunk is chosen, ties broken by the least sum
of squared chunk costs (two exact dynamic programmes, O(chunks·L²)), so a heavy LM head pushes
blocks towards the earlier chunks. The user can give
the split instead, as blocks per chunk.

A chunk is an ``nn.Module`` whose parameter names are the reference model's
(``tok_embeddings.weight``, ``layers.5.attention.wq.weight``, ``norm.weight``,
``output.weight``), initialized with ``init_tensor`` under those names: a pipeline stage starts
from exactly the weights the single-device model starts from.

Tied embeddings (Press & Wolf, 2017): the LM head multiplies by the embedding matrix. When the
first and last chunks share a rank the head reads that rank's embedding weight directly (one
parameter, gradients accumulate in it). When they are on different ranks, the last one holds a
copy initialized identically, and after each step's backward the two gradients are summed over
the (first, last) rank pair (see ``PipelineEngine``), so both copies take identical optimizer
steps and stay equal (Megatron-LM's embedding group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.model import Block, RMSNorm, cross_entropy, init_tensor, rope_tables


@dataclass(frozen=True)
class ChunkSpec:
    """What one chunk holds."""

    index: int
    layers: range
    """Indices of the reference model's blocks in this chunk."""
    has_embedding: bool
    has_head: bool


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """Forward FLOPs per token of (embedding, each block, final norm + head + loss)."""
    h, d, a, kv, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden
    block_matmul = h * (a + 2 * kv) * d + a * d * h + 3 * h * f
    block = 2.0 * block_matmul + 4.0 * a * d * seq_len
    head = 2.0 * cfg.vocab_size * h + 5.0 * cfg.vocab_size  # matmul, then softmax + loss
    return float(h), [block] * cfg.n_layers, head


def balance(costs: Sequence[float], n_chunks: int, first_extra: float = 0.0,
            last_extra: float = 0.0) -> list[int]:
    """Blocks per chunk minimizing the costliest chunk (first/last chunks carry extras)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(k: int, i: int, j: int) -> float:  # chunk k holds blocks i..j-1
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == n_chunks - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")

    def solve(score, combine) -> tuple[float, list[int]]:
        """DP over (chunks used, blocks placed); returns the best score and the cut points."""
        best = [[inf] * (n + 1) for _ in range(n_chunks)]
        cut = [[0] * (n + 1) for _ in range(n_chunks)]
        for j in range(1, n + 1):
            best[0][j] = score(cost(0, 0, j))
        for k in range(1, n_chunks):
            for j in range(k + 1, n + 1):
                for i in range(k, j):
                    value = combine(best[k - 1][i], score(cost(k, i, j)))
                    if value < best[k][j] - 1e-9:
                        best[k][j], cut[k][j] = value, i
        sizes, j = [], n
        for k in range(n_chunks - 1, 0, -1):
            sizes.append(j - cut[k][j])
            j = cut[k][j]
        sizes.append(j)
        return best[n_chunks - 1][n], sizes[::-1]

    # First the smallest possible costliest chunk M; then, among splits within M, the most even
    # one (least sum of squared chunk costs), so ties do not leave one chunk needlessly light.
    limit, _ = solve(lambda c: c, max)
    _, sizes = solve(lambda c: c * c if c <= limit + 1e-9 * max(1.0, limit) else inf,
                     lambda a, b: a + b)
    return sizes


def partition(cfg: ModelConfig, n_chunks: int, seq_len: int | None = None,
              split: Sequence[int] | None = None) -> list[ChunkSpec]:
    """The chunks of a p·v-way split: balanced by estimated cost, or `split` blocks per chunk."""
    if n_chunks > cfg.n_layers:
        raise ConfigError("parallel.pp", n_chunks, f"pp*virtual_stages={n_chunks} stages exceed "
                          f"model.n_layers={cfg.n_layers} (each stage needs a block)")
    if split is not None:
        split = list(split)
        if len(split) != n_chunks:
            raise ConfigError("split", split, f"needs one entry per stage ({n_chunks})")
        if any(not isinstance(s, int) or s < 1 for s in split):
            raise ConfigError("split", split, "every stage needs at least one block")
        if sum(split) != cfg.n_layers:
            raise ConfigError("split", split, f"must add up to model.n_layers={cfg.n_layers}")
        sizes = split
    else:
        embed, blocks, head = layer_costs(cfg, seq_len or cfg.max_seq_len)
        sizes = balance(blocks, n_chunks, embed, head)
    specs, start = [], 0
    for k, size in enumerate(sizes):
        specs.append(ChunkSpec(k, range(start, start + size), k == 0, k == n_chunks - 1))
        start += size
    return specs


class Chunk(nn.Module):
    """One pipeline chunk: [embedding] → blocks → [norm → head], reference parameter names.

    Built like the reference model (on the meta device when the caller asks for it, see
    ``tessera.parallelize``), then transformed in place by the parallel mechanisms: tensor
    parallelism swaps its blocks, embedding and head (``parallelize_module`` works on any subset
    of the model), recomputation wraps its blocks. The forward reads only what the chunk holds:

    - ``seq_scale``: under sequence parallelism a chunk past the embedding receives (B, T/t, h)
      and its blocks still need the RoPE tables of the whole sequence, T = seq_scale·T_local;
    - ``compute_dtype``: activations entering the chunk are cast to it (bf16 parameters need
      bf16 inputs; activations may arrive in another dtype from another rank);
    - the head is ``self.output`` (a plain or column-parallel linear), or the embedding of
      another chunk on this rank when embeddings are tied (``shared_head``; kept in a list so
      that the weight is registered, and reduced, in one chunk only).
    """

    def __init__(self, cfg: ModelConfig, spec: ChunkSpec, seed: int | None = None,
                 device: str | torch.device = "cpu",
                 shared_embedding: nn.Embedding | None = None):
        """`seed`: initialize from the reference initializer now (None: leave the parameters
        as built, e.g. on the meta device, for ``materialize`` later)."""
        super().__init__()
        self.cfg, self.spec = cfg, spec
        self.tied_copy = False
        self.seq_scale = 1
        self.compute_dtype: torch.dtype | None = None
        if spec.has_embedding:
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in spec.layers})
        # The head's weight when it is the embedding of another chunk on this rank.
        self._shared: list[nn.Module] = []
        if spec.has_head:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            if cfg.tie_embeddings and spec.has_embedding:
                self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
                self.output.weight = self.tok_embeddings.weight
            elif cfg.tie_embeddings and shared_embedding is not None:
                self._shared.append(shared_embedding)
            else:
                self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
                self.tied_copy = cfg.tie_embeddings
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if seed is not None:
            self.materialize(seed, device)

    def reference_name(self, name: str) -> str:
        """This chunk's parameter name in the reference model's named_parameters()."""
        if self.tied_copy and name == "output.weight":
            return "tok_embeddings.weight"
        return name

    @torch.no_grad()
    def materialize(self, seed: int, device: str | torch.device = "cpu") -> Chunk:
        """Give every parameter its reference initial value (``init_tensor`` under its
        reference name) on `device`; meta parameters are replaced, others overwritten."""
        for name, p in list(self.named_parameters()):
            value = init_tensor(self.cfg, self.reference_name(name), p.shape, seed)
            if p.is_meta:
                owner_name, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner_name), attr,
                        nn.Parameter(value.to(device)))
            else:
                p.copy_(value)
        if self.spec.has_head and self.cfg.tie_embeddings and self.spec.has_embedding \
                and isinstance(self.output, nn.Linear):
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos, self.rope_sin = cos, sin
        return self.to(device)

    def head_weight(self) -> torch.Tensor:
        return self._shared[0].weight if self._shared else self.output.weight

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) — or this rank's vocabulary columns under tensor parallelism."""
        if self._shared:
            shared = self._shared[0]  # another chunk's embedding, or a head reading its weight
            return F.linear(x, shared.weight) if isinstance(shared, nn.Embedding) else shared(x)
        return self.output(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Chunk 0: tokens (B, T) int64; otherwise the residual stream (B, T_local, h).
        Returns the residual stream, or logits (B, T, V[/t]) from the last chunk."""
        if self.spec.has_embedding:
            T = x.shape[1]
            x = self.tok_embeddings(x)  # (B, T[/t under SP], h)
        else:
            T = x.shape[1] * self.seq_scale
            if self.compute_dtype is not None:
                x = x.to(self.compute_dtype)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.spec.has_head:
            return self.head(self.norm(x))  # (B, T, V[/t])
        return x


def chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference model's loss (mean token cross-entropy), computed in the last chunk."""
    return cross_entropy(logits, targets)
