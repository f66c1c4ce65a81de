"""`tessera eval`: a checkpoint's validation loss and perplexity on a prepared data set.

One process, the reference model with the checkpoint's weights (consolidated from its shards, so
any training layout reads back the same), scored on fixed validation windows (``val_windows``):
non-overlapping, every target counted once. By default the windows the trainer's validation
scored (:func:`trained_validation`: the checkpoint's data set, window length, number of targets
and windows per forward pass), summed as the trainer sums them, so a one-process fp32 run's
last validation loss comes back exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.data.loader import TokenDataset, TokenSplit, val_windows
from tessera.model import Transformer, cross_entropy


@dataclass
class EvalResult:
    loss: float
    """Mean next-token loss in nats per token."""
    tokens: int
    """Targets scored."""
    windows: int
    """Windows scored (each of seq_len targets)."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def trained_validation(path: Path) -> dict[str, Any]:
    """What the validation of the run that wrote the checkpoint at `path` scored, from its
    manifest: ``seq_len`` and, from checkpoints that record them, ``data`` (the prepared
    directory), ``tokens`` (targets) and ``batch_size`` (windows per forward pass). Empty for
    a Hugging Face directory."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        return {}
    meta = json.loads(meta_path.read_text())
    found = {"seq_len": meta["seq_len"]} if "seq_len" in meta else {}
    return found | meta.get("validation", {})


def windows_held(split: TokenSplit, seq_len: int) -> int:
    """How many non-overlapping windows of seq_len targets (seq_len + 1 tokens) `split` holds."""
    return max(0, (len(split) - 1) // seq_len)


@torch.no_grad()
def evaluate(model: Transformer, dataset: TokenDataset, seq_len: int, n_tokens: int,
             batch_size: int = 16, split: str = "val") -> EvalResult:
    """Mean loss of `model` over the first ceil(n_tokens / seq_len) windows of seq_len in
    `split`, or every window the split holds when it holds fewer (at least one: raises
    ValueError otherwise). The loss is summed as the trainer's validation sums it: each
    batch's mean times its targets, added in fp32."""
    tokens = getattr(dataset, split)
    windows = min(math.ceil(n_tokens / seq_len), windows_held(tokens, seq_len))
    if windows < 1:
        raise ValueError(f"the {split} split holds {len(tokens)} tokens, fewer than one window "
                         f"of {seq_len} + 1")
    model.eval()
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    count = 0
    for x, y in val_windows(tokens, seq_len, windows * seq_len, batch_size):
        logits = model(x.to(device))  # (B, T, V)
        loss_sum += cross_entropy(logits, y.to(device)) * y.numel()
        count += y.numel()
    return EvalResult(float(loss_sum) / count, count, windows)
