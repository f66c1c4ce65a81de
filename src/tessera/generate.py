"""Sampling text from the reference model (rank 0 runs it on the gathered weights)."""

from __future__ import annotations

import torch

from tessera.model import Transformer


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], n_tokens: int, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0, top_p: float | None = None,
             stop: int | None = None) -> list[int]:
    """Autoregressive sampling; the context is cropped to the model's max_seq_len.

    temperature 0 is greedy. top_k keeps the k likeliest tokens; top_p (nucleus sampling,
    Holtzman et al. 2020) the smallest set whose probability reaches p. Generation ends early
    at the token `stop` (the end-of-text token), which is not returned."""
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt or [0]], device=device)  # (1, T)
    for _ in range(n_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len:])[0, -1].float()  # (V,)
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(filter_logits(logits / temperature, top_k,
                                                                top_p), -1), 1, generator=g)
        if stop is not None and int(nxt) == stop:
            break
        ids = torch.cat([ids, nxt[None]], dim=1)
    return ids[0, len(prompt or [0]):].tolist()


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """logits (V,) with every token outside the top k and outside the top-p nucleus at -inf."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # Drop a token when the tokens likelier than it already reach p (the first always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop).scatter(0, order, drop)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
