"""Tessera's tensor-parallel plan: which module of ``tessera.model`` becomes which parallel layer.

Attention splits its query heads (wq column-parallel; wk, wv column-parallel over the key/value
heads, replicated when there are fewer than tp; wo row-parallel), the SwiGLU MLP its hidden
units (w1, w3 column-parallel; w2 row-parallel); the embedding and the LM head are split by
vocabulary rows. Everything else (norm gains, a mixture-of-experts feed-forward, whose inner
linears the plan does not name) stays whole on every tp rank. ``tensor_parallel.apply_plan``
carries the plan out; the model code does not know about ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ModelConfig
from tessera.model import Transformer, init_tensor, rope_tables
from tessera.parallel.comm import CommStats
from tessera.parallel.tensor_parallel import (
    ColwiseParallel,
    FullTensor,
    Plan,
    RowwiseParallel,
    TPContext,
    VocabParallel,
    apply_plan,
)

PLAN: Plan = {
    "tok_embeddings": VocabParallel(),
    "attention.wq": ColwiseParallel(units="n_heads"),
    "attention.wk": ColwiseParallel(units="n_kv_heads", replicate=True),
    "attention.wv": ColwiseParallel(units="n_kv_heads", replicate=True),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
    "output": VocabParallel(),
}
"""Module name (a suffix: every block's "attention.wq") -> style."""


def parallelize_module(module: nn.Module, tp: TPContext,
                       full_tensor: FullTensor | None = None) -> nn.Module:
    """`module` (a Transformer, a pipeline chunk, a block, or a lone embedding or head, which
    becomes vocabulary-parallel) made tensor-parallel in place by `PLAN`; see `apply_plan`."""
    plan = {"": VocabParallel()} if isinstance(module, nn.Embedding | nn.Linear) else PLAN
    return apply_plan(module, plan, tp, full_tensor)


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
