"""Measure this machine and describe it as a :class:`~tessera.planner.hardware.Hardware`.

Every compute rate is measured the way ``tessera train`` computes: in ``ranks`` processes at
once (every core busy, so the ranks share memory bandwidth and cache as they do in training,
which costs ~10% against one process alone), one thread per process, fp32, each keeping the
host memory it frees as a CPU training rank does (:mod:`tessera.host_memory`). Each rate is the
median of several repeats in thread CPU time, which other jobs on a shared machine do not
inflate; the median, not the best, because a training step is a typical repeat, not the luckiest
(the two differ by ~15% here). Collectives, which wait on another process, use wall time.
What is measured:

- the matrix-multiply rate at the model's shapes: every forward and backward GEMM of one block
  (x·Wᵀ, dY·W, dYᵀ·x for Q, K, V, O and the MLP) on b·s tokens, total FLOPs over total time;
  stored as ``peak_tflops`` with ``matmul_efficiency = 1``; timed again on b·s/8 tokens, the
  two totals give the shape dependence ``t = F/rate + n·tail`` (n GEMMs): ``peak_tflops`` is
  then the rate of large GEMMs and ``matmul_tail_us`` the fixed time per GEMM (both reproduce
  the model's shapes exactly; a tail that comes out negative, small GEMMs running faster per
  FLOP in cache, is stored as 0 with the rate at the model's shapes);
- the attention rate: ``scaled_dot_product_attention`` forward and backward with the model's
  heads, causal, converted to the rate that makes the cost model's attention term (half the
  4·b·s²·h FLOPs for a causal kernel, backward twice the forward) reproduce the time;
- memory bandwidth: a multiply-add streaming tensors as large as all the activations the
  model keeps for backward (out of cache, as the backward reads them);
- memory-bound passes: one block of tessera's reference model, forward and backward, timed at
  the model's shapes; what the matmul and attention rates and the per-kernel overhead do not
  explain is memory-bound traffic, expressed as passes over each stored activation byte
  (``elementwise_passes``: 2 for fused GPU kernels; tessera's unfused RMSNorm and RoPE make
  more);
- the per-kernel overhead: the time of an elementwise op on a one-element tensor with autograd
  recording (dispatch, allocation, graph bookkeeping);
- the optimizer's per-tensor cost: tessera's gradient norm, clipping and AdamW step over 256
  tiny parameters, per tensor (``optimizer_tensor_us``; the single-tensor AdamW loop on a CPU
  costs several times its kernels' ``op_overhead_us``);
- tessera's data-parallel engine work, each on a chain of one-layer modules against the
  chain unwrapped: DataParallel's gradient hook under ``no_sync()``, per parameter tensor
  (``ddp_tensor_us``, from tiny layers), and ZeRO-3's work per unit per micro-batch besides
  its collectives, over a one-rank group (``zero_unit_us`` from tiny layers); and the rest
  of what DataParallel adds to a step besides its waits (each gradient's copy into the
  bucket and what it slows the backward around it, the launch, gloo's thread on the core
  while the all-reduce is in flight, the work after the wait) as passes over the gradient
  bytes (``ddp_copy_passes``), and of what ZeRO-3 adds to a micro-batch besides its waits
  (its buffers and copies, gloo's thread on the core while the prefetched gathers and the
  reduce-scatters are in flight) as passes over the parameter bytes
  (``zero_unit_passes``, ``zero_step_passes``): whole training steps as the trainer runs
  them (``parallelize``, ``Executor``) of a model at the model's shapes (up to four layers)
  and the user's micro-batch, at dp = the calibrated ranks against the same model at dp 1,
  in blocks of steps over several builds, the slowest rank's, less the waits, the scalar
  all-reduces and the parts priced on their own (:func:`wrapped_step_extra`; on one rank,
  where there is nothing in flight, ZeRO-3's passes come from the one-rank group's chain
  of 1024×1024 layers);
- α and β over gloo, on ``ranks`` processes started with :func:`tessera.testing.run_ranks`:
  for point-to-point sends :func:`tessera.collectives.measure_alpha_beta` (ping-pong, fit of
  ``t = α + n·β``, the local reduction γ folded into β); for collectives the same fit
  (:func:`tessera.collectives.fit_alpha_beta`) to gloo's own ``all_reduce`` at 4 KiB-16 MiB,
  which costs several times what the ping-pong predicts, converted to the ring form the
  planner uses; all-gather and reduce-scatter are timed too and their speed relative to the
  ring form on that link stored as ``gather_efficiency``. Intra- and inter-node are the same
  link: every rank lives on this machine. Each collective follows a matmul and is timed from
  the rank's own start, so it holds the wait for later ranks, except where the ranks
  outnumber the cores: there a rank's early arrival gives its core to a late rank, and a
  call is timed from the last arrival plus the core-time the arrivals left idle
  (``timed_collective``, ``sync_idle_seconds``; the planner adds no straggler wait for
  time-shared ranks, ``cost.rank_skew``);
- jitter: how far apart ranks that start a stretch of one block's forward + backward, and
  one of four, together (after a barrier) finish it, in wall time: per stretch the median
  over repeats of (slowest rank − the ranks' mean), which is what a collective after the
  compute waits for, divided by the expected maximum of N standard normals: σ at two
  lengths T, and the line through them, σ = a + r·T (``jitter_fixed_us``, ``jitter_rate``;
  :func:`tessera.planner.comm.straggler_time` inverted). Not √T: on this machine the wait
  grows as T^0.86-0.91 over 1-16 blocks (benchmarks/straggler_scaling.py), ranks running
  at different speeds for whole stretches. Not one rank's spread over time either: a slow
  minute slows every rank alike and costs no collective anything (on this machine the
  per-rank spread over-priced the wait 2.4-6x);
- memory: the machine's RAM divided among its cores (one rank per core), and the cores
  themselves: with more ranks than cores, ranks time-share them (``cores``). On GPUs: one
  GPU's memory, no cores to share (``cores = 0``) and the GPUs as the node.

Data-parallel overlap (``dp_overlap``, :func:`collective_overlap`): gloo runs its
collectives on a thread of its own beside the rank's compute. Where every rank has a core, a
collective in flight during compute (a ZeRO-3 gather prefetched, a reduce-scatter or a DDP
bucket launched inside the backward) shares the core with the compute thread, each getting
half of it (two runnable threads on one core; a core to spare for every thread: all of it),
so c seconds of compute hide c/2 seconds of the collective, and what the collective's thread
takes from the compute is priced in the passes above, measured with the collectives in
flight. That is the share beside plain compute (a unit's gather and reduce-scatter were
measured there at 0.5-0.7 of their solo speed). Inside a ZeRO-3 step at micro-batch 2 they
progressed at a third to a fifth of it (docs/planner.md, Inside the step a collective runs
slower), so where the ZeRO-3 step's waits were measured (:func:`zero_step_passes`, at
micro-batch 2, ``SHARE_MICRO_BATCH``, where the collectives do not hide whole) the share is
the one at which the planner's waits for that step equal them, at most the share beside
plain compute (:func:`in_step_overlap`). Where ranks time-share fewer cores, every
core is already busy with some rank's compute: nothing hides (0). On GPUs the collectives
run on their own stream: 1.

Device and backend: the run's (``--device``/``--backend``; by default CUDA with NCCL where a
GPU is present, else the CPU with gloo, as ``tessera train`` picks). Every tensor is made on
that device (it is the default device while a rank measures, so no measurement names one),
each rank takes GPU ``rank mod count``, and on a GPU, whose kernels run asynchronously, times
are wall times after a ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera.planner.comm import allgather_time
from tessera.planner.compute import OPS_PER_LAYER_FORWARD
from tessera.planner.formulas import layer_activation_bytes, layer_forward_flops
from tessera.planner.hardware import Hardware, Link, ranks_time_share
from tessera.planner.models import ModelSpec

LOCAL_RANKS = 64
"""Ranks one machine may hold: every local rank is on the same "node" (one loopback link);
`cores` says how many of them compute at full speed."""


def _on_gpu() -> bool:
    return torch.get_default_device().type == "cuda"


def _wall_clock() -> float:
    """Wall seconds once the GPU's queued kernels have finished (on a GPU)."""
    if _on_gpu():
        torch.cuda.synchronize()
    return time.perf_counter()


def _samples(fn: Callable[[], object], repeats: int, warmup: int = 2,
             clock: Callable[[], float] | None = None) -> list[float]:
    """Seconds of `repeats` calls of `fn` after `warmup` untimed ones, on `clock` (default:
    this thread's CPU time on the CPU, synchronized wall time on a GPU)."""
    clock = clock or (_wall_clock if _on_gpu() else time.thread_time)
    samples = []
    for i in range(warmup + repeats):
        start = clock()
        fn()
        if i >= warmup:
            samples.append(clock() - start)
    return samples


def _typical_time(fn: Callable[[], object], repeats: int = 11, warmup: int = 2) -> float:
    """The median of `repeats` calls, in this thread's CPU time. With one intra-op thread
    torch runs every kernel in the calling thread, so CPU time is what the kernel costs, and
    unlike wall time it does not grow when other jobs on a shared machine take the core."""
    return statistics.median(_samples(fn, repeats, warmup))


def matmul_rate(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """FLOP/s of one block's forward and backward GEMMs at the model's shapes."""
    flops, seconds, _ = matmul_totals(spec, micro_batch * seq)
    return flops / seconds


def matmul_curve(spec: ModelSpec, seq: int, micro_batch: int) -> tuple[float, float]:
    """(large-GEMM FLOP/s, fixed seconds per GEMM) from the block's GEMMs on b·s and b·s/8
    tokens (module docstring); (rate at the model's shapes, 0) if the tail is not positive."""
    f1, t1, _ = matmul_totals(spec, micro_batch * seq)
    f2, t2, _ = matmul_totals(spec, max(1, micro_batch * seq // 8))
    # Per GEMM as the cost model counts them (cost.block_matmul_times: QKV as one GEMM, the
    # output projection, the MLP's matrices; forward and two backward each), so that the
    # model reproduces the measured total at the model's shapes.
    n = 3 * (2 + spec.mlp_matrices)
    if t1 > t2 and f1 > f2:
        rate = (f1 - f2) / (t1 - t2)
        tail = (t1 - f1 / rate) / n
        if tail > 0:
            return rate, tail
    return f1 / t1, 0.0


def matmul_totals(spec: ModelSpec, tokens: int) -> tuple[float, float, int]:
    """(FLOPs, seconds, GEMMs) of one block's forward and backward GEMMs on `tokens`."""
    h = spec.hidden
    shapes = [(h, h), (h, spec.kv_dim), (h, spec.kv_dim), (h, h)]
    shapes += [(h, spec.ffn_hidden)] * (spec.mlp_matrices - 1) + [(spec.ffn_hidden, h)]
    total_s = total_flops = 0.0
    for k, n in shapes:
        x = torch.randn(tokens, k)
        w = torch.randn(n, k)
        dy = torch.randn(tokens, n)
        flops = 3 * 2 * tokens * k * n  # forward, input gradient, weight gradient

        def run(x=x, w=w, dy=dy) -> None:
            x @ w.t()
            dy @ w
            dy.t() @ x

        total_s += _typical_time(run)
        total_flops += flops
    return total_flops, total_s, 3 * len(shapes)


def attention_rate(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """The rate r such that 1.5 · (4·b·s²·h) / r is the measured causal forward + backward."""
    d = spec.head_dim
    q = torch.randn(micro_batch, spec.heads, seq, d, requires_grad=True)
    k = torch.randn(micro_batch, spec.kv_heads, seq, d, requires_grad=True)
    v = torch.randn(micro_batch, spec.kv_heads, seq, d, requires_grad=True)
    grad = torch.randn(micro_batch, spec.heads, seq, d)

    def run() -> None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=spec.kv_heads != spec.heads)
        y.backward(grad)

    seconds = _typical_time(run)
    return 1.5 * 4 * micro_batch * seq * seq * spec.hidden / seconds


def memory_bandwidth(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """Bytes/s of an elementwise multiply-add (reads two tensors, writes one) over tensors as
    large as all the activations the model keeps for its backward (at least 32 MiB each), so
    the measurement streams from memory as the backward does, not from cache."""
    act = spec.layers * layer_activation_bytes(spec, micro_batch, seq, e=4, flash=True)
    n = max(int(act / 3 / 4), 8 * 2**20)
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    seconds = _typical_time(lambda: torch.add(a, b, alpha=0.5, out=out), repeats=9)
    return 3 * 4 * n / seconds


def _block_config(spec: ModelSpec, seq: int):
    from tessera.config import ModelConfig

    return ModelConfig(vocab_size=spec.vocab_size, d_model=spec.hidden, n_layers=1,
                       n_heads=spec.heads, n_kv_heads=spec.kv_heads,
                       ffn_hidden=spec.ffn_hidden, max_seq_len=seq)


def _block(spec: ModelSpec, seq: int) -> torch.nn.Module:
    """One block of tessera's reference model at the model's shapes."""
    from tessera.model import Block

    return Block(_block_config(spec, seq))


def _block_step(spec: ModelSpec, seq: int, micro_batch: int) -> Callable[[], None]:
    """Forward + backward of one block of tessera's reference model at the model's shapes."""
    from tessera.model import rope_tables

    cfg = _block_config(spec, seq)
    block = _block(spec, seq)
    cos, sin = rope_tables(cfg.head_dim, seq, cfg.rope_theta)
    x = torch.randn(micro_batch, seq, spec.hidden, requires_grad=True)
    grad = torch.randn(micro_batch, seq, spec.hidden)

    def run() -> None:
        block(x, cos, sin).backward(grad)

    return run


def block_seconds(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """Seconds of one block's forward + backward (a typical repeat)."""
    return _typical_time(_block_step(spec, seq, micro_batch), repeats=9)


JITTER_BLOCKS = (1, 4)
"""The stretches calibrate times the ranks' spread over, in blocks of forward + backward."""


def side_by_side(step: Callable[[], None], times: int,
                 clock: Callable[[], float] = _wall_clock) -> tuple[float, float]:
    """Every rank of the default group runs `step` `times` times from a barrier: (the
    slowest rank's seconds on `clock` (wall time) minus the ranks' mean, the mean), the same
    on every rank."""
    import torch.distributed as dist

    dist.barrier()
    start = clock()
    for _ in range(times):
        step()
    mine = torch.tensor([clock() - start], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    seconds = [float(t) for t in every]
    mean = statistics.fmean(seconds)
    return max(seconds) - mean, mean


def jitter(spec: ModelSpec, seq: int, micro_batch: int, repeats: int = 48, *,
           step: Callable[[], None] | None = None,
           clock: Callable[[], float] = _wall_clock) -> tuple[float, float]:
    """(a seconds, r per second): σ = a + r·T of a stretch of T seconds of compute as the
    ranks of the default group run it side by side (module docstring). Per stretch of
    JITTER_BLOCKS blocks, interleaved: the median over repeats of the slowest rank's wall
    time minus the ranks' mean, over E[max of N standard normals] (Blom, as
    ``straggler_time``), at T the median time; the line through the two (neither part
    negative). Every rank returns the same values; zeros on one rank. `step` (default: one
    block's forward + backward, :func:`_block_step`) and `clock` (default: wall time) are
    what the tests replace with work on a fake clock."""
    import torch.distributed as dist

    from tessera.planner.comm import expected_max_normal

    n = dist.get_world_size()
    if n <= 1:
        return 0.0, 0.0
    step = step or _block_step(spec, seq, micro_batch)
    step()  # warm-up
    skews: dict[int, list[float]] = {k: [] for k in JITTER_BLOCKS}
    times: dict[int, list[float]] = {k: [] for k in JITTER_BLOCKS}
    for _ in range(repeats):
        for k in JITTER_BLOCKS:
            skew, mean = side_by_side(step, k, clock)
            skews[k].append(skew)
            times[k].append(mean)
    (t1, s1), (t2, s2) = ((statistics.median(times[k]),
                           statistics.median(skews[k]) / expected_max_normal(n))
                          for k in JITTER_BLOCKS)
    return sigma_line(t1, s1, t2, s2)


def sigma_line(t1: float, s1: float, t2: float, s2: float) -> tuple[float, float]:
    """(a, r) of σ = a + r·T through (t1, s1) and (t2, s2), t1 < t2, with a, r ≥ 0: a line
    that would fall below 0 at T = 0 goes through the origin and the longer stretch's point,
    one that would fall with T is flat at the mean σ."""
    rate = (s2 - s1) / (t2 - t1)
    if rate <= 0:
        return (s1 + s2) / 2, 0.0
    fixed = s1 - rate * t1
    if fixed < 0:
        return 0.0, s2 / t2
    return fixed, rate


def elementwise_passes(spec: ModelSpec, seq: int, micro_batch: int, mm: float, attn: float,
                       bw: float, overhead: float) -> float:
    """Passes over each stored activation byte that make the cost model's block time (3x the
    forward: matmuls, attention, memory-bound kernels, per-kernel overhead) equal the measured
    block: what the matmul and attention rates do not explain is memory-bound work."""
    flops_mm, flops_attn = layer_forward_flops(spec, micro_batch, seq)
    explained = 3 * (flops_mm / mm + 0.5 * flops_attn / attn
                     + OPS_PER_LAYER_FORWARD * overhead)
    stored = layer_activation_bytes(spec, micro_batch, seq, e=4, flash=True)
    rest = block_seconds(spec, seq, micro_batch) - explained
    return max(0.5, rest / (3 * stored / bw))


def optimizer_tensor_seconds(tensors: int = 256, repeats: int = 15) -> float:
    """Seconds per parameter tensor of a step's gradient norm, clipping and AdamW update
    beyond their memory traffic: tessera's own code (``ParallelModel.local_grad_sq``'s fp64
    Σ g², one batched norm: ``tessera.optim.add_sums_of_squares``; the clipping's scale;
    ``tessera.optim.adamw``) over `tensors` parameters of 64
    elements, whose traffic is nothing, so the time is the loops' fixed cost (measured
    directly, not as a small difference of two large timings)."""
    from tessera.config import TrainConfig
    from tessera.optim import adamw, add_sums_of_squares

    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = adamw(params, TrainConfig())

    @torch.no_grad()
    def run() -> None:
        sq = torch.zeros((), dtype=torch.float64)
        add_sums_of_squares(sq, [p.grad for p in params])
        scale = 1.0 / (float(sq.sqrt()) + 1.0)  # clipped, as early in training
        for p in params:
            p.grad.mul_(scale)
        optimizer.step()

    return _typical_time(run, repeats=repeats) / tensors


class _Chain(torch.nn.Module):
    """`count` bias-free d×d linears in a row: per-unit and per-tensor engine costs are timed
    on it with one input row, so the model's own work is a matrix-vector product per layer."""

    def __init__(self, count: int, d: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False)
                                           for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _chain_backward(model: torch.nn.Module, x: torch.Tensor, sync: str) -> None:
    """One forward + backward of a chain on `x`, then its gradients dropped. `sync`: "plain"
    (an unwrapped chain), "no_sync" (a DataParallel wrapper's hooks run, nothing is reduced)
    or "sync" (the wrapper's gradient sync after the backward)."""
    if sync == "no_sync":
        with model.no_sync():
            model(x).sum().backward()
    else:
        model(x).sum().backward()
        if sync == "sync":
            model.finish_gradient_sync()
    for param in model.parameters():
        param.grad = None


def _extra_per_layer(make: Callable[[torch.nn.Module], torch.nn.Module], count: int, d: int,
                     hooks_only: bool = False, repeats: int = 15) -> float:
    """Seconds per layer that wrapping a `_Chain(count, d)` with `make` adds to its forward +
    backward on one row, in thread CPU time (medians over interleaved rounds, so a slow minute
    hits both alike): with the wrapper's gradient sync, or with `hooks_only` its backward
    inside ``no_sync()`` (DataParallel: the hooks run, nothing is reduced)."""
    torch.manual_seed(0)
    plain = _Chain(count, d)
    torch.manual_seed(0)
    wrapped = make(_Chain(count, d))
    x = torch.randn(1, d)

    def base() -> None:
        _chain_backward(plain, x, "plain")

    def other() -> None:
        _chain_backward(wrapped, x, "no_sync" if hooks_only else "sync")

    plain_t, wrapped_t = [], []
    for _ in range(3):
        plain_t += _samples(base, repeats // 3, warmup=1)
        wrapped_t += _samples(other, repeats // 3, warmup=1)
    return max(0.0, statistics.median(wrapped_t) - statistics.median(plain_t)) / count


def zero_unit_costs(spec: ModelSpec, bandwidth: float) -> tuple[float, float]:
    """tessera's ZeRO-3 work per unit per micro-batch besides its collectives, as (seconds
    fixed, passes over the unit's parameter bytes at `bandwidth` bytes/s): a chain of one-layer
    units wrapped in ZeRO-3 over a group of this rank alone (Topology.solo: its gathers and
    reductions move nothing) against the chain unwrapped, with tiny layers (8×8: the fixed
    part, the hooks and bookkeeping) and with 1024×1024 layers (the part that grows with the
    unit: fresh buffers for the gathered parameters and the flattened gradient, and its
    copy). Measured directly, not as a difference of two model steps, whose noise was as
    large as the effect. Every rank of the default group must call it (it creates the
    one-rank groups)."""
    from tessera.parallel.zero import ZeroModel
    from tessera.topology import Topology

    solo = Topology.solo().groups["dp"]

    def wrap(chain: torch.nn.Module) -> torch.nn.Module:
        return ZeroModel(chain, solo, stage=3,
                         units=[(f"u{i}", [layer]) for i, layer in enumerate(chain.layers)])

    fixed = _extra_per_layer(wrap, 32, 8)
    d = 1024  # 4 MiB units: each pass is ~10x the noise of the timings here
    large = _extra_per_layer(wrap, 8, d)
    return fixed, max(0.0, large - fixed) * bandwidth / (4 * d * d)


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

    fixed = _extra_per_layer(wrap, 32, 8, hooks_only=True)
    if _on_gpu():
        return fixed, 2.0
    return fixed, ddp_copy_passes(spec, seq, micro_batch, bandwidth, fixed)


WRAPPED_LAYERS = 4
"""Layers (at most) of the model ``ddp_copy_passes`` and ``zero_step_passes`` time: the DDP
hooks' per-byte cost holds from one layer to four (docs/planner.md, What DDP at dp 2 misses),
but the cost of one layer (~1 ms at micro-batch 16) is within the step's wall-time noise; four
give ~4x the signal."""


WRAPPED_BUILDS, WRAPPED_PAIRS = 24, 6
"""Fresh builds of the two models in ``ddp_copy_passes`` and ``zero_step_passes``, and pairs
of steps per build (two measured blocks after a warm-up one). A build's pairs share the
seconds they ran in: in one launch (DDP at dp 4 on 2 cores, micro-batch 16, 2026-11-28) the
medians of single builds read 2.4-17.3 ms, and the median over 4 random builds of them moved
5.1-9.0 ms (10-90%); over 4 builds × 20 pairs, as before, calibrations minutes apart priced
DDP's work at 2.5-7.3 ms. So many builds of few pairs, as ``bench_planner_local.py``'s
BLOCKS_PER_BUILD found for the measured side. 24 builds since 2026-11-29 (12 before): these
steps measure the same thing as the bench's overlap rows, with as many pairs as a row had,
so a calibration's draw is as noisy as a run's and enters every run made with that file as
one bias. Runs 37-39 shared one calibration: dp 2 ZeRO-3 at micro-batch 16 was priced
1.13x the three runs' mean measured cost (each run's own ±7%): 1.06, 1.20 and 1.12 in-run
(docs/planner.md, Fortieth run). Twice the builds narrow the median's interval by
~1/√2, for ~1.75x the calibration's time (the four demo files of the local-truth bench:
28 minutes on the quiet host, 16 before)."""


WRAPPED_BLOCK = 4
"""Steps of one model in a row in :func:`wrapped_step_extra`, the first dropped (it finds the
other model's tensors in the caches), as training runs one model step after step: a model
alternated with another every step runs both ~40% slower (benchmarks/dp_cost.py)."""


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
    ``cost.rank_skew``); what a collective in flight takes from the step, its thread on the
    rank's core, is wall time, not this thread's CPU. Where the ranks time-share fewer cores,
    this thread's CPU time, averaged over the ranks (the planner counts all the ranks' work
    over the cores: ``cost.shared_cpu_bound``), in which the blocking waits cost ~nothing.
    Stepped as the local-truth bench steps its pairs (``benchmarks/dp_cost.py``), whose
    rows these steps price: each rank its own tokens, a barrier before every step, the
    previous build's models freed before the next build. Without the three, in launches
    alternating with the bench's way (DDP, 4 ranks on 2 cores, micro-batch 16, 8 builds each,
    2026-11-29), this read DDP's extra CPU at 8.6 and 7.0 ms a step where the bench's way
    read 14.1 and 11.1; with them 11.1 and 9.2 (launches before: 3.0-9.9, the bench's rows
    9.8-13.3; docs/planner.md, Forty-second run).
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
    shapes = dataclasses.replace(_block_config(spec, seq),
                                 n_layers=min(spec.layers, WRAPPED_LAYERS))

    def config(dp: int) -> Config:
        cfg = Config(model=shapes,
                     parallel=ParallelConfig(dp=dp, zero_stage=zero_stage if dp > 1 else 0),
                     train=TrainConfig(micro_batch_size=micro_batch, grad_accum=1,
                                       precision="fp32"),
                     data=DataConfig(seq_len=seq))
        return cfg.validate(dp)

    topo = Topology.build(config(world).parallel, "cpu")
    # each rank its own tokens, as training gives it its own share of the batch
    tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq + 1),
                           generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    shared = ranks_time_share(cores or os.cpu_count() or 1, world)
    clock = clock or (time.thread_time if shared else _wall_clock)
    make_executor = executor or Executor

    def build(dp: int, seed: int):
        cfg = config(dp)
        torch.manual_seed(seed)
        model = parallelize(cfg, topo if dp > 1 else Topology.solo(), torch.device("cpu"))
        return make_executor(model), model.optimizer(cfg.train), cfg.train.grad_clip

    waits: list[float] = []

    def step_seconds(executor, optimizer, clip: float) -> float:
        """One training step's seconds on `clock`, less its waits and scalar syncs."""
        optimizer.zero_grad(set_to_none=True)  # as the trainer leaves them
        dist.barrier()  # every rank starts the step together, as the bench's pairs do
        start = clock()
        executor.forward_backward([batch])
        if full_step:
            executor.clip_grad_norm_(clip)
            optimizer.step()
        seconds = clock() - start
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
    seconds per parameter tensor (``ddp_tensor_us``, measured from outside on tiny layers)
    and the division of the buckets by dp after the wait (2 passes, priced on its own by
    ``cost.ddp_bucket_time``): each fresh gradient's copy into its bucket slot and what that
    copy slows the backward around it, the bucket's launch inside the last hook, gloo's
    thread taking the core while the all-reduce is in flight, and the work after the wait
    (the used flags, the gradients re-pointed; clipping and AdamW over the bucket's views).
    Measured where training runs it (:func:`wrapped_step_extra`): whole training steps
    (forward, backward, gradient sync, norm, clipping, AdamW) as the trainer runs them, in
    DataParallel over the default group with the gradients reduced, against the same model
    at dp 1, the slowest rank's; the median over the pairs. The whole cost, not the hooks'
    own timer (``DataParallel.hook_seconds``), which misses most of it; nor the backward
    alone inside ``no_sync()``, which this replaced: it left out the launch, the all-reduce
    in flight and the work after the wait, and priced DDP at dp 2 at 0.66-0.91 of its
    measured cost (docs/planner.md, What DDP at dp 2 misses). Every rank of the default
    group must call it. `steps`: :func:`wrapped_step_extra`'s injection points (tests)."""
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
    to a micro-batch's forward and backward besides its waits on its gathers and
    reductions and its fixed `per_unit` seconds per unit (``zero_unit_us``, from tiny
    layers): the gathered buffers' allocation and fill, the gradients flattened and their
    shards kept, the hooks and the launches, and gloo's thread taking the rank's core while
    the prefetched gathers and the reduce-scatters are in flight (on a CPU, what a collective
    hidden behind compute still costs it). Measured where training runs it
    (:func:`wrapped_step_extra`): the trainer's forward, backward and gradient sync of the
    model in ZeRO-3 over the default group (its units: the embedding, each block, the head),
    against the same model at dp 1, the slowest rank's; the median over the pairs. Not the
    clipping nor
    the optimizer, which the planner prices on their own (the sharded AdamW,
    ``cost.optimizer_step_time``; the norm's scalar all-reduce, ``cost.scalar_sync_times``).
    It replaces the one-rank group's figure of :func:`zero_unit_costs` wherever the default
    group has several CPU ranks: with nothing in flight, that priced ZeRO-3's work at dp 2 at
    2.4-3.3 ms a micro-batch, a sixth to a quarter of what its steps do besides their waits
    (13-21 ms; docs/planner.md, What ZeRO-3 at dp 2 misses). Also returns the steps' waits
    (seconds per micro-batch, the ranks' mean, the median over the pairs), from which
    :func:`in_step_overlap` reads ``dp_overlap``. Every rank of the default group must call
    it (the steps gather and reduce). `steps`: :func:`wrapped_step_extra`'s injection points
    (tests)."""
    from tessera.parallel.zero import transformer_units

    extra, waits, plain = wrapped_step_extra(spec, seq, micro_batch, 3, False, builds, pairs,
                                             **steps)
    units = len(transformer_units(plain))
    weight_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    rest = statistics.median(extra) - units * per_unit
    return max(0.0, rest * bandwidth / weight_bytes), statistics.median(waits)


def op_overhead() -> float:
    """Seconds of one tiny recorded op: the fixed cost every kernel pays."""
    x = torch.ones(1, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(200):
            y = y * 1.0
    return _typical_time(run, repeats=9) / 200


def sync_idle_seconds(arrivals: list[float], cores: int) -> float:
    """Wall seconds the ranks' spread of `arrivals` (instants on one clock) at a collective
    costs a step when they share `cores` CPU cores: the core-time left idle between the first
    arrival and the last, over the cores they use (min(cores, ranks)). While k of N ranks have
    arrived, N − k still compute, and a core idles only when fewer than that many are left:
    with a core each (N ≤ cores) that is every arrived rank's, and the cost is the last
    arrival minus the mean one (what a rank's own-start timing averages to); N ranks
    time-sharing fewer cores give an early rank's core to a late one, and only the last
    ranks' gaps idle any (4 ranks on 2 cores: half the gap between the last two)."""
    t = sorted(arrivals)
    n = len(t)
    used = min(cores, n)
    if n <= 1 or used <= 0:
        return 0.0
    idle = sum(max(0, used - (n - k)) * (t[k] - t[k - 1]) for k in range(1, n))
    return idle / used


def timed_collective(op: str, nbytes: int, repeats: int,
                     before: Callable[[], object] | None = None, cores: int = 0,
                     clock: Callable[[], float] = _wall_clock) -> float:
    """Median wall seconds of gloo's `op` ('all_reduce', 'all_gather', 'reduce_scatter') whose
    full (unsharded) tensor has `nbytes`, each call right after `before` (compute).

    Each call is timed from this rank's own start, which holds the wait for the ranks that
    arrive after it: with a core each, what the step's collective waits for too. Where the
    ranks time-share `cores` CPU cores of this machine (0 < cores < ranks), a rank that
    arrives early leaves its core to a late one, so that wait is mostly someone's compute:
    there each call costs the ranks' mean time from the last arrival to their return, plus
    the cores its arrivals left idle (:func:`sync_idle_seconds`), read across the ranks on
    the clock the machine's processes share. Every rank returns the same value then.
    `clock`: wall time (the clock the tests replace with a fake one)."""
    import torch.distributed as dist

    from tessera.collectives.algorithms import all_gather_single, reduce_scatter_single

    n = dist.get_world_size()
    shared = ranks_time_share(cores, n)
    full = torch.ones(nbytes // 4 // n * n)
    shard = torch.ones(full.numel() // n)
    run = {"all_reduce": lambda: dist.all_reduce(full),
           "all_gather": lambda: all_gather_single(full, shard),
           "reduce_scatter": lambda: reduce_scatter_single(shard, full)}[op]
    samples = []
    for _ in range(repeats + 3):
        dist.barrier()
        if before is not None:
            before()
        start = clock()
        run()
        end = clock()
        if not shared:
            samples.append(end - start)
            continue
        mine = torch.tensor([start, end], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(n)]
        dist.all_gather(every, mine)  # outside the timed call
        starts = [float(e[0]) for e in every]
        last = max(starts)
        samples.append(statistics.fmean(float(e[1]) - last for e in every)
                       + sync_idle_seconds(starts, cores))
    return statistics.median(samples[3:])


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
        overhead = op_overhead()
        passes = elementwise_passes(spec, seq, micro_batch, mm, attn, bw, overhead)
        optimizer = optimizer_tensor_seconds()
        fixed, rate = jitter(spec, seq, micro_batch)  # every rank at once (collectives)
        zero_unit, zero_passes = zero_unit_costs(spec, bw)
        zero_waits = 0.0  # none measured
        # the collectives in flight, on this machine's ranks (a GPU's wait on a handle does
        # not block the host, so there wall time less the waits would hold the collectives)
        if dist.get_world_size() > 1 and not _on_gpu():
            zero_passes, zero_waits = zero_step_passes(spec, seq, micro_batch, bw, zero_unit)
            share_batch = min(micro_batch, SHARE_MICRO_BATCH)
            cores = cores or os.cpu_count() or 1
            if share_batch != micro_batch and not ranks_time_share(cores, dist.get_world_size()):
                _, zero_waits = zero_step_passes(spec, seq, share_batch, bw, zero_unit)
        ddp_tensor, ddp_passes = ddp_hook_costs(spec, seq, micro_batch, bw)
    finally:
        torch.set_num_threads(threads)
    return {"mm": mm, "attn": attn, "bw": bw, "overhead": overhead, "passes": passes,
            "optimizer": optimizer, "jitter_fixed": fixed, "jitter_rate": rate,
            "mm_large": large, "mm_tail": tail,
            "zero_unit": zero_unit, "zero_passes": zero_passes, "zero_waits": zero_waits,
            "ddp_tensor": ddp_tensor, "ddp_passes": ddp_passes}


def _collective_link(spec: ModelSpec, seq: int, micro_batch: int,
                     cores: int = 0) -> dict[str, float]:
    """Point-to-point and collective α and β of this process's default group, its ranks
    sharing `cores` CPU cores (0: a device each)."""
    import torch.distributed as dist

    from tessera.collectives import fit_alpha_beta, measure_alpha_beta

    # Point to point: a ping-pong up to 16 MiB (so that β is pinned by large messages), 25
    # repeats for a stable median on a machine shared with other jobs.
    p2p = measure_alpha_beta(None, sizes=tuple(4 ** k for k in range(2, 13)), repeats=25)
    # Collectives: gloo's own all-reduce costs several times what the ping-pong predicts (its
    # algorithm, threads, copies), so the link is fitted to it: t = a + b·n, and for the ring
    # form 2(N−1)·α + 2(N−1)/N·n·β that the planner uses, α = a / (2(N−1)), β = b·N / (2(N−1)).
    # Each call follows a matmul at the model's shapes, as in training: the ranks arrive a
    # little apart, with cold caches and idle gloo threads, which costs up to twice a call
    # timed back to back. Ranks time-sharing the cores pay for their spread of arrivals only
    # the cores it leaves idle (timed_collective).
    x = torch.randn(micro_batch * seq, spec.hidden)
    w = torch.randn(spec.ffn_hidden, spec.hidden)

    def compute() -> None:
        x @ w.t()

    sizes = [4 ** k for k in range(6, 13)]  # 4 KiB to 16 MiB
    seconds = [timed_collective("all_reduce", n, 25, compute, cores) for n in sizes]
    a, b = fit_alpha_beta(sizes, seconds)
    n = dist.get_world_size()
    alpha, beta = a / (2 * (n - 1)), b * n / (2 * (n - 1))
    # All-gather and reduce-scatter against the ring form on that link, at the sizes tensor
    # and sequence parallelism move (64 KiB to 16 MiB).
    ring = Link(alpha=alpha, bandwidth=1.0 / beta)
    timed = [(size, timed_collective(op, size, 25, compute, cores))
             for op in ("all_gather", "reduce_scatter") for size in sizes[2:]]
    return {"p2p_alpha": p2p.alpha, "p2p_beta": p2p.beta + p2p.gamma, "alpha": alpha,
            "beta": beta, "gather_efficiency": gather_efficiency(ring, n, timed)}


def ring_beta(seconds: float, nbytes: float, n: int, alpha: float) -> float:
    """β (seconds per byte) that gives an all-reduce of `nbytes` over `n` ranks `seconds` in
    the ring form 2(n−1)·α + 2(n−1)/n·nbytes·β the planner uses, α given (at least 0.1% of
    the time is left to the bytes, so a latency-bound timing still gives a finite rate)."""
    return max(seconds - 2 * (n - 1) * alpha, 1e-3 * seconds) / (2 * (n - 1) / n * nbytes)


def gather_efficiency(ring: Link, n: int, timed: list[tuple[float, float]]) -> float:
    """Speed of all-gathers and reduce-scatters relative to the ring form on `ring` (the cost
    model's ``allgather_time`` at gather efficiency 1): the median over the (bytes, seconds)
    timings of predicted / measured, at most 1."""
    return min(1.0, statistics.median(allgather_time(size, n, ring) / seconds
                                      for size, seconds in timed))


def rank_device(device: str, rank: int) -> torch.device:
    """The device a calibrating rank measures on: the CPU, or GPU `rank` mod the GPU count."""
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def _calibration_worker(spec: ModelSpec, seq: int, micro_batch: int,
                        device: str = "cpu") -> dict[str, float]:
    import torch.distributed as dist

    with rank_device(device, dist.get_rank()):  # every tensor made below lives there
        dist.barrier()  # every rank computes at once, as in training
        rates = _compute_rates(spec, seq, micro_batch)
        dist.barrier()
        cores = machine_shape(device)[0]
        return {**rates, **_collective_link(spec, seq, micro_batch, cores)}


CALIBRATION_TIMEOUT_S = 3600
"""How long the calibrating ranks may take before they are taken for hung. A guard against a
deadlock, not a budget: the trainer's steps that time DDP's and ZeRO-3's work
(WRAPPED_BUILDS × WRAPPED_PAIRS each, and ZeRO-3 again at micro-batch 2) take most of a
calibration (the four demo files took 2-14 minutes each on the quiet host, 2026-11-29); on
2026-11-28 afternoon the same host ran ~3.4x slower and a 2-rank calibration at
micro-batch 16 ran past the 600 s allowed until then, losing the whole measurement."""


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
                "ddp_tensor", "ddp_passes"):
        out[key] = statistics.median(r[key] for r in results)
    return out


def physical_memory_bytes() -> float:
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return float(pages * page)


def collective_overlap(cores: int, ranks: int) -> float:
    """``dp_overlap`` for `ranks` ranks on `cores` CPU cores (0: a device each, whose
    collectives run on their own stream beside the kernels: 1). With a core or more per rank,
    each core runs a rank's compute thread and, while a collective is in flight, gloo's
    thread beside it: 2·ranks runnable threads on `cores` cores, each getting cores/(2·ranks)
    of one (at most all of it), which is the share of the compute's seconds a collective in
    flight progresses by; with fewer cores than ranks, 0 (every core is busy with some rank's
    compute, and the planner counts all the work over the cores:
    ``cost.shared_cpu_bound``)."""
    if cores <= 0:
        return 1.0
    if ranks_time_share(cores, ranks):
        return 0.0
    return min(1.0, cores / (2 * ranks))


def machine_shape(device: str) -> tuple[int, float, int]:
    """(cores the ranks share, memory bytes per rank, ranks per node) of this machine for
    ranks on `device`: on the CPU every core, the RAM divided among them, and LOCAL_RANKS; on
    GPUs no cores to share (0: one device per rank), one GPU's memory, and the GPU count."""
    if device == "cuda":
        return (0, float(torch.cuda.get_device_properties(0).total_memory),
                torch.cuda.device_count())
    cores = os.cpu_count() or 1
    return cores, physical_memory_bytes() / cores, LOCAL_RANKS


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
        gpus_per_node=per_node, cores=cores, intra_node_alpha_us=alpha * 1e6,
        inter_node_alpha_us=alpha * 1e6, p2p_alpha_us=p2p_alpha * 1e6,
        p2p_gbs=1.0 / p2p_beta / 1e9,
        link_efficiency=1.0, gather_efficiency=r["gather_efficiency"],
        op_overhead_us=overhead * 1e6, optimizer_tensor_us=r["optimizer"] * 1e6,
        zero_unit_us=r["zero_unit"] * 1e6, zero_unit_passes=r["zero_passes"],
        ddp_tensor_us=r["ddp_tensor"] * 1e6, ddp_copy_passes=r["ddp_passes"],
        elementwise_passes=passes, jitter_fixed_us=r["jitter_fixed"] * 1e6,
        jitter_rate=r["jitter_rate"],
        dp_overlap=collective_overlap(cores, ranks), calibrated_micro_batch=micro_batch,
        source=f"tessera plan calibrate: {spec.name} shapes, b={micro_batch}, s={seq}, "
               f"1 thread per rank, {ranks} ranks measuring at once, fp32, {device}, {backend}, "
               f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load:.1f} at start")
    if r["zero_waits"] > 0 and hw.dp_overlap > 0:  # measured where each rank has a core
        hw = dataclasses.replace(hw, dp_overlap=in_step_overlap(
            hw, spec, seq, min(micro_batch, SHARE_MICRO_BATCH), ranks, r["zero_waits"]))
    return hw


SHARE_MICRO_BATCH = 2
"""The micro-batch of the ZeRO-3 steps whose waits :func:`in_step_overlap` reads
``dp_overlap`` from (the calibrated one where smaller). The share is a rate of gloo's thread
beside the step's compute, but only a step whose collectives do not hide whole shows it: at
micro-batch 16 here (demo shapes, dp 2) the planner's waits fall from 17-25 ms at a share of
0 to their floor (the first gather and the straggler, 4.8-6.9 ms) by 0.1, so 1.4-1.8 ms of
waits above that floor, the floor's own error, read as a share of 0.05-0.08 against 0.17 at
micro-batch 2 in the same runs; the twenty-ninth to thirty-first runs of docs/planner.md."""


def in_step_overlap(hw: Hardware, spec: ModelSpec, seq: int, micro_batch: int, ranks: int,
                    waits: float) -> float:
    """``dp_overlap`` as the ZeRO-3 step measured it: the share of a second of compute that a
    collective progresses by inside the step, the one at which the planner's waits for
    ZeRO-3 over `ranks` ranks at these shapes (up to WRAPPED_LAYERS layers, `micro_batch` ×
    `seq` tokens: what :func:`zero_step_passes` ran) equal the `waits` its steps measured
    (seconds per micro-batch, the ranks' mean: their exposed gathers and reduce-scatters and
    the straggler), found by bisection between 0 and `hw.dp_overlap` (the share beside plain
    compute, :func:`collective_overlap`). Beside a matmul loop gloo's thread progresses at
    about that share; inside the step, with the gathered buffers allocated and filled and the
    reductions queued behind the gathers, at a third to a fifth of it at micro-batch 2 here
    (docs/planner.md, Inside the step a collective runs slower). The planner's waits fall as
    the share grows: where they exceed `waits` even at the full share, the full share; where
    they fall short even at 0, 0."""
    from tessera.planner.cost import layout_costs
    from tessera.planner.workload import Layout, Workload

    model = dataclasses.replace(spec, layers=min(spec.layers, WRAPPED_LAYERS))
    layout = Layout(dp=ranks, zero_stage=3, micro_batch=micro_batch)

    def planner_waits(share: float) -> float:
        # ZeRO-3's own work (zero_unit_*) off: what is left of the chunks' ZeRO times is the
        # exposed collectives and the straggler
        h = dataclasses.replace(hw, dp_overlap=share, zero_unit_us=0.0, zero_unit_passes=0.0)
        w = Workload(model=model, hardware=h, gpus=ranks, global_batch=ranks * micro_batch,
                     seq_len=seq, precision="fp32", scatter_gather=False)
        chunks = layout_costs(w, layout).chunks
        return sum(c.zero_forward + c.zero_backward for c in chunks)

    low, high = 0.0, hw.dp_overlap
    if planner_waits(high) >= waits:
        return high
    if planner_waits(low) <= waits:
        return low
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if planner_waits(mid) > waits else (low, mid)
    return (low + high) / 2
