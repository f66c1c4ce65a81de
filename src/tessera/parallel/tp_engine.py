"""The engine for tensor (and sequence) parallelism, composed with data parallelism.

Each rank holds its tp shard of the model (``tensor_parallel.build_tensor_parallel_model``), and
the shards are replicated over the dp group by ``DataParallel``. One optimizer step:

1. forward/backward of each micro-batch; the loss is the vocabulary-parallel cross-entropy of the
   split logits (identical on every tp rank);
2. gradients averaged over dp (``DataParallel.finish_gradient_sync``), then partial gradients
   summed over tp (norm gains under SP, replicated key/value heads);
3. the global gradient norm: each rank sums the squares of the entries it owns (shards, and
   replicated tensors on their first holder), all-reduced over tp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config
from tessera.engine import Engine, MicroBatch, all_reduce_sum
from tessera.parallel.comm import CommStats
from tessera.parallel.ddp import DataParallel
from tessera.parallel.recompute import apply_recompute
from tessera.parallel.tensor_parallel import (
    TPContext,
    build_tensor_parallel_model,
    gather_state_dict,
    owned_grad_sq,
    sync_partial_grads,
    vocab_parallel_cross_entropy,
)
from tessera.topology import Topology


class TensorParallelEngine(Engine):
    """Megatron TP (optionally with SP) inside each replica, plain DP across replicas."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device, *,
                 regather: bool = True):
        super().__init__(cfg, topo, device)
        self.stats = CommStats()
        """The collectives of the last step (reset by each forward_backward)."""
        self.tp = TPContext(group=topo.group("tp"),
                            sequence_parallel=cfg.parallel.sequence_parallel, regather=regather,
                            stats=self.stats)
        self.model = build_tensor_parallel_model(cfg.model, cfg.train.seed, self.tp).to(device)
        apply_recompute(self.model, cfg.parallel.recompute)
        self.ddp = DataParallel(self.model, topo.group("dp"))

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast_ctx():
            logits = self.ddp(x.to(self.device))  # (B, T, V_padded/tp)
        return vocab_parallel_cross_entropy(logits, y.to(self.device), self.cfg.model.vocab_size,
                                            self.tp)

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> float:
        self.model.train()
        self.stats.reset()
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss = self.loss(x, y) / len(micro_batches)
                loss.backward()
            total += loss.detach()
        self.ddp.finish_gradient_sync()
        sync_partial_grads(self.model, self.tp)
        (mean,) = all_reduce_sum([float(total)], self.topo.group("dp"), self.device)
        return mean / self.topo.dp

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[MicroBatch]) -> tuple[float, int]:
        self.model.eval()
        return self.summed_loss(batches, self.loss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_state_dict(self.model, self.tp)

    def grad_norm_groups(self) -> list[dist.ProcessGroup]:
        return [self.tp.group] if self.tp.size > 1 else []

    def local_grad_sq(self) -> torch.Tensor:
        return owned_grad_sq(self.model, self.tp)
