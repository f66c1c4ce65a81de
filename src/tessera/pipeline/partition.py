"""Stage partitioning: cut the reference model into p·v contiguous chunks of layers.

Chunk 0 also holds the token embedding, the last chunk the final norm, the LM head and the
loss. How many blocks each chunk gets is ``tessera.pipeline.split``'s cost-balanced split (or
the user's, as blocks per chunk).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig
from tessera.model import Block, RMSNorm, cross_entropy, init_tensor, rope_tables
from tessera.moe import materialize_buffers
from tessera.pipeline.split import balance, block_split, layer_costs

__all__ = ["Chunk", "ChunkSpec", "balance", "chunk_loss", "layer_costs", "partition"]


@dataclass(frozen=True)
class ChunkSpec:
    """What one chunk holds."""

    index: int
    layers: range
    """Indices of the reference model's blocks in this chunk."""
    has_embedding: bool
    has_head: bool


def partition(cfg: ModelConfig, n_chunks: int, seq_len: int | None = None,
              split: Sequence[int] | None = None) -> list[ChunkSpec]:
    """The chunks of a p·v-way split: balanced by estimated cost, or `split` blocks per chunk
    (``tessera.pipeline.split``)."""
    specs, start = [], 0
    for k, size in enumerate(block_split(cfg, n_chunks, seq_len, split)):
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
    - ``context_parallel``: (cp, cp rank) when the chunk holds this cp rank's zig-zag tokens of
      each sequence: RoPE reads the tables at their global positions;
    - ``compute_dtype``: activations entering the chunk are cast to it (bf16 parameters need
      bf16 inputs; activations may arrive in another dtype from another rank);
    - the head is ``self.output`` (a plain or column-parallel linear), or the embedding of
      another chunk on this rank when embeddings are tied (``shared_head``; kept in a list so
      that the weight is registered, and reduced, in one chunk only);
    - ``head_in_loss``: the last chunk returns the normed hidden states (B, T, h) and the loss
      applies the head (``train.loss_chunk_tokens``: the head's matmul chunked with the loss).
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
        self.context_parallel: tuple[int, int] | None = None
        self.compute_dtype: torch.dtype | None = None
        self.head_in_loss = False
        if spec.has_embedding:
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in spec.layers})
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
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
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
    def materialize(self, seed: int, device: str | torch.device = "cpu",
                    initial: Callable[[str, tuple[int, ...]], torch.Tensor] | None = None
                    ) -> Chunk:
        """Give every parameter its reference initial value (``init_tensor`` under its
        reference name, or ``initial(reference name, shape)``: loaded weights) on `device`;
        meta parameters are replaced, others overwritten."""
        for name, p in list(self.named_parameters()):
            ref = self.reference_name(name)
            value = (initial(ref, tuple(p.shape)) if initial is not None
                     else init_tensor(self.cfg, ref, p.shape, seed))
            if p.is_meta:
                owner_name, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner_name), attr,
                        nn.Parameter(value.to(device)))
            else:
                p.copy_(value)
        if self.spec.has_head and self.cfg.tie_embeddings and self.spec.has_embedding \
                and isinstance(self.output, nn.Linear):
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                               self.cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos, sin
        materialize_buffers(self)
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
        Returns the residual stream, or from the last chunk logits (B, T, V[/t]) (with
        ``head_in_loss``: the normed hidden states, the head's input)."""
        if self.spec.has_embedding:
            T = x.shape[1]
            x = self.tok_embeddings(x)  # (B, T[/t under SP], h)
        else:
            T = x.shape[1] * self.seq_scale
            if self.compute_dtype is not None:
                x = x.to(self.compute_dtype)
        if self.context_parallel is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:  # this cp rank's tokens sit at their zig-zag global positions
            from tessera.parallel.context_parallel import sequence_positions

            cp, cp_rank = self.context_parallel
            pos = sequence_positions(T * cp, cp, cp_rank).to(self.rope_cos.device)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.spec.has_head:
            x = self.norm(x)
            return x if self.head_in_loss else self.head(x)  # (B, T, V[/t])
        return x


def chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference model's loss (mean token cross-entropy), computed in the last chunk."""
    return cross_entropy(logits, targets)
