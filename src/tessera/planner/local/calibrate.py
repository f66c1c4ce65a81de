"""Measure this machine and describe it as a :class:`~tessera.planner.hardware.Hardware`.

Every compute rate is measured the way ``tessera train`` computes: in ``ranks`` processes at
once (every core busy, so the ranks share memory bandwidth and cache as they do in training),
one thread per process, fp32, each keeping the host memory it frees as a CPU training rank
does (:mod:`tessera.host_memory`). Each rate is the median of several repeats in thread CPU
time (:mod:`~tessera.planner.local.timing`); collectives, which wait on another process, use
wall time. The parts:

- compute rates, the per-kernel overhead (on a GPU 0: the launch cost stands for it), the
  launch cost, the compiled memory-bound rate and the optimizer's per-tensor cost
  (:mod:`~tessera.planner.local.rates`);
- the links between the ranks and the ranks' jitter (:mod:`~tessera.planner.local.links`);
- tessera's data-parallel engine work per tensor and per unit, on chains of one-layer modules
  (:mod:`~tessera.planner.local.chains`: ``ddp_tensor_us``, ``zero_unit_us``);
- here, what the rest of DataParallel's and ZeRO-3's work costs a training step besides its
  waits: each gradient's copy into its bucket and what it slows the backward around it, the
  launch, the backend's thread on the core while a collective is in flight, the work after
  the wait (``ddp_copy_passes``, over the gradient bytes), and ZeRO-3's buffers and copies
  with the prefetched gathers and the reduce-scatters in flight (``zero_unit_passes``, over
  the parameter bytes): whole training steps as the trainer runs them (``parallelize``,
  ``Executor``) of a model at the model's shapes (up to WRAPPED_LAYERS layers) and the user's
  micro-batch, at dp = the calibrated ranks against the same model at dp 1, in blocks of
  steps over several builds, the slowest rank's, less the waits, the scalar all-reduces and
  the parts priced on their own (:func:`wrapped_step_extra`; on one rank, where nothing is in
  flight, ZeRO-3's passes come from the one-rank group's chain of 1024×1024 layers);
- the machine's shape: the RAM divided among its cores (one rank per core), the cores
  themselves (with more ranks than cores, ranks time-share them) and the share of compute
  a collective in flight hides (:mod:`~tessera.planner.local.machine`); on GPUs one GPU's
  memory, no cores to share and the GPUs as the node.

Data-parallel overlap (``dp_overlap``): the backend's thread runs a collective beside the
rank's compute thread on the rank's core, so c seconds of compute hide a share of c seconds
of the collective (:func:`~tessera.planner.local.machine.collective_overlap`). Inside a
ZeRO-3 step a collective progresses slower than beside plain compute, so where the ZeRO-3
steps' waits were measured (at micro-batch SHARE_MICRO_BATCH, where the collectives do not
hide whole) the share is the one at which the planner's waits for that step equal them, at
most the share beside plain compute (:func:`in_step_overlap`). Where ranks time-share fewer
cores every core is busy with some rank's compute: nothing hides (0). On GPUs the
collectives run on their own stream: 1.

Device and backend: the run's (``--device``/``--backend``; by default CUDA with NCCL where a
GPU is present, else the CPU with gloo, as ``tessera train`` picks). Every tensor is made on
that device (it is the default device while a rank measures, so no measurement names one),
each rank takes GPU ``rank mod count``, and on a GPU times are wall times after a
``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch

from tessera.layout import validate
from tessera.planner.hardware import Hardware, replace
from tessera.planner.local.chains import extra_per_layer, zero_unit_costs
from tessera.planner.local.links import collective_link, jitter
from tessera.planner.local.machine import collective_overlap, machine_shape, rank_device
from tessera.planner.local.rates import (
    attention_rate,
    block_config,
    compiled_passes,
    elementwise_passes,
    launch_cost,
    matmul_curve,
    matmul_rate,
    memory_bandwidth,
    op_overhead,
    optimizer_tensor_seconds,
)
from tessera.planner.local.terms import LocalTerms, local_terms, ranks_time_share
from tessera.planner.local.timing import on_gpu, wall_clock
from tessera.planner.models import ModelSpec


def ddp_hook_costs(spec: ModelSpec, seq: int, micro_batch: int,
                   bandwidth: float) -> tuple[float, float]:
    """tessera's DataParallel gradient hook, as (seconds per parameter tensor beyond its
    copy's traffic: the slot lookup, the re-pointed gradient, the used flag; passes over the
    gradient bytes at `bandwidth` bytes/s of the rest of what DataParallel adds to a step
    besides its waits and the division by dp: :func:`ddp_copy_passes`).
    The fixed part: a chain of 32 tiny (8×8) layers under DataParallel over the default group
    inside ``no_sync()`` (the hooks run, no bucket is launched) against the chain unwrapped,
    per tensor. On a GPU the hook only queues the copy, which runs at the streaming rate: 2
    passes. (0, 2) on one rank, where nothing is wrapped. Every rank of the default group
    must call it (the wrappers broadcast the weights)."""
    import torch.distributed as dist

    from tessera.parallel.ddp import DataParallel

    if dist.get_world_size() == 1:
        return 0.0, 2.0

    def wrap(chain: torch.nn.Module) -> torch.nn.Module:
        return DataParallel(chain, dist.group.WORLD)

    fixed = extra_per_layer(wrap, 32, 8, hooks_only=True)
    if on_gpu():
        return fixed, 2.0
    return fixed, ddp_copy_passes(spec, seq, micro_batch, bandwidth, fixed)

RANK_TOKEN_SEED = 1000
"""Seed of rank 0's random tokens in the stepped models (rank r's: RANK_TOKEN_SEED + r)."""


def rank_batch(vocab_size: int, micro_batch: int, seq: int,
               rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `micro_batch` random sequences of `seq` tokens, this rank's own (as
    training gives each rank its own share of the batch), the same on every call."""
    tokens = torch.randint(0, vocab_size, (micro_batch, seq + 1),
                           generator=torch.Generator().manual_seed(RANK_TOKEN_SEED + rank))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


WRAPPED_LAYERS = 4
"""Layers (at most) of the model ``ddp_copy_passes`` and ``zero_step_passes`` time: the DDP
hooks' cost per byte is the same from one layer to four, and four give four times the signal
against the step's wall-time noise."""


WRAPPED_BUILDS, WRAPPED_PAIRS = 24, 6
"""Fresh builds of the two models in ``ddp_copy_passes`` and ``zero_step_passes``, and pairs
of steps per build (two measured blocks after a warm-up one). A build's pairs share the
seconds they ran in, so they are not independent samples: many builds of few pairs, not few
builds of many. A calibration's draw enters every run made with its file as one bias, so it
takes as many builds as the local-truth bench's rows (``bench_planner_local.py``)."""


WRAPPED_BLOCK = 4
"""Steps of one model in a row in :func:`wrapped_step_extra`, the first dropped (it finds the
other model's tensors in the caches), as training runs one model step after step: two models
alternated every step both run slower than either alone."""


def wrapped_step_extra(spec: ModelSpec, seq: int, micro_batch: int, zero_stage: int,
                       full_step: bool, builds: int, pairs: int, *,
                       clock: Callable[[], float] | None = None,
                       executor: Callable[..., object] | None = None,
                       cores: int | None = None
                       ) -> tuple[list[float], list[float], torch.nn.Module]:
    """Per pair of steps, the seconds that data parallelism over the default group (tessera's
    DataParallel at `zero_stage` 0, ZeroModel above) adds to a training step of a model of
    `spec`'s shapes (up to WRAPPED_LAYERS layers, on `micro_batch` × `seq` tokens) besides
    its waits on the wrappers' collectives and its scalar all-reduces: the step as the trainer
    runs it (``parallelize``, then ``Executor.forward_backward``: forward, backward, the
    gradient sync; with `full_step` the norm, clipping and AdamW) at dp = the group's size
    less the same model's step at dp 1, in blocks of WRAPPED_BLOCK steps of each (the first
    dropped, the order alternating), over `builds` fresh pairs of models × ~`pairs` steps
    each, built in turn dp 1 first and wrapped first. The waits
    (``Executor.last_comm_wait_s``) are priced by the planner as the collectives compute did
    not hide and the straggler, the scalar all-reduces (``Executor.last_sync_s``) as
    ``cost.scalar_sync_times``: both come off.

    Where every rank has a core, wall time, the slowest rank's: a step ends for every rank
    when the last one has done its work and reached the reduction, so per pair the largest
    of the ranks' wrapped steps (each less its waits and syncs) less the largest of their
    steps at dp 1 (the planner adds the spread of plain compute on its own,
    ``terms.rank_skew``); what a collective in flight takes from the step, its thread on the
    rank's core, is wall time, not this thread's CPU. Where the ranks time-share fewer cores,
    this thread's CPU time, averaged over the ranks (the planner counts all the ranks' work
    over the cores: ``terms.shared_cpu_bound``), in which the blocking waits cost ~nothing.
    Stepped as the local-truth bench steps its pairs (``benchmarks/dp_cost.py``), whose
    rows these steps price: each rank its own tokens (:func:`rank_batch`), a barrier before
    every step, the previous build's models freed before the next build.
    The same list on every rank. Also returns, per pair, the wrapped step's waits averaged
    over the ranks (wall seconds; what the planner's exposed collectives and straggler
    stand for), and the model at dp 1 built from the same shapes (its parameters and units).
    Every rank of the default group must call it.

    Injection points, for tests that put their work on a fake clock: `clock` replaces the
    step's clock above, `executor` the ``Executor`` class (called with the parallel model;
    it reports ``last_comm_wait_s`` and ``last_sync_s`` on that clock), `cores` this
    machine's CPU count (``os.cpu_count()``), which decides whether the ranks time-share."""
    import torch.distributed as dist

    from tessera.config import Config, DataConfig, ParallelConfig, TrainConfig
    from tessera.model import build_model
    from tessera.parallelize import parallelize
    from tessera.step import Executor
    from tessera.topology import Topology

    world = dist.get_world_size()
    shapes = dataclasses.replace(block_config(spec, seq),
                                 n_layers=min(spec.layers, WRAPPED_LAYERS))

    def config(dp: int) -> Config:
        cfg = Config(model=shapes,
                     parallel=ParallelConfig(dp=dp, zero_stage=zero_stage if dp > 1 else 0),
                     train=TrainConfig(micro_batch_size=micro_batch, grad_accum=1,
                                       precision="fp32"),
                     data=DataConfig(seq_len=seq))
        return validate(cfg, dp)

    topo = Topology.build(config(world).parallel, "cpu")
    batch = rank_batch(spec.vocab_size, micro_batch, seq, dist.get_rank())
    shared = ranks_time_share(cores or os.cpu_count() or 1, world)
    clock = clock or (time.thread_time if shared else wall_clock)
    make_executor = executor or Executor

    def build(dp: int, seed: int):
        cfg = config(dp)
        torch.manual_seed(seed)
        model = parallelize(cfg, topo if dp > 1 else Topology.solo(), torch.device("cpu"))
        return make_executor(model), model.optimizer(cfg.train), cfg.train.grad_clip

    waits: list[float] = []

    def step_seconds(executor, optimizer, clip: float) -> float:
        """One training step's seconds on `clock`, less its waits and scalar syncs; every rank
        starts the step together, as the bench's pairs do."""
        seconds = executor.train_step([batch], optimizer, grad_clip=clip, update=full_step,
                                      barrier=True, clock=clock).seconds
        if not shared:  # a blocking wait costs the thread's CPU ~nothing
            seconds -= executor.last_comm_wait_s + executor.last_sync_s
        return seconds

    wrapped_s, plain_s = [], []
    for b in range(builds):
        # built in turn dp 1 first and wrapped first: the model built second steps faster
        # (4 ranks on 2 cores, micro-batch 16: the extra read 3.2 and 4.7 ms built dp 1
        # first, 6.8 and 6.6 wrapped first), as in the local-truth bench's A/A check
        dps = (1, world) if b % 2 == 0 else (world, 1)
        gc.collect()  # the previous build's models go back before this one allocates
        built = {dp: build(dp, b) for dp in dps}
        models = [(*built[1], False), (*built[world], True)]
        for block in range(-(-pairs // (WRAPPED_BLOCK - 1)) + 1):
            order = models if block % 2 == 0 else models[::-1]
            times, waited = {}, []
            for ex, opt, clip, is_wrapped in order:
                times[is_wrapped] = []
                for _ in range(WRAPPED_BLOCK):
                    times[is_wrapped].append(step_seconds(ex, opt, clip))
                    if is_wrapped:
                        waited.append(ex.last_comm_wait_s)
            if block > 0:  # the first blocks warm both up
                wrapped_s += times[True][1:]
                plain_s += times[False][1:]
                waits += waited[1:]
        del models, built
    ranks: list = [None] * world
    dist.all_gather_object(ranks, (wrapped_s, plain_s, waits))
    across = statistics.fmean if shared else max  # over the ranks, pair by pair
    wrapped_pairs = zip(*(r[0] for r in ranks), strict=True)
    plain_pairs = zip(*(r[1] for r in ranks), strict=True)
    extra = [across(w) - across(p) for w, p in zip(wrapped_pairs, plain_pairs, strict=True)]
    pair_waits = [statistics.fmean(w) for w in zip(*(r[2] for r in ranks), strict=True)]
    return extra, pair_waits, build_model(shapes, seed=0)


def ddp_copy_passes(spec: ModelSpec, seq: int, micro_batch: int, bandwidth: float,
                    per_tensor: float, builds: int = WRAPPED_BUILDS,
                    pairs: int = WRAPPED_PAIRS, **steps) -> float:
    """Passes over the gradient bytes, at `bandwidth` bytes/s, of what tessera's DataParallel
    adds to a training step besides its waits on the all-reduce, its fixed `per_tensor`
    seconds per parameter tensor (``ddp_tensor_us``) and the division of the buckets by dp
    after the wait (2 passes, priced by ``cost.ddp_bucket_time``): each gradient's copy into
    its bucket and what it slows the backward around it, the bucket's launch, gloo's thread
    on the core while the all-reduce is in flight, and the work after the wait. The median
    over the pairs of :func:`wrapped_step_extra` at ZeRO stage 0 with the full step (norm,
    clipping, AdamW). The hooks' own timer (``DataParallel.hook_seconds``) misses most of
    this, and a backward inside ``no_sync()`` leaves out the launch, the all-reduce in flight
    and the work after the wait. Every rank of the default group must call it. `steps`:
    :func:`wrapped_step_extra`'s injection points (tests)."""
    extra, _, plain = wrapped_step_extra(spec, seq, micro_batch, 0, True, builds, pairs,
                                         **steps)
    params = [p for p in plain.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    rest = statistics.median(extra) - len(params) * per_tensor
    return max(0.0, rest * bandwidth / grad_bytes - 2)


def zero_step_passes(spec: ModelSpec, seq: int, micro_batch: int, bandwidth: float,
                     per_unit: float, builds: int = WRAPPED_BUILDS,
                     pairs: int = WRAPPED_PAIRS, **steps) -> tuple[float, float]:
    """Passes over the parameter bytes, at `bandwidth` bytes/s, of what tessera's ZeRO-3 adds
    to a micro-batch's forward and backward besides its waits and its fixed `per_unit`
    seconds per unit (``zero_unit_us``): the gathered buffers' allocation and fill, the
    gradients flattened and their shards kept, the hooks and launches, and gloo's thread on
    the rank's core while the prefetched gathers and the reduce-scatters are in flight. The
    median over the pairs of :func:`wrapped_step_extra` at ZeRO stage 3 without clipping or
    the optimizer (the planner prices those on their own: ``cost.optimizer_step_time``,
    ``cost.scalar_sync_times``). Where the default group has several CPU ranks it replaces
    :func:`zero_unit_costs`' one-rank figure, which has nothing in flight. Also returns the
    steps' waits (seconds per micro-batch, the ranks' mean, the median over the pairs), from
    which :func:`in_step_overlap` reads ``dp_overlap``. Every rank of the default group must
    call it. `steps`: :func:`wrapped_step_extra`'s injection points (tests)."""
    from tessera.parallel.zero_units import transformer_units

    extra, waits, plain = wrapped_step_extra(spec, seq, micro_batch, 3, False, builds, pairs,
                                             **steps)
    units = len(transformer_units(plain))
    weight_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    rest = statistics.median(extra) - units * per_unit
    return max(0.0, rest * bandwidth / weight_bytes), statistics.median(waits)

def _compute_rates(spec: ModelSpec, seq: int, micro_batch: int,
                   cores: int | None = None) -> dict[str, float]:
    """This process's compute measurements (see the module docstring), one thread; `cores`:
    this machine's CPU count (``os.cpu_count()``; tests pass another)."""
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mm = matmul_rate(spec, seq, micro_batch)
        large, tail = matmul_curve(spec, seq, micro_batch)
        attn = attention_rate(spec, seq, micro_batch)
        bw = memory_bandwidth(spec, seq, micro_batch)
        # a GPU's kernels run beside the host: their launches are a floor (launch), not a
        # cost added to each (overhead), as a CPU's are
        overhead = 0.0 if on_gpu() else op_overhead()
        launch = launch_cost()
        passes = elementwise_passes(spec, seq, micro_batch, mm, attn, bw, overhead)
        compiled = compiled_passes(spec, seq, micro_batch, bw)
        optimizer = optimizer_tensor_seconds()
        fixed, rate = jitter(spec, seq, micro_batch)  # every rank at once (collectives)
        zero_unit, zero_passes = zero_unit_costs(bw)
        zero_waits = 0.0  # none measured
        # the collectives in flight, on this machine's ranks (a GPU's wait on a handle does
        # not block the host, so there wall time less the waits would hold the collectives)
        if dist.get_world_size() > 1 and not on_gpu():
            zero_passes, zero_waits = zero_step_passes(spec, seq, micro_batch, bw, zero_unit)
            share_batch = min(micro_batch, SHARE_MICRO_BATCH)
            cores = cores or os.cpu_count() or 1
            if share_batch != micro_batch and not ranks_time_share(cores, dist.get_world_size()):
                _, zero_waits = zero_step_passes(spec, seq, share_batch, bw, zero_unit)
        ddp_tensor, ddp_passes = ddp_hook_costs(spec, seq, micro_batch, bw)
    finally:
        torch.set_num_threads(threads)
    return {"mm": mm, "attn": attn, "bw": bw, "overhead": overhead, "passes": passes,
            "launch": launch, "compiled": compiled,
            "optimizer": optimizer, "jitter_fixed": fixed, "jitter_rate": rate,
            "mm_large": large, "mm_tail": tail,
            "zero_unit": zero_unit, "zero_passes": zero_passes, "zero_waits": zero_waits,
            "ddp_tensor": ddp_tensor, "ddp_passes": ddp_passes}

def _calibration_worker(spec: ModelSpec, seq: int, micro_batch: int,
                        device: str = "cpu") -> dict[str, float]:
    import torch.distributed as dist

    with rank_device(device, dist.get_rank()):  # every tensor made below lives there
        dist.barrier()  # every rank computes at once, as in training
        rates = _compute_rates(spec, seq, micro_batch)
        dist.barrier()
        cores = machine_shape(device)[0]
        return {**rates, **collective_link(spec, seq, micro_batch, cores)}


CALIBRATION_TIMEOUT_S = 3600
"""How long the calibrating ranks may take before they are taken for hung. A guard against a
deadlock, not a budget: the trainer's steps that time DDP's and ZeRO-3's work
(WRAPPED_BUILDS × WRAPPED_PAIRS each, and ZeRO-3 again at micro-batch 2) take most of a
calibration, minutes on a quiet host and several times that on a busy one."""


def measure(spec: ModelSpec, seq: int, micro_batch: int, ranks: int = 2, device: str = "cpu",
            backend: str = "gloo") -> dict[str, float]:
    """Compute rates (the median over `ranks` processes measuring at once) and the link
    between them over `backend` (rank 0's measurement), every tensor on `device`."""
    from tessera.testing import run_ranks

    results = run_ranks(_calibration_worker, ranks, args=(spec, seq, micro_batch, device),
                        timeout=CALIBRATION_TIMEOUT_S, backend=backend)
    out = dict(results[0])
    for key in ("mm", "attn", "bw", "overhead", "passes", "optimizer", "jitter_fixed",
                "jitter_rate", "mm_large", "mm_tail", "zero_unit", "zero_passes", "zero_waits",
                "ddp_tensor", "ddp_passes", "launch"):
        out[key] = statistics.median(r[key] for r in results)
    compiled = [r["compiled"] for r in results if r.get("compiled") is not None]
    out["compiled"] = statistics.median(compiled) if compiled else None
    return out


def calibrate(spec: ModelSpec, seq: int, micro_batch: int, ranks: int = 2,
              name: str = "local-cpu", device: str = "cpu", backend: str = "gloo") -> Hardware:
    """Measure this machine at `spec`'s shapes on `device` over `backend` (module docstring)."""
    load = os.getloadavg()[0]
    r = measure(spec, seq, micro_batch, ranks, device, backend)
    attn, bw, overhead, passes = r["attn"], r["bw"], r["overhead"], r["passes"]
    p2p_alpha, p2p_beta, alpha, beta = r["p2p_alpha"], r["p2p_beta"], r["alpha"], r["beta"]
    cores, memory, per_node = machine_shape(device)
    link_gbs = 1.0 / beta / 1e9
    hw = Hardware(
        name=name, peak_tflops=r["mm_large"] / 1e12, matmul_efficiency=1.0,
        matmul_tail_us=r["mm_tail"] * 1e6,
        attention_tflops=attn / 1e12, memory_gb=memory / 1e9,
        memory_bw_gbs=bw / 1e9, intra_node_gbs=link_gbs, inter_node_gbs=link_gbs,
        gpus_per_node=per_node, intra_node_alpha_us=alpha * 1e6,
        inter_node_alpha_us=alpha * 1e6, link_efficiency=1.0, op_overhead_us=overhead * 1e6,
        elementwise_passes=passes, launch_us=r["launch"] * 1e6,
        compiled_elementwise_passes=r["compiled"],
        local=LocalTerms(
            cores=cores, p2p_alpha_us=p2p_alpha * 1e6, p2p_gbs=1.0 / p2p_beta / 1e9,
            gather_efficiency=r["gather_efficiency"], optimizer_tensor_us=r["optimizer"] * 1e6,
            zero_unit_us=r["zero_unit"] * 1e6, zero_unit_passes=r["zero_passes"],
            ddp_tensor_us=r["ddp_tensor"] * 1e6, ddp_copy_passes=r["ddp_passes"],
            jitter_fixed_us=r["jitter_fixed"] * 1e6, jitter_rate=r["jitter_rate"],
            dp_overlap=collective_overlap(cores, ranks), calibrated_micro_batch=micro_batch),
        source=f"tessera plan calibrate: {spec.name} shapes, b={micro_batch}, s={seq}, "
               f"1 thread per rank, {ranks} ranks measuring at once, fp32, {device}, {backend}, "
               f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load:.1f} at start")
    if r["zero_waits"] > 0 and local_terms(hw).dp_overlap > 0:  # each rank has a core
        hw = replace(hw, dp_overlap=in_step_overlap(
            hw, spec, seq, min(micro_batch, SHARE_MICRO_BATCH), ranks, r["zero_waits"]))
    return hw


SHARE_MICRO_BATCH = 2
"""The micro-batch of the ZeRO-3 steps whose waits :func:`in_step_overlap` reads
``dp_overlap`` from (the calibrated one where smaller). The share is a rate of gloo's thread
beside the step's compute, but only a step whose collectives do not hide whole shows it: at
large micro-batches the planner's waits reach their floor (the first gather and the
straggler) at a small share, and the floor's own error would read as the share."""


def in_step_overlap(hw: Hardware, spec: ModelSpec, seq: int, micro_batch: int, ranks: int,
                    waits: float) -> float:
    """``dp_overlap`` as the ZeRO-3 step measured it: the share of a second of compute that a
    collective progresses by inside the step, the one at which the planner's waits for
    ZeRO-3 over `ranks` ranks at these shapes (up to WRAPPED_LAYERS layers, `micro_batch` ×
    `seq` tokens: what :func:`zero_step_passes` ran) equal the `waits` its steps measured
    (seconds per micro-batch, the ranks' mean: their exposed gathers and reduce-scatters and
    the straggler), found by bisection between 0 and `hw`'s dp_overlap (the share beside plain
    compute, :func:`collective_overlap`). Beside a matmul loop gloo's thread progresses at
    about that share; inside the step, with the gathered buffers allocated and filled and the
    reductions queued behind the gathers, slower. The planner's waits fall as
    the share grows: where they exceed `waits` even at the full share, the full share; where
    they fall short even at 0, 0."""
    from tessera.planner.cost import layout_costs
    from tessera.planner.workload import Layout, Workload

    model = dataclasses.replace(spec, layers=min(spec.layers, WRAPPED_LAYERS))
    layout = Layout(dp=ranks, zero_stage=3, micro_batch=micro_batch)

    def planner_waits(share: float) -> float:
        # ZeRO-3's own work (zero_unit_*) off: what is left of the chunks' ZeRO times is the
        # exposed collectives and the straggler
        h = replace(hw, dp_overlap=share, zero_unit_us=0.0, zero_unit_passes=0.0)
        w = Workload(model=model, hardware=h, gpus=ranks, global_batch=ranks * micro_batch,
                     seq_len=seq, precision="fp32")
        chunks = layout_costs(w, layout).chunks
        return sum(c.zero_forward + c.zero_backward for c in chunks)

    low, high = 0.0, local_terms(hw).dp_overlap
    if planner_waits(high) >= waits:
        return high
    if planner_waits(low) <= waits:
        return low
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if planner_waits(mid) > waits else (low, mid)
    return (low + high) / 2
