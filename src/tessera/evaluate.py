"""`tessera eval`: a checkpoint's validation loss and perplexity on a prepared data set.

One process, the reference model with the checkpoint's weights (consolidated from its shards, so
any training layout reads back the same), scored on the same fixed validation windows the
trainer scores (``val_windows``): non-overlapping, every target counted once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tessera.data.loader import TokenDataset, val_windows
from tessera.model import Transformer, cross_entropy


@dataclass
class EvalResult:
    loss: float
    """Mean next-token loss in nats per token."""
    tokens: int
    """Targets scored."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def evaluate(model: Transformer, dataset: TokenDataset, seq_len: int, n_tokens: int,
             batch_size: int = 16, split: str = "val") -> EvalResult:
    """Mean loss of `model` over >= n_tokens targets of `split` in windows of seq_len."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum, count = 0.0, 0
    for x, y in val_windows(getattr(dataset, split), seq_len, n_tokens, batch_size):
        logits = model(x.to(device))  # (B, T, V)
        loss_sum += float(cross_entropy(logits, y.to(device))) * y.numel()
        count += y.numel()
    return EvalResult(loss_sum / count, count)
