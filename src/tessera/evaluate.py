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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.data.loader import TokenDataset, TokenSplit, val_windows
from tessera.errors import ConfigError
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


@dataclass
class EvalWindows:
    """What `tessera eval` scores: the data set, the window length, the targets and the windows
    per forward pass, with a note for each default the checkpoint could not supply."""

    data: str
    dataset: TokenDataset
    seq_len: int
    tokens: int
    batch_size: int
    notes: list[str] = field(default_factory=list)


def eval_windows(model: Transformer, path: Path, data: str | None, seq_len: int | None,
                 tokens: int | None, batch_size: int | None, split: str,
                 default_tokens: int) -> EvalWindows:
    """The windows to score `model` (read from the checkpoint at `path`) on: each of `data`,
    `seq_len`, `tokens` and `batch_size` given stands, else the training validation's
    (:func:`trained_validation`), else the model's max_seq_len, `default_tokens` and 16.
    Raises ConfigError (naming the flag) for a data set or window the model cannot score."""
    trained = trained_validation(path)
    notes = []
    if data is None:
        if "data" not in trained:
            raise ConfigError("--data", None, f"required: {path} does not record the data "
                              "set its run trained on")
        data = trained["data"]
        if not os.path.isdir(data):
            raise ConfigError("--data", None, f"required: the data set {path} trained on, "
                              f"{data}, is not there")
    dataset = TokenDataset(data)
    if dataset.vocab_size > model.cfg.vocab_size:
        raise ConfigError("--data", data, f"its vocabulary {dataset.vocab_size} exceeds "
                          f"the model's {model.cfg.vocab_size}")
    if seq_len is None and "seq_len" not in trained:
        notes.append(f"windows of the model's max_seq_len={model.cfg.max_seq_len}: {path} "
                     "records no training windows (--seq-len sets them)")
    seq = seq_len or trained.get("seq_len", model.cfg.max_seq_len)
    if seq > model.cfg.max_seq_len:
        raise ConfigError("--seq-len", seq, f"must be <= the model's max_seq_len="
                          f"{model.cfg.max_seq_len}")
    if tokens is None and "tokens" not in trained:
        notes.append(f"{default_tokens:,} targets: {path} does not record how many its "
                     "training validation scored (--tokens sets them)")
    tokens = tokens or trained.get("tokens", default_tokens)
    held = windows_held(getattr(dataset, split), seq)
    if held < 1:
        raise ConfigError("--seq-len", seq, f"the {split} split of {data} holds "
                          f"{len(getattr(dataset, split))} tokens, fewer than one window "
                          f"of --seq-len + 1")
    if held * seq < tokens:
        notes.append(f"the {split} split holds {held} windows of {seq} ({held * seq:,} "
                     f"targets), fewer than --tokens={tokens:,}: scoring all of them")
    return EvalWindows(data, dataset, seq, tokens, batch_size or trained.get("batch_size", 16),
                       notes)
