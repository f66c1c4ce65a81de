"""Engines: what the trainer drives, one per way of running a model step across ranks.

The trainer knows nothing of parallelism. It asks an engine for

- ``forward_backward(micro_batches)``: run this rank's micro-batches of one optimizer step,
  leave synchronized gradients on the parameters, return the step's mean loss (the same value
  on every rank);
- ``parameters()`` and ``optimizer(cfg)``: what to optimize and how;
- ``clip_grad_norm_(max_norm)``: the global gradient norm across every shard and replica;
- ``eval_loss(batches)``: summed validation loss and token count over all data-parallel ranks;
- ``full_state_dict()``: the reference model's state dict (names as in ``tessera.model``),
  gathered from whatever shards the engine holds, on every rank.

``build_engine`` picks the engine from the parallel config. Each parallel mechanism adds its
engine here and nowhere else in the trainer.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config, ConfigError, TrainConfig
from tessera.model import Transformer, build_model, cross_entropy
from tessera.parallel.ddp import DataParallel
from tessera.parallel.recompute import apply_recompute
from tessera.topology import Topology

MicroBatch = tuple[torch.Tensor, torch.Tensor]


def adamw(params: Iterable[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed)."""
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), foreach=False)


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


def all_reduce_sum(values: Sequence[float], group: dist.ProcessGroup | None,
                   device: torch.device) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


class Engine(ABC):
    """Base engine: a whole model on each rank, data parallel over the dp axis."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device):
        self.cfg, self.topo, self.device = cfg, topo, device
        self.autocast = cfg.train.precision == "bf16"

    # -- subclasses provide these ---------------------------------------------------------------
    @abstractmethod
    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank optimizes (its shards, where the engine shards)."""

    @abstractmethod
    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> float:
        """One step's forward and backward; synchronized gradients; the mean loss."""

    @abstractmethod
    def eval_loss(self, batches: Sequence[MicroBatch]) -> tuple[float, int]:
        """Summed token loss and token count over all data-parallel ranks."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference model's state dict, gathered, on every rank."""

    # -- shared -------------------------------------------------------------------------------
    def optimizer(self, cfg: TrainConfig) -> torch.optim.Optimizer:
        return adamw(self.parameters(), cfg)

    def after_parameters_loaded(self) -> None:  # noqa: B027 - a hook, most engines need none
        """parameters() were overwritten (a checkpoint): refresh anything derived from them."""

    def grad_norm_groups(self) -> list[dist.ProcessGroup]:
        """Groups over which gradient shards must be summed for the global norm."""
        return []

    def local_grad_sq(self) -> torch.Tensor:
        """Sum of squared gradient entries this rank owns (each entry counted on one rank)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.parameters():
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        return sq

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm of all gradients; scale them to max_norm if above (0: only measure)."""
        sq = self.local_grad_sq()
        for group in self.grad_norm_groups():
            dist.all_reduce(sq, group=group)
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    @torch.no_grad()
    def summed_loss(self, batches: Sequence[MicroBatch],
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    group: dist.ProcessGroup | None = None) -> tuple[float, int]:
        """Token-summed `loss_fn(x, y)` (a mean over its tokens) and the token count, summed
        over this rank's batches and over the dp group (or `group`): what eval_loss returns."""
        loss_sum, count = 0.0, 0
        for x, y in batches:
            loss_sum += float(loss_fn(x.to(self.device), y.to(self.device))) * y.numel()
            count += y.numel()
        group = self.topo.group("dp") if group is None else group
        loss_sum, count = all_reduce_sum([loss_sum, count], group, self.device)
        return loss_sum, int(count)

    def reference_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of a whole reference model, under autocast for bf16."""
        with self.autocast_ctx():
            logits = model(x)
        return cross_entropy(logits, y)

    def autocast_ctx(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class DataParallelEngine(Engine):
    """The reference model on every rank; gradients averaged over the dp group."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device):
        super().__init__(cfg, topo, device)
        self.model: Transformer = build_model(cfg.model, cfg.train.seed, device)
        apply_recompute(self.model, cfg.parallel.recompute)
        self.ddp = DataParallel(self.model, topo.group("dp"), bucket_mb=cfg.parallel.bucket_mb,
                                algorithm=cfg.parallel.allreduce_algorithm)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> float:
        self.model.train()
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                with self.autocast_ctx():
                    logits = self.ddp(x.to(self.device))
                loss = cross_entropy(logits, y.to(self.device)) / len(micro_batches)
                loss.backward()
            total += loss.detach()
        self.ddp.finish_gradient_sync()
        (mean,) = all_reduce_sum([float(total)], self.topo.group("dp"), self.device)
        return mean / self.topo.dp

    def eval_loss(self, batches: Sequence[MicroBatch]) -> tuple[float, int]:
        self.model.eval()
        return self.summed_loss(batches, lambda x, y: self.reference_loss(self.model, x, y))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _mechanisms(cfg: Config) -> list[str]:
    """The non-default parallel mechanisms a config asks for, by name."""
    p = cfg.parallel
    return [name for name, on in (
        ("tensor parallelism", p.tp > 1 or p.sequence_parallel),
        ("pipeline parallelism", p.pp > 1),
        ("a parameter server", p.dp_mode != "allreduce"),
        ("ZeRO", p.zero_stage > 0),
    ) if on]


def check_supported(cfg: Config) -> None:
    """Refuse, before any process group exists, layouts no engine here can run.

    Each mechanism composes with plain data parallelism over the dp axis; mechanisms do not
    yet compose with one another (that is the composition engine's job, still to come).
    """
    p = cfg.parallel
    for name, value in (("cp", p.cp), ("ep", p.ep)):
        if value != 1:
            raise ConfigError(f"parallel.{name}", value,
                              "this build of tessera has no engine for it yet (must be 1)")
    mechanisms = _mechanisms(cfg)
    if len(mechanisms) > 1:
        raise ConfigError("parallel", f"tp={p.tp} pp={p.pp} zero_stage={p.zero_stage} "
                          f"dp_mode={p.dp_mode}", f"{mechanisms[0]} and {mechanisms[1]} do not "
                          "compose yet; each composes with plain data parallelism (dp)")
    if p.pp > 1:
        from tessera.pipeline.engine import check_pipeline

        check_pipeline(cfg)


def build_engine(cfg: Config, topo: Topology, device: torch.device) -> Engine:
    check_supported(cfg)
    mechanism = (_mechanisms(cfg) or ["data parallelism"])[0]
    if mechanism == "tensor parallelism":
        from tessera.parallel.tp_engine import TensorParallelEngine

        return TensorParallelEngine(cfg, topo, device)
    if mechanism == "pipeline parallelism":
        from tessera.pipeline.engine import PipelineEngine

        return PipelineEngine(cfg, topo, device)
    if mechanism == "ZeRO":
        from tessera.parallel.zero_engine import ZeroEngine  # imports this module

        return ZeroEngine(cfg, topo, device)
    if mechanism == "a parameter server":
        from tessera.parallel.parameter_server import ParameterServerEngine

        return ParameterServerEngine(cfg, topo, device)
    return DataParallelEngine(cfg, topo, device)
