"""The ZeRO engine: the reference model wrapped by ``ZeroModel`` over the dp group.

``build_engine`` picks it when ``parallel.zero_stage > 0``. It differs from the plain
data-parallel engine in three places: the optimizer is ``ShardedAdamW`` over the units' fp32
master shards; the gradient norm sums each rank's dp slice of the reduced gradient over the dp
group (every element counted once, whatever the stage); and ``train.precision = "bf16"`` puts
the parameters and gradients themselves in bf16 (fp32 masters) instead of using autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tessera.config import Config, TrainConfig
from tessera.engine import Engine, MicroBatch, all_reduce_sum
from tessera.model import build_model, cross_entropy
from tessera.parallel.recompute import apply_recompute
from tessera.parallel.zero import ZeroModel
from tessera.parallel.zero_state import (
    ShardedAdamW,
    allocated_model_state,
    full_state_dict,
    load_full_state_dict,
    memory_report,
)
from tessera.topology import Topology


class ZeroEngine(Engine):
    """ZeRO stage `stage` (default: the config's parallel.zero_stage) over the dp group."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device,
                 stage: int | None = None):
        super().__init__(cfg, topo, device)
        self.autocast = False  # bf16 lives in the parameters, not in an autocast region
        self.stage = cfg.parallel.zero_stage if stage is None else stage
        dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        model = build_model(cfg.model, cfg.train.seed, device)
        apply_recompute(model, cfg.parallel.recompute)
        self.zero = ZeroModel(model, topo.group("dp"), stage=self.stage, dtype=dtype)
        self.opt: ShardedAdamW | None = None

    def parameters(self) -> list[torch.Tensor]:
        """The fp32 master tensors this rank steps (its shards; whole units at stage 0)."""
        return [u.master for u in self.zero.units]

    def optimizer(self, cfg: TrainConfig) -> ShardedAdamW:
        self.opt = ShardedAdamW(self.zero, cfg)
        return self.opt

    def after_parameters_loaded(self) -> None:
        """The fp32 masters were loaded: cast them into the compute parameters (and gather)."""
        self.zero.publish_parameters()

    def grad_norm_groups(self) -> list[dist.ProcessGroup]:
        return [self.zero.group] if self.zero.world > 1 else []

    def local_grad_sq(self) -> torch.Tensor:
        return self.zero.local_grad_sq()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global norm from the shards (Engine's reduction); scale the gradient buffers."""
        norm = super().clip_grad_norm_(0.0)
        if max_norm > 0 and norm > max_norm:
            self.zero.scale_grads(max_norm / (norm + 1e-6))
        return norm

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> float:
        self.zero.train()
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.zero.no_sync():
                logits = self.zero(x.to(self.device))
                loss = cross_entropy(logits, y.to(self.device)) / len(micro_batches)
                loss.backward()
            total += loss.detach()
        self.zero.finish_gradient_sync()
        (mean,) = all_reduce_sum([float(total)], self.zero.group, self.device)
        return mean / self.zero.world

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[MicroBatch]) -> tuple[float, int]:
        self.zero.eval()
        return self.summed_loss(batches, lambda x, y: cross_entropy(self.zero(x), y),
                                self.zero.group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.zero)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's shard of a reference-named state dict (from any layout)."""
        load_full_state_dict(self.zero, state)

    def full_optimizer_state(self) -> dict:
        """Adam moments and step by reference name, gathered on every rank (see ShardedAdamW)."""
        if self.opt is None:
            raise RuntimeError("full_optimizer_state() needs optimizer() to have been called")
        return self.opt.full_state()

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes per rank from the layout (parameters, gradients, optimizer)."""
        return memory_report(self.zero)

    def allocated_model_state(self) -> dict[str, int]:
        """Model-state bytes per rank counted from the tensors actually allocated."""
        if self.opt is None:
            raise RuntimeError("allocated_model_state() needs optimizer() to have been called")
        return allocated_model_state(self.zero, self.opt)
