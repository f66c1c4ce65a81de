"""Model state: the bytes of parameters, gradients and optimizer state one pipeline rank holds
under ZeRO, and the seconds of its gradient norm and optimizer step.

- the closed form (Rajbhandari et al. 2020, "ZeRO", §3.1 and §5) is
  :func:`tessera.planner.formulas.zero_model_state_bytes`: stage 1 shards the optimizer state
  over the data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters;
- for a model tessera's own transformer expresses, the bytes ``tessera.parallelize``
  allocates (:func:`tessera.planner.engine.model_state_bytes`: ZeRO units padded to dp,
  vocabulary padded to t, replicated norms and kv heads, a tied copy on the last stage, DDP's
  and AdamW's per-tensor extras).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.parallel.update_batches import update_batches
from tessera.planner import engine
from tessera.planner.compute import ChunkCosts
from tessera.planner.hardware import Hardware
from tessera.planner.kernels import launch_floor, step_kernels
from tessera.planner.local.terms import cpu_ranks, local_terms
from tessera.planner.pipeline import rank_chunks
from tessera.planner.workload import Layout, Workload

OPS_PER_TENSOR_ADAMW = 12
"""Kernels per parameter tensor in one single-tensor (foreach=False) AdamW update."""
TESSERA_NORM_BYTES_CPU = 16
"""Bytes per gradient element that tessera's gradient norm (``optim.add_sums_of_squares``: one
``torch._foreach_norm`` in fp64) moves besides reading the gradient, on CPU ranks: torch's CPU
kernel casts each piece to an fp64 copy first (write 8) and sums the copy (read 8); timed
here, a 16M-element fp32 norm in fp64 costs a cast copy plus an fp64 sum. On a GPU the batched
kernel reads each gradient once and accumulates in fp64 registers: nothing more, as a fused
multi-tensor norm (Megatron-LM)."""


@dataclass
class RankState:
    """Model-state bytes of one pipeline rank and its optimizer step time."""

    params: float
    grads: float
    optimizer: float
    zero3_buffer: float
    optimizer_time: float


def optimizer_traffic(stepped: float, normed: float, nbytes: tuple[int, int, int, int],
                      tessera: bool, cpu_ranks: bool = False) -> float:
    """Bytes one rank's optimizer step moves: the gradient norm over the `normed` gradient
    elements it holds (one read; on CPU ranks tessera's fp64 sum moves TESSERA_NORM_BYTES_CPU
    more per element, and tessera prices the clipping too, a read and a write of each, as a
    step whose norm is above train.grad_clip), then AdamW over the `stepped` parameters
    (reads and writes its states, reads the gradient, writes the parameter)."""
    pb, gb, ob, _ = nbytes
    norm = 3 * gb + (TESSERA_NORM_BYTES_CPU if cpu_ranks else 0) if tessera else gb
    return normed * norm + stepped * (2 * ob + gb + 2 * pb)


def optimizer_step_time(hw: Hardware, stepped: float, normed: float, tensors: int,
                        nbytes: tuple[int, int, int, int], tessera: bool,
                        kernels: int = 0) -> float:
    """Seconds of one rank's gradient norm and optimizer step: memory-bound traffic plus a
    fixed cost per parameter tensor: ``LocalTerms.optimizer_tensor_us`` where calibrate timed
    tessera's loops on the machine (their launches included), else OPS_PER_TENSOR_ADAMW
    kernels at ``op_overhead_us``, and no less than the host needs to launch the step's
    `kernels` (``kernels.step_kernels``; the norm's read has just synchronized the host with
    an idle device)."""
    traffic = optimizer_traffic(stepped, normed, nbytes, tessera, cpu_ranks(hw)) / hw.memory_bw
    calibrated = local_terms(hw).optimizer_tensor_us
    if calibrated > 0:
        return traffic + tensors * calibrated * 1e-6
    fixed = tensors * OPS_PER_TENSOR_ADAMW * hw.op_overhead_us * 1e-6
    return max(traffic + fixed, launch_floor(hw.launch_us, kernels))


def rank_step_kernels(w: Workload, L: Layout, rank: int, tensors: int) -> int:
    """Kernels of pipeline rank `rank`'s step outside its forwards and backwards
    (``kernels.step_kernels``) for a model tessera runs: over its ZeRO units where flat units
    hold the state, else over its `tensors` parameter tensors. 0 for the engines the catalog's
    fused kernels stand for (Megatron-LM's multi-tensor norm and Adam: a few launches)."""
    if not w.tessera_engine:
        return 0
    if not engine.flat_units(w.precision, L.zero_stage, L.dp_mode):
        return step_kernels(tensors, flat=False, precision=w.precision)
    units = engine.rank_units(w, L, rank)
    owned = [-(-n // L.dp) * (1 if L.zero_stage else L.dp) for n, _ in units]  # padded to dp
    groups = update_batches(owned)
    decayed = sum(any(engine.unit_decay_runs(w.model, [units[i]]) for i in g) for g in groups)
    return step_kernels(len(units), flat=True, precision=w.precision, groups=len(groups),
                        decayed_groups=decayed)


def rank_state(w: Workload, L: Layout, rank: int, chunks: list[ChunkCosts]) -> RankState:
    """Pipeline rank `rank`'s model state (it holds chunks rank, rank + p, ... of `chunks`, or
    the V shapes' rank and 2p-1-rank: ``pipeline.rank_chunks``).

    ZeRO (Rajbhandari et al. 2020 §5): stage 1 shards optimizer state over the dp·cp ranks
    that hold the same parameters, stage 2 also gradients, stage 3 also parameters, which
    are then gathered two blocks at a time (one computing, one prefetched). For a tessera
    model, the bytes tessera allocates (``engine.model_state_bytes``)."""
    pb, gb, ob, _ = w.bytes
    mine = [chunks[c] for c in rank_chunks(L.schedule, L.pp, L.virtual_stages, rank)]
    params = sum(ch.params for ch in mine)
    tensors = sum(ch.tensors for ch in mine)
    shard = L.dp * L.cp
    stepped = params / (shard if L.zero_stage >= 1 else 1)
    normed = params / (shard if L.zero_stage >= 2 else 1)  # the gradient elements this rank holds
    opt_time = optimizer_step_time(w.hardware, stepped, normed, tensors, w.bytes,
                                   w.tessera_engine, rank_step_kernels(w, L, rank, tensors))
    if w.tessera_engine and L.cp == 1:
        state = engine.model_state_bytes(w, L, rank)
        largest = sorted(n for n, _ in engine.rank_units(w, L, rank))[-2:]
        return RankState(params=state["params"], grads=state["grads"],
                         optimizer=state["optimizer"],
                         zero3_buffer=pb * sum(largest) if L.zero_stage >= 3 else 0.0,
                         optimizer_time=opt_time)
    # Gathered at once: two blocks (pp = v = 1, gathered unit by unit), or with several
    # chunks two whole chunks (the sharding actions gather a chunk per run, one ahead).
    gathered = (2 * w.model.layer_params / L.tp if L.pp * L.virtual_stages == 1
                else sum(sorted(ch.params for ch in mine)[-2:]))
    return RankState(
        params=pb * params / (shard if L.zero_stage >= 3 else 1),
        grads=gb * params / (shard if L.zero_stage >= 2 else 1),
        optimizer=ob * stepped,
        zero3_buffer=pb * gathered if L.zero_stage >= 3 else 0.0,
        optimizer_time=opt_time)
