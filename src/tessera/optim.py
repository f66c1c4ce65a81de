"""The optimizer and learning-rate schedule every layout uses (AdamW, warm-up + cosine)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
from torch import nn

from tessera.config import TrainConfig


def adamw_implementation(device_types: set[str]) -> dict[str, bool]:
    """AdamW's kernel for parameters on these device types: ``fused=True`` (one kernel for
    every parameter's whole update) when they all live on CUDA; elsewhere the per-parameter
    loop (``foreach=False``), the update every CPU parity test's reference computes."""
    if device_types == {"cuda"}:
        return {"fused": True}
    return {"foreach": False}


def uses_fused_adamw(device_types: set[str]) -> bool:
    """Whether AdamW's update runs as torch's fused kernel for tensors on these device types:
    ``adamw_implementation``'s rule, which ``adamw`` (per parameter) and ``ShardedAdamW``
    (flat units) both follow."""
    return adamw_implementation(device_types).get("fused", False)


def adamw(params: Iterable[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed)."""
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2),
                             **adamw_implementation({p.device.type for p in params}))


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


GOYAL_WARMUP_PARTS = 18
"""Goyal et al. 2017 warm up a linearly scaled rate over 5 of their 90 epochs: 1/18 of the
run."""


def scaled(cfg: TrainConfig, global_batch: int) -> tuple[TrainConfig, dict | None]:
    """`cfg` with lr and warmup_steps as train.lr_scaling sets them for `global_batch`
    sequences per step, and what changed: {"lr_scale": s, "scaled_lr": s * lr,
    "scaled_warmup_steps": w}; (cfg, None) when nothing changes (lr_scaling 'none',
    reference_batch 0 or equal to the global batch).

    With k = global_batch / reference_batch: 'linear' s = k, 'sqrt' s = sqrt(k). Under
    'linear' with k > 1, w = max(warmup_steps, ceil(steps / 18)); otherwise w =
    warmup_steps."""
    if cfg.lr_scaling == "none" or cfg.reference_batch in (0, global_batch):
        return cfg, None
    k = global_batch / cfg.reference_batch
    scale = k if cfg.lr_scaling == "linear" else math.sqrt(k)
    warmup = cfg.warmup_steps
    if cfg.lr_scaling == "linear" and k > 1:
        warmup = max(warmup, -(-cfg.steps // GOYAL_WARMUP_PARTS))  # ceil, in integers
    note = {"lr_scale": scale, "scaled_lr": cfg.lr * scale, "scaled_warmup_steps": warmup}
    return dataclasses.replace(cfg, lr=cfg.lr * scale, warmup_steps=warmup), note


def scaling_line(cfg: TrainConfig, global_batch: int, note: dict) -> str:
    """The start-up line that says how train.lr_scaling changed lr and warm-up."""
    return (f"lr scaling: {cfg.lr_scaling}, global batch {global_batch} vs reference "
            f"{cfg.reference_batch}: lr {cfg.lr:g} x {note['lr_scale']:g} = "
            f"{note['scaled_lr']:g}, warm-up {note['scaled_warmup_steps']} steps")


SQUARES_PIECE = 1 << 24
"""Elements per fp64 piece of a sum of squares: the fp64 copy a piece needs stays at 128 MiB
whatever the tensor (an embedding's gradient can hold 500M elements)."""


@torch.no_grad()
def add_sums_of_squares(acc: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """acc (an fp64 scalar) += Σ x² over every element of `tensors` (one device), in fp64: the
    squares of a gradient norm, as one batched fp64 norm (``torch._foreach_norm``, what
    ``clip_grad_norm_`` uses: on a GPU a few kernels for all the tensors, where a loop launches
    a few per tensor) over views of at most SQUARES_PIECE elements, so no fp64 copy exceeds
    SQUARES_PIECE elements."""
    pieces = [p for t in tensors for p in t.reshape(-1).split(SQUARES_PIECE)]
    if pieces:
        acc += torch.stack(torch._foreach_norm(pieces, 2.0, dtype=torch.float64)).pow(2).sum()


def scale_all_(tensors: list[torch.Tensor], factor: float) -> None:
    """Multiply every tensor in `tensors` by `factor` in place, as one multi-tensor op
    (``torch._foreach_mul_``), each element exactly as ``t.mul_(factor)`` computes it: the
    factor is passed as a 0-dim fp64 host tensor, which the op applies at the tensors' compute
    precision (fp32 for bf16), where a Python float would first be rounded to the tensors'
    dtype by torch's CPU kernel (bf16: a different product)."""
    if tensors:
        torch._foreach_mul_(tensors, torch.tensor(factor, dtype=torch.float64))
