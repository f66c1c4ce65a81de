"""bf16 without extra casts: tessera's mixed-precision step (bf16 parameters and gradients in
ZeRO's flat units, fp32 masters; ``parallelize``'s precision policy) casts no more than a plain
``torch.autocast`` bf16 loop of the same single-device model (fp32 parameters, fp32 AdamW).

A cast is a dispatched ``aten._to_copy`` whose output dtype differs from its input's, an
``aten.copy_`` between two dtypes, or each pair of tensors of two dtypes an
``aten._foreach_copy_`` copies (one op converting several tensors casts each of them), counted
with a TorchDispatchMode over one whole training step (forward, backward, norm, clipping,
optimizer) after a warm-up step.

Where the two differ by design:
- tessera's residual stream is bf16, so each RMSNorm casts its input up to fp32 and its
  output back (2 forward, 2 backward); autocast's residual stream is fp32 and its norms cast
  nothing, but every linear casts its input and its weight to bf16 each micro-batch (and the
  backward casts both gradients back). RoPE and the loss's fp32 logits cast the same in both.
- each RMSNorm and each RoPE call casts its input up once and its output down once (and
  backward the same): 16 casts per block and micro-batch, 4 for the final norm, 2 for the
  loss's logits.
- per step, not per micro-batch, tessera casts each unit's gradient to fp32 once for the
  optimizer and copies each unit's stepped fp32 master into its bf16 parameters once (all the
  units' copies in one ``_foreach_copy_``): a constant of 2 casts per unit, which the test pins
  exactly (a cast of the flat parameters or
  gradients every micro-batch moves it).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.testing import run_ranks


class CastCounter(TorchDispatchMode):
    """Counts dtype casts by (kind, elements): ``to`` for ``_to_copy``, ``copy_`` for copies
    between dtypes, ``_foreach_copy_`` for each such copy inside a multi-tensor copy."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor)
                and out.dtype != args[0].dtype):
            self.casts["to", out.numel()] += 1
        elif func is torch.ops.aten.copy_.default and args[0].dtype != args[1].dtype:
            self.casts["copy_", args[0].numel()] += 1
        elif func is torch.ops.aten._foreach_copy_.default:
            for dst, src in zip(args[0], args[1], strict=True):
                if dst.dtype != src.dtype:
                    self.casts["_foreach_copy_", dst.numel()] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.casts.values())


def _config(accum: int):
    from tessera.config_io import make_config

    return make_config("tiny", parallel=dict(dp=1),
                       train=dict(micro_batch_size=2, grad_accum=accum, precision="bf16",
                                  grad_clip=1.0))


def _batches(cfg, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (accum, 2, cfg.data.seq_len + 1),
                           generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _tessera_casts(accum: int) -> tuple[int, int, int]:
    """(casts in one step, ZeRO units, casts inside multi-tensor copies)."""
    from tessera.step import build_executor
    from tessera.topology import Topology

    cfg = _config(accum)
    ex = build_executor(cfg, Topology.solo(), torch.device("cpu"))
    (zero,) = ex.model.zeros
    assert zero.dtype == torch.bfloat16
    opt = ex.optimizer(cfg.train)
    batches = _batches(cfg, accum)
    ex.train_step(batches, opt, grad_clip=cfg.train.grad_clip)  # warm-up
    with CastCounter() as counter:
        ex.train_step(batches, opt, grad_clip=cfg.train.grad_clip)
    foreach = sum(n for (kind, _), n in counter.casts.items() if kind == "_foreach_copy_")
    return counter.total, len(zero.units), foreach


def _autocast_casts(accum: int) -> int:
    from tessera.model import build_model, cross_entropy

    cfg = _config(accum)
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(cfg, accum)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for x, y in batches:
            with torch.autocast("cpu", torch.bfloat16):
                loss = cross_entropy(model(x), y) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()

    step()
    with CastCounter() as counter:
        step()
    return counter.total


def _counts() -> dict:
    return {accum: (_tessera_casts(accum), _autocast_casts(accum)) for accum in (1, 3)}


@pytest.mark.multiprocess
def test_bf16_step_casts_no_more_than_autocast():
    counts = run_ranks(_counts, 1)[0]
    (t1, units, foreach), a1 = counts[1]
    (t3, _, _), a3 = counts[3]
    print(f"casts per step: tessera {t1} (accum 1), {t3} (accum 3); autocast {a1}, {a3}")
    # tessera's per-micro-batch casts (activations) and its per-step constant
    per_mb, per_step = (t3 - t1) // 2, t1 - (t3 - t1) // 2
    assert (t3 - t1) % 2 == 0
    assert per_step == 2 * units, (per_step, units)  # a grad cast and a master copy per unit
    assert foreach == units, (foreach, units)  # the master copies: one multi-tensor copy
    # per micro-batch and block: 2 norms and 2 RoPE calls (q, k), each casting up and down
    # forward and both again backward (16); the final norm (4); the loss's fp32 logits (2)
    layers = _config(1).model.n_layers
    assert per_mb == 16 * layers + 6, (per_mb, layers)
    assert per_mb <= (a3 - a1) // 2, (per_mb, (a3 - a1) // 2)
    assert t1 <= a1 and t3 <= a3, (t1, a1, t3, a3)
