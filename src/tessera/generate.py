"""Sampling text from the reference model (rank 0 runs it on the gathered weights)."""

from __future__ import annotations

import torch

from tessera.model import Transformer


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], n_tokens: int, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0) -> list[int]:
    """Autoregressive sampling; the context is cropped to the model's max_seq_len."""
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt or [0]], device=device)  # (1, T)
    for _ in range(n_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len:])[0, -1].float() / max(temperature, 1e-6)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        ids = torch.cat([ids, nxt[None]], dim=1)
    return ids[0, len(prompt):].tolist()
