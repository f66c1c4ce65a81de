"""Regional compilation (``train.compile``): ``torch.compile`` on each transformer block, the
final norm and the loss, never on the whole model.

What is compiled (:func:`compile_chunk`, step 6 of ``tessera.parallelize``, and
:func:`compiled_loss` in the step executor):

- every :class:`tessera.model.Block`: its forward, as tensor/sequence, context and expert
  parallelism left it and inside recomputation's wrapper. The blocks of a model share one
  code object, and their parameters are graph inputs (dynamo inlines ``nn.Module``s), so
  one graph serves every block of a chunk and of every chunk on the rank: the compile cost
  is one block's, whatever the depth;
- the final RMSNorm of the last chunk;
- the loss, when it is the plain cross-entropy (tp = 1, ``train.loss_chunk_tokens`` = 0).
  The vocabulary-parallel and the chunked losses are hand-written autograd functions that
  already compute a shard or a chunk at a time (with collectives inside under tp) and stay
  eager.

Only ``forward`` is replaced, never ``__call__``, so module hooks run eagerly around the
compiled code: ZeRO-3's gathers (forward pre-hooks; the parameters are views into the unit's
flat buffer, gathered before the compiled forward reads them and freed after), DDP's and
ZeRO's gradient hooks (on the parameters' accumulation, which compiled backward graphs feed
like eager ones), and the pipeline runtime's hand-offs between chunks. Compilation comes
after tensor parallelism (the graphs see the shards' shapes) and before the data-parallel
wrappers (torchtitan's order: TP, activation checkpointing, compile, FSDP).

Recomputation. ``full``: the block's own forward is compiled and recomputation's checkpoint
stays eager around it (``recompute.checkpointed``), so backward runs the compiled forward
again; dynamo cannot trace a checkpoint with the context that tells MoE layers they are
replaying. ``selective``: the block is compiled with the attention core's checkpoint inside
the graph (dynamo's activation-checkpoint operator: the partitioner recomputes the core in
the backward graph).

Graph breaks, each on purpose (``torch.compiler.disable``); the code between them is
compiled as separate graphs:

- tensor parallelism: ``TPContext.enter``/``exit`` (Megatron's f and g, SP's all-gather and
  reduce-scatter) are autograd functions around blocking process-group calls, which dynamo
  does not trace, and the column-parallel linears' shared entry (``SharedInput.output``,
  whose bookkeeping by ``id(layer)`` dynamo would guard on, block by block) runs eagerly with
  its matmuls. The code around them compiles as several smaller graphs: 9 for a tp = 2 chunk
  (its blocks, whatever their number, and its final norm) against 2 without tp;
- context parallelism: the ``ContextParallelAttention`` core (ring attention's point-to-point
  exchanges, the all-gather and Ulysses all-to-alls) runs eagerly between the block's graphs;
- mixture of experts: each ``MoEFeedForward`` (routing with data-dependent shapes, the
  all-to-all dispatch under ep, the load statistics) runs eagerly between the block's graphs.

Shapes are static (``dynamic=False``): every micro-batch of a step has one shape, so each
graph compiles once, at the first step, and a later step compiles nothing. The trainer's
validation (no gradient) runs the blocks eagerly: compiling its inference graphs would double
the compile time for a pass that runs every few hundred steps. ``tessera eval`` and
``tessera generate`` with ``--compile`` compile those inference graphs instead. Compile time
is reported on its own (:func:`compile_seconds`, the trainer's ``compile_s``).

Cache between runs: inductor's FX graph cache and AOTAutograd's cache are on (torch's
defaults), in ``TORCHINDUCTOR_CACHE_DIR`` or, unset, torch's per-user directory under the
system temp directory; a second run of the same model and layout loads its kernels instead of
generating them (dynamo still traces each graph, which takes seconds).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.model import Block, RMSNorm

BACKEND = "inductor"
"""torch.compile's backend when none is given: inductor (C++/OpenMP kernels on CPU, Triton on
CUDA). Read at each call, so a test may set "aot_eager" (dynamo's graphs and AOTAutograd's
forward/backward split, without code generation)."""


@torch.compiler.disable
def _call_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn` outside any compiled graph. One shared function, so that dynamo's guards are
    the same for every block and the blocks keep sharing their graphs."""
    return fn(*args, **kwargs)


def _run_eagerly(module: nn.Module) -> None:
    """Make `module`'s forward a graph break: its current forward (a recomputation wrapper
    included) runs eagerly when a compiled block calls it."""
    def forward(*args: Any, _fn: Callable[..., Any] = module.forward, **kwargs: Any) -> Any:
        return _call_eagerly(_fn, *args, **kwargs)

    module.forward = forward


def eager_regions(module: nn.Module) -> list[nn.Module]:
    """The submodules of `module` that compiled blocks call eagerly (module doc): context-
    parallel attention cores and MoE feed-forwards."""
    from tessera.moe import MoEFeedForward
    from tessera.parallel.context_parallel import ContextParallelAttention

    return [m for m in module.modules()
            if isinstance(m, ContextParallelAttention | MoEFeedForward)]


def _compile(fn: Callable[..., Any], backend: str | None,
             dynamic: bool | None = False) -> Callable[..., Any]:
    return torch.compile(fn, backend=backend or BACKEND, dynamic=dynamic)


def _training_only(compiled: Callable[..., Any], eager: Callable[..., Any]
                   ) -> Callable[..., Any]:
    """A forward that runs `compiled` when autograd records (training) and `eager` otherwise
    (evaluation under no_grad), so training compiles only its own graphs."""
    def forward(*args: Any, _compiled: Callable[..., Any] = compiled,
                _eager: Callable[..., Any] = eager, **kwargs: Any) -> Any:
        return (_compiled if torch.is_grad_enabled() else _eager)(*args, **kwargs)

    return forward


def compile_chunk(chunk: nn.Module, backend: str | None = None, *,
                  inference: bool = False) -> int:
    """Compile every block of `chunk` (a pipeline chunk or the reference model) and its final
    norm, in place (module doc); returns how many modules were compiled, each marked
    ``compiled = True``. Training (`inference` False): the compiled code runs when autograd
    records, and evaluation under no_grad runs eagerly, so a run compiles the training graphs
    only. `inference`: always compiled, with torch's automatic dynamic shapes (a second
    sequence length recompiles once with the length symbolic: ``tessera generate``'s growing
    context, ``tessera eval``'s last, shorter batch)."""
    dynamic = None if inference else False
    for region in eager_regions(chunk):
        _run_eagerly(region)
    count = 0
    for module in chunk.modules():
        if getattr(module, "compiled", False):
            raise ValueError(f"{type(module).__name__} is already compiled")
        if isinstance(module, Block) and getattr(module, "recompute", None) == "full":
            from tessera.parallel.recompute import checkpointed

            compiled = checkpointed(module, _compile(module.recompute_body, backend, dynamic))
        elif isinstance(module, Block) or (isinstance(module, RMSNorm)
                                           and module is getattr(chunk, "norm", None)):
            compiled = _compile(module.forward, backend, dynamic)
        else:
            continue
        module.forward = compiled if inference else _training_only(compiled, module.forward)
        module.compiled = True
        count += 1
    return count


def compiled_loss(fn: Callable[..., torch.Tensor], backend: str | None = None
                  ) -> Callable[..., torch.Tensor]:
    """`fn` (a loss of logits and targets) compiled with static shapes, when autograd records
    (evaluation under no_grad calls `fn` itself)."""
    return _training_only(_compile(fn, backend), fn)


def compiler_missing(device_type: str) -> str | None:
    """Why `train.compile` cannot run on `device_type`, or None: on a CPU inductor builds C++
    kernels, so a C++ compiler (``$CXX``, g++ or clang++) must be on the PATH."""
    if device_type != "cpu" or BACKEND != "inductor":
        return None
    if any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "clang++") if c):
        return None
    return ("needs a C++ compiler on a CPU (inductor builds C++ kernels): install g++ or "
            "set CXX")


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: dynamo's tracing and the backend's
    compilation of forward graphs plus the compilation of backward graphs (done at their
    first backward). Reads torch's own accounting (``torch._dynamo.utils``); 0 where a torch
    version keeps none."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:  # pragma: no cover - an older or newer torch without it
        return 0.0
    return float(calculate_time_spent().get("total_wall_time", 0.0))


__all__ = ["BACKEND", "compile_chunk", "compile_seconds", "compiled_loss", "compiler_missing",
           "eager_regions"]
