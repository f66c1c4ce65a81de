"""Apply every parallel mechanism to the chunks this rank holds: the one way a model is split.

``parallelize(cfg, topo, device)`` builds this rank's part of the reference model and returns a
:class:`ParallelModel`. The mechanisms are applied in one order, each as a transformation of
the chunks (each mechanism lives in its own module; this one only composes them):

1. **pipeline split** (``pipeline.partition``): the model is cut into pp·v chunks and the
   schedule places them on pp ranks; pp = 1 is one chunk on one rank. Chunks are built on the
   meta device: no rank ever materializes layers it does not hold.
2. **tensor / sequence parallelism** (``parallel.tensor_parallel``, ``sequence_parallel``) on
   each chunk's blocks, embedding and head over the tp group; each shard is cut from the
   reference initializer's full value (``init_tensor``), so every layout starts from the
   single-device model's weights. With tp = 1 the chunk is materialized as it is.
3. **context parallelism** (``parallel.context_parallel``): every ``AttentionCore`` of the
   chunk becomes a ``ContextParallelAttention`` over the cp group (ring, all-gather, Ulysses or
   hybrid), and the chunk reads RoPE at its zig-zag tokens' global positions. Everything else
   in the chunk runs on the rank's T/cp tokens unchanged. Parameters are replicated over cp,
   so step 7's data-parallel group becomes dp × cp (``Topology`` axis 'dpcp').
4. **expert parallelism** (``parallel.expert_parallel``, ep > 1): every MoE layer keeps its ep
   rank's slice of the experts and its dispatcher becomes an all-to-all over the ep group.
   Under tp the MoE layers stay whole on every tp rank (step 2 splits only dense MLPs).
5. **activation recomputation** (``parallel.recompute``) per block or attention core.
6. **regional compilation** (``parallel.compile``, ``train.compile``): ``torch.compile`` on
   each block (inside a full recomputation's checkpoint, around a selective one's) and the
   final norm; the loss is compiled in the step executor. After 2-5, so the graphs see the
   shards and the parallel attention and experts (whose collectives are graph breaks), and
   before the data-parallel wrappers, whose hooks stay eager around the compiled forwards.
7. **data parallelism** per chunk over the dp (× cp) group: DDP buckets (``parallel.ddp``),
   ZeRO-1/2/3 units (``parallel.zero``) or the parameter server
   (``parallel.parameter_server``). ZeRO-3 under a breadth-first schedule
   (``ScheduleSpec.breadth_first``) is *schedule-driven*: the step's schedule carries UNSHARD /
   RESHARD / REDUCE_GRAD actions (``sharded_schedule``) and the wrappers have no
   per-micro-batch hooks; every other ZeRO layout uses the hooks. With expert parallelism
   the wrapper is ``ExpertDataParallel``: dense parameters over dp, experts over their edp
   replicas.

Precision policy, every layout: ``fp32`` trains in float32. ``bf16`` keeps parameters and
gradients in bfloat16 and fp32 master weights and Adam moments in the optimizer (Micikevicius
et al. 2018; the ZeRO paper's 2 + 2 + 12 bytes per parameter); RMSNorm, softmax and the loss
compute in fp32 whatever their input. bf16 runs through ZeRO's flat buffers at every stage
(stage 0 is replicated data parallelism with fp32 masters).

The step itself (micro-batches through the schedule, gradient synchronization, loss, norm) is
``tessera.step``; what a rank holds and how it is read back (optimizer tensors, gradient
ownership for the global norm, full state dicts in reference names) is
``tessera.parallel_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config
from tessera.errors import ConfigError
from tessera.layout import check_split_backward
from tessera.model import init_tensor, rope_tables
from tessera.moe import materialize_buffers
from tessera.parallel.comm import CommStats
from tessera.parallel.compile import compile_chunk
from tessera.parallel.context_parallel import CPContext, apply_context_parallel, hybrid_groups
from tessera.parallel.ddp import DataParallel
from tessera.parallel.expert_parallel import (
    EPContext,
    ExpertDataParallel,
    apply_expert_parallel,
    expert_units,
)
from tessera.parallel.recompute import apply_recompute
from tessera.parallel.tensor_parallel import (
    ColumnParallelLinear,
    TPContext,
    param_specs,
)
from tessera.parallel.tp_plan import parallelize_module
from tessera.parallel.zero import ZeroModel
from tessera.parallel.zero_units import chunk_units
from tessera.parallel_model import ParallelModel, schedule_driven_zero3, training_schedule
from tessera.pipeline.partition import Chunk, partition
from tessera.pipeline.schedule import Schedule
from tessera.pipeline.split import parse_stage_layout
from tessera.pipeline.validator import validate
from tessera.topology import Topology

# ---------------------------------------------------------------------------------------------
# Building


def _tie_group(topo: Topology, owner: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The (first chunk's rank, last chunk's rank) pair of every pipeline, when they differ.
    Every rank creates every pair's group, in the same order (dist.new_group's rule)."""
    first, last = owner[0], owner[-1]
    if first == last or not dist.is_initialized():
        return None
    mine = None
    for ranks in topo.all_groups("pp"):
        pair = [ranks[first], ranks[last]]
        group = dist.new_group(pair)
        if topo.rank in pair:
            mine = group
    return mine


def initial_values(cfg: Config) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """(reference name, shape) -> the parameter's full starting value: the reference
    initializer's, or with train.init_from the loaded model's (every rank loads it whole and
    cuts its own shards, as from the initializer; its persistent buffers too, through
    :func:`load_buffers`)."""
    if not cfg.train.init_from:
        return lambda name, shape: init_tensor(cfg.model, name, shape, cfg.train.seed)
    from tessera.weights import load_weights

    _, state = load_weights(cfg.train.init_from)

    def loaded(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in state or tuple(state[name].shape) != shape:
            raise ConfigError("train.init_from", cfg.train.init_from,
                              f"has no tensor {name!r} of shape {shape}")
        return state[name].float()

    return loaded


@torch.no_grad()
def load_buffers(chunk: Chunk, initial: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
    """Copy `initial`'s value into each persistent buffer of `chunk` (the MoE routing biases):
    with train.init_from the loaded model's, since training moves them outside the optimizer
    and a checkpoint saves them with the weights. A fresh run keeps the zeros it built."""
    for name, b in chunk.state_dict(keep_vars=True).items():
        if not isinstance(b, nn.Parameter):
            b.copy_(initial(chunk.reference_name(name), tuple(b.shape)))


def build_chunks(cfg: Config, topo: Topology, device: torch.device, schedule: Schedule,
                 tp: TPContext, cp: CPContext | None = None,
                 ep: EPContext | None = None) -> dict[int, Chunk]:
    """Steps 1 to 6 of the module doc: this rank's chunks, TP-split, context-parallel,
    expert-parallel, recomputing and compiled."""
    pp_rank = topo.coords()["pp"]
    seed = cfg.train.seed
    initial = initial_values(cfg)
    specs = partition(cfg.model, schedule.n_chunks, cfg.data.seq_len,
                      split=parse_stage_layout(cfg.parallel.stage_layout)
                      if cfg.parallel.stage_layout else None)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    chunks: dict[int, Chunk] = {}
    for c in schedule.chunks_of(pp_rank):
        shared = chunks[0].tok_embeddings if 0 in chunks else None
        with torch.device("meta"):
            chunk = Chunk(cfg.model, specs[c], shared_embedding=shared)
        if tp.size > 1:
            def full(name: str, shape: tuple[int, ...], chunk: Chunk = chunk) -> torch.Tensor:
                return initial(chunk.reference_name(name), tuple(shape))

            parallelize_module(chunk, tp, full)
            if chunk._shared:  # the head reads the (vocab-parallel) embedding of chunk 0
                emb = chunk._shared[0]
                chunk._shared[0] = ColumnParallelLinear(emb.weight, tp, emb.spec, "output")
            chunk.rope_cos, chunk.rope_sin = rope_tables(cfg.model.head_dim,
                                                         cfg.model.max_seq_len,
                                                         cfg.model.rope_theta,
                                                         cfg.model.rope_scaling)
            materialize_buffers(chunk)
            chunk.to(device)
            if tp.sequence_parallel:
                chunk.seq_scale = tp.size
        else:
            chunk.materialize(seed, device, initial)
        if cfg.train.init_from:
            load_buffers(chunk, initial)
        chunk.compute_dtype = dtype
        if cp is not None:
            apply_context_parallel(chunk, cp)
            chunk.context_parallel = (cp.size, cp.rank)
        if ep is not None:
            apply_expert_parallel(chunk, ep)
        apply_recompute(chunk, cfg.parallel.recompute)
        if cfg.train.compile:
            compile_chunk(chunk)
        chunks[c] = chunk
    return chunks


def parallelize(cfg: Config, topo: Topology, device: torch.device,
                schedule: Schedule | None = None, *, regather: bool = True,
                tp_stats: CommStats | None = None,
                cp_stats: CommStats | None = None,
                ep_stats: CommStats | None = None) -> ParallelModel:
    """This rank's part of the model with every mechanism of `cfg.parallel` applied (module
    doc). Every rank calls it (it creates groups and broadcasts initial weights over dp).

    `schedule`: a custom schedule (any placement of chunks on ranks, e.g. V-shaped) instead of
    parallel.schedule; validated here, before any communication, and run for its own number of
    micro-batches (train.grad_accum is set to it). `regather` and `tp_stats` go to the
    tensor-parallel layers (``TPContext``): whether SP re-gathers inputs in backward, and where
    the TP collectives are counted (benchmarks and tests); `cp_stats`, `ep_stats` likewise for
    context and expert parallelism (ep_stats counts our pairwise all-to-all only; the token
    all-to-alls of every algorithm are also counted in ``ParallelModel.ep.stats``).

    `cfg` is a layout ``tessera.layout.validate`` accepted (the preflight checks it on every
    rank before any collective); here only `topo` is checked to be that layout."""
    p = cfg.parallel
    assert (topo.pp, topo.dp, topo.cp, topo.tp) == (p.pp, p.dp, p.cp, p.tp), (
        f"topology {topo.describe()} is not cfg.parallel's layout")
    if schedule is None:
        schedule = training_schedule(cfg)  # validated by build_schedule
    else:
        validate(schedule)
        if schedule.n_ranks != topo.pp:
            raise ConfigError("schedule", schedule.name, f"is for {schedule.n_ranks} ranks, "
                              f"but parallel.pp={topo.pp}")
        cfg.train.grad_accum = schedule.n_microbatches
        check_split_backward(p.zero_stage, schedule.name, schedule.split_backward)
    tp = TPContext(group=topo.group("tp"), sequence_parallel=cfg.parallel.sequence_parallel,
                   regather=regather, stats=tp_stats)
    cp = None
    if topo.cp > 1:
        ulysses = ring = None
        if p.cp_method == "hybrid":  # every rank creates every group (dist.new_group's rule)
            ulysses, ring = hybrid_groups(topo.all_groups("cp"), p.cp_ulysses, topo.rank)
        cp = CPContext(topo.group("cp"), p.cp_method, ulysses_group=ulysses, ring_group=ring,
                       stats=cp_stats)
    ep = EPContext(topo.group("ep"), p.ep_alltoall, comm=ep_stats) if topo.ep > 1 else None
    chunks = build_chunks(cfg, topo, device, schedule, tp, cp, ep)
    specs = {c: param_specs(chunk, tp) for c, chunk in chunks.items()}
    model = ParallelModel(cfg, topo, device, schedule, chunks, tp, specs, cp=cp, ep=ep)
    # Parameters are replicated over dp and cp; each cp rank's gradient covers its tokens, so
    # the mean over dp × cp is the gradient of the mean loss over the whole global batch.
    dp_group = topo.group("dpcp")
    if p.dp_mode != "allreduce":
        from tessera.parallel.parameter_server import ServerSync

        model.server = ServerSync(chunks, topo, p)
        model.wrappers = dict(chunks)
    elif p.zero_stage > 0 or cfg.train.precision == "bf16":
        driven = schedule_driven_zero3(cfg, schedule)
        model.wrappers = {}
        for c, chunk in chunks.items():
            units, groups = chunk_units(chunk), None
            if ep is not None:  # experts: units of their own over their replicas (edp)
                experts = expert_units(chunk)
                units = experts + units
                groups = {name: (topo.group("edp"), topo.dp) for name, _ in experts}
            model.wrappers[c] = ZeroModel(chunk, dp_group, stage=p.zero_stage,
                                          dtype=model.compute_dtype, units=units,
                                          schedule_driven=driven, unit_groups=groups)
    elif ep is not None:  # dense parameters over dp, experts over their replicas (edp)
        model.wrappers = {c: ExpertDataParallel(chunk, dp_group, topo.group("edp"), topo.ep,
                                                bucket_mb=p.bucket_mb,
                                                algorithm=p.allreduce_algorithm)
                          for c, chunk in chunks.items()}
    else:
        model.wrappers = {c: DataParallel(chunk, dp_group, bucket_mb=p.bucket_mb,
                                          algorithm=p.allreduce_algorithm)
                          for c, chunk in chunks.items()}
    if cfg.model.tie_embeddings:
        model.tie_group = _tie_group(topo, schedule.chunk_rank)
    return model


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def sync_context(wrapper: nn.Module, reduce_now: bool) -> contextlib.AbstractContextManager:
    """The context a chunk's backward runs in: the wrapper's no_sync() unless this backward is
    the chunk's last of the step (then its reduction starts during this backward)."""
    if reduce_now or not hasattr(wrapper, "no_sync"):
        return _nothing()
    return wrapper.no_sync()


__all__ = ["parallelize", "sync_context", "ConfigError"]
