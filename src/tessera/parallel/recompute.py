"""Activation recomputation: keep fewer activations for backward, compute them again there.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022:

- ``full``: each transformer block keeps only its input; backward runs the block's forward
  again (Chen et al. 2016's checkpointing at block granularity, Megatron's "full"). Per layer
  the stored activations drop from s·b·h·(34 + 5·a·s/h) bytes (16-bit, no parallelism) to the
  2·s·b·h of the input, for one more forward per block: 33% more FLOPs (Megatron eq. 3's 96
  instead of 72).
- ``selective``: only the attention core (q·kᵀ, softmax, dropout, the product with v) is
  recomputed; it holds the 5·a·s²·b bytes of the s² tensors but costs few FLOPs to redo
  (§5). With a fused attention kernel that never stores s² tensors the saving is what the
  kernel keeps for backward (on a CPU, its output and log-sum-exp).

Both wrap modules in place with ``torch.utils.checkpoint`` (non-reentrant, RNG state restored
so dropout would repeat): every :class:`tessera.model.Block` (full) or every
:class:`tessera.model.AttentionCore` (selective) found in the module tree, which covers the
reference model, tensor-parallel blocks (the same modules on their shards) and pipeline
chunks alike. Parameters, names and state dicts are unchanged; the model code does not know.

A replayed forward repeats the forward's side effects too. Modules with a ``replaying``
attribute (MoE layers, whose routing statistics must count each real forward once) find it
True while checkpoint replays them in backward: the wrapper hands checkpoint a recompute-only
context (its ``context_fn``) that sets it, so the model code needs no global flag and does not
depend on where torch stops a replay (after the last saved tensor, by default).

Under tensor parallelism the recomputed forward issues its collectives again (two more
all-reduces per block for ``full``), as in Megatron; ZeRO-3 gathers a block before its
backward, which is when the recomputation runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.model import AttentionCore, Block

MODES = ("none", "selective", "full")
TARGETS: dict[str, type[nn.Module]] = {"full": Block, "selective": AttentionCore}


def apply_recompute(module: nn.Module, mode: str) -> int:
    """Recompute the activations of `module`'s blocks (``full``) or attention cores
    (``selective``) in backward; ``none`` changes nothing. Returns how many modules were
    wrapped. Applying twice is an error (a forward inside a checkpoint inside a checkpoint
    recomputes twice)."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r}: must be one of {', '.join(MODES)}")
    if mode == "none":
        return 0
    count = 0
    for sub in module.modules():
        if isinstance(sub, TARGETS[mode]):
            if getattr(sub, "recompute", None) is not None:
                raise ValueError(f"{type(sub).__name__} already recomputes ({sub.recompute})")
            sub.recompute_body = sub.forward
            sub.forward = checkpointed(sub, sub.forward)
            sub.recompute = mode
            count += 1
    return count


def checkpointed(module: nn.Module, body: Callable[..., Any]) -> Callable[..., Any]:
    """`module`'s forward that runs `body` (its own forward, or a compiled form of it:
    ``parallel.compile``) under non-reentrant checkpoint. The :func:`replaying` context is
    handed to checkpoint only when `module` holds a module that reads it: torch.compile traces
    a checkpoint without a ``context_fn`` (a dense attention core's, under selective
    recomputation) but not one with. A closure rather than a ``functools.partial``: dynamo
    guards on a partial's bound arguments, so every block would compile its own graph."""
    if not any(hasattr(m, "replaying") for m in module.modules()):
        def forward(*args: Any, _body: Callable[..., Any] = body, **kwargs: Any) -> Any:
            return checkpoint(_body, *args, use_reentrant=False, **kwargs)

        return forward
    context = functools.partial(_contexts, module)

    def forward(*args: Any, _body: Callable[..., Any] = body, **kwargs: Any) -> Any:
        return checkpoint(_body, *args, use_reentrant=False, context_fn=context, **kwargs)

    return forward


def _contexts(module: nn.Module) -> tuple[contextlib.AbstractContextManager,
                                          contextlib.AbstractContextManager]:
    """checkpoint's ``context_fn``: nothing around the forward, :class:`Replaying` around each
    replay in backward (one object for every replay of this forward: a split backward replays
    twice, ``tessera.pipeline.split_backward``)."""
    return contextlib.nullcontext(), Replaying(module)


class Replaying:
    """A reusable context that sets ``replaying`` on every module inside `module` that has the
    attribute, restoring the previous values on exit."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._before: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        marked = [m for m in self.module.modules() if hasattr(m, "replaying")]
        self._before = [(m, m.replaying) for m in marked]
        for m in marked:
            m.replaying = True

    def __exit__(self, *exc: object) -> None:
        for m, was in self._before:
            m.replaying = was
        self._before = []


def replaying(module: nn.Module) -> contextlib.AbstractContextManager:
    """:class:`Replaying` of `module`."""
    return Replaying(module)
