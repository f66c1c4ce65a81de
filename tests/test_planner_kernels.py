"""The planner's kernel counts and launch cost (tessera.planner.kernels), its compiled setting
and the chunked loss's logits.

- The eager block's kernel count, derived part by part from the code, equals the ATen ops
  that compute (views excluded) dispatched by tessera's Block forward and backward, counted
  once on CPU, in fp32 and bf16; so does an MoE block's (router, dispatch, experts, combine,
  auxiliary losses), for several MoE settings and at ep 2.
- With the catalog's launch cost the demo model's predicted step on an H100 is of the order of
  the 19 ms measured (benchmarks/results/gpu_h100.txt: "step time measured 19 ms"); without
  it the planner priced the step as a few ms of device time. A device-bound model (the
  133M-parameter bench_gpu_step model) is not moved by it beyond its tiny head's launches.
- The step's kernels outside the blocks (zero_grad, the global norm, clipping, AdamW), counted
  from the code on the tensors the optimizer steps (flat units or parameters), equal the ops
  tessera's step dispatches; on a GPU their launches floor the optimizer's time.
- The data-parallel wrapper's kernels inside the backward (flat units' accumulation and
  division, ZeRO-2's flattening, DataParallel's bucket copies) equal the ops a CPU run
  dispatches beyond the blocks', and floor the launch-bound demo's backward.
- The parameter server's kernels (its messages packed and unpacked, the server's sum, reply and
  serving) equal the ops each rank dispatches, and their launches are priced with its exchange.
- kernels='compiled' launches fewer kernels and prices fused memory-bound passes.
- train.loss_chunk_tokens: the last chunk holds one chunk's logits, not the micro-batch's.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config_io import make_config
from tessera.planner import kernels as K
from tessera.planner.compute import block_costs
from tessera.planner.estimate import estimate
from tessera.planner.hardware import (
    LAUNCH_US_GPU,
    hardware_from_dict,
    load_hardware,
    replace,
)
from tessera.planner.models import from_model_config
from tessera.report import planner_workload

MEASURED_DEMO_H100_S = 0.019
"""benchmarks/results/gpu_h100.txt: tessera train --preset demo --nproc 1 --precision bf16 on
an H100, "step time measured 19 ms"."""


class ComputeOps(TorchDispatchMode):
    """Counts dispatched ATen ops that compute (not views, detach or reshape aliases)."""

    ALIASES = ("_unsafe_view", "detach", "t")

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in self.ALIASES:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_block_count_matches_dispatched_ops(dtype):
    from tessera.model import Block, rope_tables

    cfg = make_config("tiny")
    spec = from_model_config("tiny", cfg.model, cfg.data.seq_len)
    block = Block(cfg.model).to(dtype)
    seq = cfg.data.seq_len
    cos, sin = rope_tables(cfg.model.head_dim, seq, cfg.model.rope_theta)
    x = torch.randn(2, seq, cfg.model.d_model, dtype=dtype, requires_grad=True)
    with ComputeOps() as forward:
        y = block(x, cos, sin)
    grad = torch.ones_like(y)
    with ComputeOps() as backward:
        y.backward(grad)
    want = K.eager_block(spec, "fp32" if dtype == torch.float32 else "bf16")
    assert (forward.total, backward.total) == (want.forward, want.backward), (
        forward.ops, backward.ops)


MOE_BLOCKS = (
    (dict(moe_experts=4, moe_top_k=1), "fp32"),
    (dict(moe_experts=8, moe_top_k=2, moe_shared_expert=True), "bf16"),
    (dict(moe_experts=6, moe_top_k=2, moe_capacity_factor=2.0, moe_router_bias_rate=0.01,
          moe_aux_loss_coef=0.0), "fp32"),
)
"""(MoE settings, precision): top-1 and top-2, with and without a shared expert, 4, 6 and 8
experts, the auxiliary losses attached or not, capacity and the router bias, fp32 and bf16: a
count that missed a factor of the experts, counted the top-k renormalization, shared expert,
auxiliary losses' backward, capacity or casts where they are not run (or not where they are)
fails one of them."""
ALLOCATIONS = ("new_empty", "empty_like")
"""Not kernels (module doc of ``planner.kernels``): the all-to-alls' output buffers under ep."""


def _moe_block_ops(settings: dict, precision: str, ep: int = 1) -> tuple[int, int]:
    """The ops an MoE block of the tiny model dispatches forward and backward (less
    allocations and collectives), its experts split over the `ep` ranks of the world group;
    every expert on the rank receives tokens (checked)."""
    import torch.distributed as dist

    from tessera.model import Block, rope_tables
    from tessera.parallel.expert_parallel import EPContext, apply_expert_parallel

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    cfg = make_config("tiny", model=settings)
    torch.manual_seed(0)
    block = Block(cfg.model)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if ep > 1:
        apply_expert_parallel(block, EPContext(dist.group.WORLD))
    block = block.to(dtype)
    rows: list[list[int]] = []
    block.feed_forward.experts.register_forward_pre_hook(lambda m, args: rows.append(args[1]))
    seq = cfg.data.seq_len
    cos, sin = rope_tables(cfg.model.head_dim, seq, cfg.model.rope_theta)
    x = torch.randn(2, seq, cfg.model.d_model, dtype=dtype, requires_grad=True)
    with StepOps() as forward:
        y = block(x, cos, sin)
    grad = torch.ones_like(y)
    with StepOps() as backward:
        y.backward(grad)
    assert len(rows) == 1 and len(rows[0]) == cfg.model.moe_experts // ep and min(rows[0]) > 0
    return tuple(ops.total - sum(ops.ops[n] for n in ALLOCATIONS)
                 for ops in (forward, backward))


def _moe_spec(settings: dict, ep: int = 1):
    from tessera.planner.moe import MoESpec, active_spec

    cfg = make_config("tiny", model=settings)
    spec = from_model_config("tiny", cfg.model, cfg.data.seq_len)
    return active_spec(spec, MoESpec.from_model_config(cfg.model), 1, ep)


@pytest.mark.parametrize("settings,precision", MOE_BLOCKS)
def test_eager_moe_block_count_matches_dispatched_ops(settings, precision):
    """An MoE block's kernels (``kernels.eager_moe_block`` of the planner's active model, as
    ``planner.moe.active_spec`` builds it) equal the ops tessera's Block with an MoE
    feed-forward dispatches, forward and backward."""
    want = K.eager_moe_block(_moe_spec(settings), precision)
    assert _moe_block_ops(settings, precision) == (want.forward, want.backward)
    dense = K.eager_block(_moe_spec(settings), precision)
    assert want.forward > dense.forward and want.backward > dense.backward


def _moe_blocks_ops_at_ep_2() -> list[tuple[int, int]]:
    return [_moe_block_ops(settings, precision, ep=2) for settings, precision in MOE_BLOCKS[:2]]


@pytest.mark.multiprocess
def test_eager_moe_block_count_matches_dispatched_ops_under_expert_parallelism():
    """At ep 2 each rank runs E/2 experts and the all-to-all dispatcher's per-expert, per-source
    offsets: its ops (less the collectives and their buffers) equal the count with ep=2, which
    differs from the count at ep 1."""
    from tessera.testing import run_ranks

    for got in run_ranks(_moe_blocks_ops_at_ep_2, 2):
        for (settings, precision), ops in zip(MOE_BLOCKS[:2], got, strict=True):
            want = K.eager_moe_block(_moe_spec(settings, ep=2), precision)
            assert ops == (want.forward, want.backward), settings
            assert want != K.eager_moe_block(_moe_spec(settings), precision)


def test_compiled_block_launches_fewer_kernels():
    spec = from_model_config("demo", make_config("demo").model, 128)
    eager, compiled = K.eager_block(spec, "bf16"), K.compiled_block(spec)
    # 7 GEMMs + attention + 5 fused runs forward; backward 2 per GEMM, attention, 5 runs and
    # the two norm weights' reductions
    assert (compiled.forward, compiled.backward) == (13, 22)
    assert (eager.forward, eager.backward) == (46, 79)


def _demo(precision: str = "bf16", **train):
    return make_config("demo", parallel=dict(dp=1), train=dict(precision=precision, **train))


def _step(cfg, hw, kernels: str | None = None) -> float:
    w, layout = planner_workload(cfg, 1, hw)
    if kernels:
        w = dataclasses.replace(w, kernels=kernels)
    return estimate(w, layout).step_time


def test_launch_cost_prices_the_demo_step_on_an_h100():
    h100 = load_hardware("H100")
    assert h100.launch_us == LAUNCH_US_GPU
    with_launches = _step(_demo(), h100)
    without = _step(_demo(), replace(h100, launch_us=0.0))
    print(f"demo on H100: predicted {with_launches * 1e3:.2f} ms with launches, "
          f"{without * 1e3:.2f} ms without; measured {MEASURED_DEMO_H100_S * 1e3:.0f} ms")
    assert 0.5 <= with_launches / MEASURED_DEMO_H100_S <= 2.0
    assert without < 0.25 * MEASURED_DEMO_H100_S  # launches are what the step was missing
    # the floor is the block kernels' launches: 4 blocks, one micro-batch
    block = K.eager_block(from_model_config("demo", _demo().model, 128), "bf16")
    blocks = 4 * (block.forward + block.backward)
    assert with_launches >= blocks * LAUNCH_US_GPU * 1e-6


def test_launch_cost_leaves_a_device_bound_block_alone():
    """bench_gpu_step's model (d 1024, 12 layers, 16k tokens): each block's device time is
    above its launches, so the blocks cost the same; only the tiny head (vocabulary 256) is
    launch-bound. The optimizer's step (31 kernels over 14 flat units in 2 update groups of
    fused AdamW: 0.6 ms of launches) stays below its 1 ms of a fused update's traffic; with a
    kernel per unit for zeroing, clipping and publishing (70) its launches were above it."""
    from tessera.planner.state import rank_step_kernels

    cfg = make_config("tiny", model=dict(d_model=1024, n_layers=12, n_heads=16, n_kv_heads=4,
                                         max_seq_len=1024),
                      data=dict(seq_len=1024), parallel=dict(dp=1),
                      train=dict(micro_batch_size=16, grad_accum=1, precision="bf16"))
    h200 = load_hardware("H200")
    w, layout = planner_workload(cfg, 1, h200)
    free = dataclasses.replace(w, hardware=replace(h200, launch_us=0.0))
    assert block_costs(w, 1, 1, 16, False, "none") == block_costs(free, 1, 1, 16, False, "none")
    with_launches, without = _step(cfg, h200), _step(cfg, replace(h200, launch_us=0.0))
    optimizer = estimate(*planner_workload(cfg, 1, h200)).costs.optimizer_time
    traffic = estimate(free, layout).costs.optimizer_time
    kernels = rank_step_kernels(w, layout, 0, 0)
    assert kernels == 31 and kernels * LAUNCH_US_GPU * 1e-6 < traffic
    assert optimizer == pytest.approx(traffic)
    assert without <= with_launches <= 1.02 * without


def test_compiled_kernels_price_fewer_launches_and_fused_passes():
    h100 = load_hardware("H100")
    eager, compiled = _step(_demo(), h100), _step(_demo(), h100, "compiled")
    assert compiled < 0.5 * eager  # the demo step is launch-bound: 13 + 22 kernels, not 125
    w, _ = planner_workload(_demo(), 1, h100)
    assert w.elementwise_passes == h100.eager_elementwise_passes
    fused = dataclasses.replace(w, kernels="compiled")
    assert fused.tessera_engine and fused.elementwise_passes == h100.elementwise_passes == 2.0
    timed = dataclasses.replace(fused, hardware=replace(h100, compiled_elementwise_passes=3.0))
    assert timed.elementwise_passes == 3.0


def test_train_compile_plans_compiled_kernels():
    cfg = _demo()
    object.__setattr__(cfg.train, "compile", True)  # the field helper compile adds
    w, _ = planner_workload(cfg, 1, "H100")
    assert w.kernels == "compiled"
    assert planner_workload(_demo(), 1, "H100")[0].kernels == "tessera"
    # the training summary's line says so, and prices the compiled step
    from tessera.report import planner_prediction

    compiled_s, label = planner_prediction(cfg, 1, torch.device("cpu"))
    eager_s, eager_label = planner_prediction(_demo(), 1, torch.device("cpu"))
    assert "compiled kernels" in label and "compiled" not in eager_label
    assert compiled_s < eager_s


def test_chunked_loss_holds_one_chunks_logits():
    cfg = make_config("llama-1b", parallel=dict(dp=1),
                      train=dict(micro_batch_size=2, grad_accum=1, precision="bf16"))
    chunked_cfg = make_config("llama-1b", parallel=dict(dp=1),
                              train=dict(micro_batch_size=2, grad_accum=1, precision="bf16",
                                         loss_chunk_tokens=512))
    h200 = load_hardware("H200")
    whole = estimate(*planner_workload(cfg, 1, h200))
    chunked = estimate(*planner_workload(chunked_cfg, 1, h200))
    tokens, vocab = 2 * 2048, 128256
    # fp32 logits of 4096 tokens -> of 512 tokens, plus a 4-byte log-sum-exp per token
    saved = 4 * vocab * (tokens - 512) - 4 * tokens
    freed = whole.costs.chunks[-1].act_bytes - chunked.costs.chunks[-1].act_bytes
    assert freed == pytest.approx(saved)
    assert chunked.memory.total == pytest.approx(whole.memory.total - saved)
    # the head's GEMM again in backward
    assert chunked.step_time > whole.step_time


def test_hardware_file_keeps_launch_and_compiled_passes():
    hw = replace(load_hardware("H100"), launch_us=7.5, compiled_elementwise_passes=2.5)
    again = hardware_from_dict(hw.to_dict())
    assert (again.launch_us, again.compiled_elementwise_passes) == (7.5, 2.5)
    with pytest.raises(Exception, match="launch_us"):
        replace(hw, launch_us=-1.0)


def test_calibrate_measures_launches_and_the_compiled_rate(monkeypatch):
    """rates.launch_cost: a tiny block's seconds per kernel, positive and well under a
    millisecond; rates.compiled_passes: 2 passes at the compiled kernel's rate over the
    streaming one (here the eager function stands in for the compiled one), None where
    torch.compile fails."""
    from tessera.planner.local import rates

    assert 0 < rates.launch_cost(calls=2) < 1e-3
    spec = from_model_config("tiny", make_config("tiny").model, 32)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    bw = rates.memory_bandwidth(spec, 32, 8)
    assert 0.5 < rates.compiled_passes(spec, 32, 8, bw) < 100

    def broken(fn, **kw):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch, "compile", broken)
    assert rates.compiled_passes(spec, 32, 8, bw) is None
    # the rate is 2 passes at the streaming bandwidth when the fused run streams at it
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(rates, "typical_time", lambda fn, repeats=9: 4 * 256 * 64 * 4 / 1e9)
    assert rates.compiled_passes(spec, 32, 8, 1e9) == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------------
# The step's kernels outside the blocks: zero_grad, the global norm, clipping and AdamW.

STEP_LAYOUTS = (("fp32", 0, 2), ("fp32", 0, 3), ("bf16", 0, 2), ("bf16", 0, 3), ("fp32", 1, 2),
                ("bf16", 3, 3))
"""(precision, ZeRO stage, layers): per-parameter AdamW (fp32 at stage 0) and flat units (bf16,
or any ZeRO stage), each at two depths, so a count that does not grow with the tensors the
optimizer steps, or counts parameters where it steps units, fails."""


class StepOps(ComputeOps):
    """ComputeOps less the profiler's record_function markers and the collectives (priced as
    communication)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" or name.startswith("_record_function"):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _step_config(precision: str, zero: int, layers: int):
    return make_config("tiny", model=dict(n_layers=layers), parallel=dict(dp=1, zero_stage=zero),
                       train=dict(micro_batch_size=2, grad_accum=1, precision=precision))


def _step_ops() -> list[int]:
    """On one gloo rank, for each of STEP_LAYOUTS: the ops of a step's zero_grad, norm with
    clipping (a max norm every step exceeds) and optimizer step, after a warm-up step, with
    AdamW as a GPU runs it: fused, per parameter and on flat units (``ShardedAdamW`` asks the
    same ``optim.adamw_implementation``, which says fused on CUDA)."""
    import tessera.optim
    from tessera.step import build_executor
    from tessera.topology import Topology

    tessera.optim.adamw_implementation = lambda device_types: {"fused": True}
    counts = []
    for precision, zero, layers in STEP_LAYOUTS:
        cfg = _step_config(precision, zero, layers)
        ex = build_executor(cfg, Topology.solo(), torch.device("cpu"))
        opt = ex.optimizer(cfg.train)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        for _ in range(2):
            with StepOps() as ops:
                opt.zero_grad(set_to_none=True)
            ex.forward_backward(batch)
            with ops:
                ex.clip_grad_norm_(1e-6)
                opt.step()
        counts.append(ops.total)
    return counts


@pytest.mark.multiprocess
def test_step_kernels_match_dispatched_ops():
    """The planner's count of a rank's step kernels (``state.rank_step_kernels``: flat units
    from the planner's own unit layout, or parameter tensors) equals the ops tessera's step
    dispatches outside the forward and backward."""
    from tessera.planner.cost import layout_costs
    from tessera.planner.state import rank_step_kernels
    from tessera.testing import run_ranks

    dispatched = run_ranks(_step_ops, 1)[0]
    for (precision, zero, layers), got in zip(STEP_LAYOUTS, dispatched, strict=True):
        w, layout = planner_workload(_step_config(precision, zero, layers), 1, "H100")
        tensors = sum(ch.tensors for ch in layout_costs(w, layout).chunks)
        assert rank_step_kernels(w, layout, 0, tensors) == got, (precision, zero, layers)
    # per parameter: the clipping is one multi-tensor op whatever the tensors (9 a block);
    # flat: one unit per block (+ embedding and head), in bf16 one kernel each (its gradient's
    # cast up); zeroing, clipping, the masters' copy and the update's ops once whatever the units
    assert dispatched[1] - dispatched[0] == 0
    assert dispatched[3] - dispatched[2] == 1


def test_optimizer_launches_price_the_step_on_a_gpu_only_where_not_calibrated():
    """On a GPU the step's kernels after the norm's synchronizing read are issued one by one:
    the optimizer's time is at least their launches (the demo's: launch-bound). A calibrated
    optimizer_tensor_us already holds the loops' launches: nothing is added to it."""
    from tessera.planner.cost import layout_costs
    from tessera.planner.state import rank_step_kernels

    h100 = load_hardware("H100")
    w, layout = planner_workload(_demo(), 1, h100)
    costs = layout_costs(w, layout)
    tensors = sum(ch.tensors for ch in costs.chunks)
    kernels = rank_step_kernels(w, layout, 0, tensors)
    # bf16: 6 units (embedding, 4 blocks, head) of one gradient cast each, zeroing, clipping
    # and the masters' copy, the fused update (step counts' add, _fused_adamw_) and the
    # decay's multiply, the norm
    assert kernels == 6 + 3 + 2 + 1 + 8
    assert costs.optimizer_time == pytest.approx(kernels * LAUNCH_US_GPU * 1e-6)
    free = dataclasses.replace(w, hardware=replace(h100, launch_us=0.0))
    assert layout_costs(free, layout).optimizer_time < 0.1 * costs.optimizer_time
    calibrated = dataclasses.replace(w, hardware=replace(h100, optimizer_tensor_us=5.0))
    assert layout_costs(calibrated, layout).optimizer_time == pytest.approx(
        layout_costs(free, layout).optimizer_time + tensors * 5e-6)


def test_large_units_are_updated_in_groups_and_each_group_is_counted():
    """llama-1b in bf16 (flat units at stage 0): the embedding and every block exceed the
    update group's cap (``tessera.parallel.update_batches``), so each unit is a group of its
    own and launches the update's multi-tensor ops itself; at dp 8 under ZeRO-1 each rank owns
    an eighth and the units share groups. A count that kept one group whatever the sizes fails
    here."""
    from tessera.parallel.update_batches import UPDATE_BATCH_ELEMENTS
    from tessera.planner.engine import rank_units
    from tessera.planner.state import rank_step_kernels

    for dp, zero in ((1, 0), (8, 1)):
        cfg = make_config("llama-1b", parallel=dict(dp=dp, zero_stage=zero),
                          train=dict(precision="bf16", micro_batch_size=1, grad_accum=1))
        w, layout = planner_workload(cfg, dp, "H100")
        units = rank_units(w, layout, 0)
        owned = [-(-n // dp) * (1 if zero else dp) for n, _ in units]
        groups = 0
        total = UPDATE_BATCH_ELEMENTS + 1
        for n in owned:  # consecutive units within the cap share a group
            total = total + n if total + n <= UPDATE_BATCH_ELEMENTS else n
            groups += total == n
        if dp == 1:
            assert groups == len(units) and min(owned) > UPDATE_BATCH_ELEMENTS // 2
        else:
            assert 1 < groups < len(units)
        decayed = groups  # every group here holds a matrix
        assert rank_step_kernels(w, layout, 0, 0) == (
            K.FLAT_STEP_OPS + len(units) * K.BF16_UNIT_CASTS + K.BF16_PUBLISH_OPS
            + groups * K.FLAT_ADAMW_OPS + decayed * K.FLAT_DECAY_OPS + K.NORM_OPS[True]), (
            dp, zero)


# ---------------------------------------------------------------------------------------------
# The data-parallel wrappers' kernels inside the backward, outside the blocks.

HOOK_LAYOUTS = (("bf16", 0, 1), ("bf16", 2, 1), ("fp32", 0, 1), ("fp32", 0, 2))
"""(precision, ZeRO stage, dp): flat units at stage 0 (in-place accumulation into the unit
buffers, per-unit division) and 2 (flattening, shard division or accumulation); per parameter
at dp 1 (world 1 installs no DataParallel hooks: accumulation only from the second
micro-batch) and DataParallel at dp 2 (each fresh gradient copied into its bucket slot)."""
NOT_KERNELS = ("empty_like", "copy_")
"""Not counted as hook kernels: an allocation (no kernel), and at dp 1 the gloo reduce-scatter's
own copy (at dp > 1 the collective, priced as communication). At dp 2, copy_ is counted: there
it is DataParallel's copy into the bucket (nothing else in these steps dispatches copy_)."""


def _hook_config(precision: str, zero: int, dp: int, layers: int, mb: int):
    return make_config("tiny", model=dict(n_layers=layers),
                       parallel=dict(dp=dp, zero_stage=zero),
                       train=dict(micro_batch_size=1, grad_accum=mb, precision=precision,
                                  noise_scale=False))


def _backward_ops(dp: int) -> list[int]:
    """On a gloo rank of `dp`, for each HOOK_LAYOUTS layout of that dp at 2 and 3 layers and 1
    and 2 micro-batches: the ops of a step's forward_backward (after a warm-up step), less
    NOT_KERNELS at dp 1."""
    from tessera.step import build_executor
    from tessera.topology import Topology

    counts = []
    for precision, zero, layout_dp in HOOK_LAYOUTS:
        if layout_dp != dp:
            continue
        for layers in (2, 3):
            for mb in (1, 2):
                cfg = _hook_config(precision, zero, dp, layers, mb)
                ex = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
                opt = ex.optimizer(cfg.train)
                tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.data.seq_len + 1))
                batch = [(tokens[:, :-1], tokens[:, 1:])] * mb
                for _ in range(2):
                    opt.zero_grad(set_to_none=True)
                    with StepOps() as ops:
                        ex.forward_backward(batch)
                    opt.step()
                skipped = sum(ops.ops[n] for n in NOT_KERNELS) if dp == 1 else 0
                counts.append(ops.total - skipped)
    return counts


@pytest.mark.multiprocess
@pytest.mark.slow
def test_backward_hook_kernels_match_dispatched_ops():
    """A block more adds, per micro-batch, its eager kernels plus what ``backward_hook_kernels``
    counts for its unit (9 tensors): each difference of the dispatched ops between 3 and 2
    layers, at 1 and 2 micro-batches, equals the planner's (one DataParallel bucket at either
    depth: the per-bucket kernels cancel). A count that missed the per-tensor accumulation, the
    per-unit division or DataParallel's copies, or counted stage 2's ops once a step instead of
    per micro-batch, fails."""
    from tessera.planner.engine import flat_units, rank_units
    from tessera.testing import run_ranks

    dispatched = iter(run_ranks(_backward_ops, 1, args=(1,))[0]
                      + run_ranks(_backward_ops, 2, args=(2,))[0])
    for precision, zero, dp in HOOK_LAYOUTS:
        got = {(layers, mb): next(dispatched) for layers in (2, 3) for mb in (1, 2)}
        want = {}
        for layers in (2, 3):
            for mb in (1, 2):
                w, layout = planner_workload(_hook_config(precision, zero, dp, layers, mb), dp,
                                             "H100")
                flat = flat_units(precision, zero, layout.dp_mode)
                assert flat == (precision == "bf16")
                want[layers, mb] = K.backward_hook_kernels(
                    list(rank_units(w, layout, 0)), mb, flat=flat, stage=zero, dp=dp,
                    ddp=not flat and dp > 1)
        spec = from_model_config("tiny", _hook_config(precision, zero, dp, 3, 1).model, 32)
        block = K.eager_block(spec, precision)
        for mb in (1, 2):
            model = mb * (block.forward + block.backward)
            assert got[3, mb] - got[2, mb] - model == want[3, mb] - want[2, mb], (
                precision, zero, dp, mb, got, want)


def test_hook_kernels_floor_the_launch_bound_demo_backward(monkeypatch):
    """The demo (bf16 flat units at stage 0, one micro-batch, launch-bound on an H100): its
    step costs the hook kernels' launches more than with none (within 1e-4: one stretch they
    join holds a few ns of device time above its launches; every other is launch-bound): one
    in-place add per parameter tensor, one division per unit."""
    from tessera.planner import compute, cost
    from tessera.planner.engine import rank_units

    h100 = load_hardware("H100")
    w, layout = planner_workload(_demo(), 1, h100)
    units = list(rank_units(w, layout, 0))
    hooks = K.backward_hook_kernels(units, 1, flat=True, stage=0, dp=1)
    assert hooks == sum(k for _, k in units) + len(units) == 39 + 6

    def fresh() -> float:
        for cached in (cost.chunk_costs, compute.compute_chunks, compute.block_costs):
            cached.cache_clear()
        return estimate(w, layout).step_time

    with_hooks = fresh()
    monkeypatch.setattr(compute, "hook_kernels_per_microbatch", lambda units, hooks: 0.0)
    # rel 1e-4: one of the demo's stretches has a few ns of device time above its launches,
    # so there the floor moves the stretch by slightly less than the added launches
    assert with_hooks - fresh() == pytest.approx(hooks * LAUNCH_US_GPU * 1e-6, rel=1e-4)
    monkeypatch.undo()
    fresh()


# ---------------------------------------------------------------------------------------------
# The parameter server's kernels: its messages packed and unpacked, the server's sum and reply.

PS_LAYERS = (2, 3)
"""Depths (9 parameter tensors a block): a count that does not grow with the tensors fails."""


def _ps_config(dp: int, layers: int, mode: str):
    return make_config("tiny", model=dict(n_layers=layers), parallel=dict(dp=dp, dp_mode=mode),
                       train=dict(micro_batch_size=1, grad_accum=1, precision="fp32",
                                  noise_scale=False))


def _counted(method, into: StepOps):
    """`method`, its dispatched ops counted in `into`."""
    def run(*args, **kwargs):
        with into:
            return method(*args, **kwargs)
    return run


def _ps_step_ops(cfg) -> tuple[int, int, int]:
    """This rank's ops in a step's exchange, the server's reply and its serving less the updates
    it applies (their clipping and AdamW: the optimizer's step), after a warm-up step; the
    server's packing of its own push (0 on a worker); the parameter tensors."""
    from tessera.step import build_executor
    from tessera.topology import Topology

    ex = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
    opt = ex.optimizer(cfg.train)
    sync, ps = ex.model.server, ex.model.server.ps
    ops, applied, packed = StepOps(), StepOps(), StepOps()
    sync.exchange = _counted(sync.exchange, ops)
    ps.send_parameters = _counted(ps.send_parameters, ops)
    ps._pack_push = _counted(ps._pack_push, packed)
    serve = ps.serve
    # nested modes: the outer one sees the ops the inner one passes on
    ps.serve = _counted(lambda apply, norm: serve(_counted(apply, applied), norm), ops)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.data.seq_len + 1))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    for _ in range(2):
        for each in (ops, applied, packed):
            each.ops.clear()
        opt.zero_grad(set_to_none=True)
        ex.forward_backward(batch)
        ex.clip_grad_norm_(1e-6)
        opt.step()
    return ops.total - applied.total, packed.total if ps.is_server else 0, len(ps.params)


def _ps_ops(dp: int) -> list[tuple[int, int, int]]:
    """On a gloo rank of a parameter server's group of `dp`: :func:`_ps_step_ops` for 'ps' and
    'ps-async' at each of PS_LAYERS."""
    return [_ps_step_ops(_ps_config(dp, layers, mode))
            for mode in ("ps", "ps-async") for layers in PS_LAYERS]


@pytest.mark.multiprocess
def test_parameter_server_kernels_match_dispatched_ops():
    """``parameter_server_kernels`` equals the ops each rank of a parameter server (synchronous
    and asynchronous, 2 and 3 ranks, at two depths) dispatches in its exchange and the server's
    reply and serving, outside the server's optimizer steps; the synchronous step's critical
    path (``parameter_server_step_kernels``) is a worker's ops and the server's, less the
    server's packing of its own push (done while the workers pack theirs). A count not
    multiplied by the tensors, or by the dp − 1 pushes the server sums or serves, fails."""
    from tessera.testing import run_ranks

    for dp in (2, 3):
        ranks = run_ranks(_ps_ops, dp, args=(dp,))
        cases = [(mode, layers) for mode in ("ps", "ps-async") for layers in PS_LAYERS]
        for i, (mode, layers) in enumerate(cases):
            asynchronous = mode == "ps-async"
            tensors = ranks[0][i][2]
            assert tensors == 9 * layers + 3  # 9 a block, embedding, final norm, head
            for rank, counts in enumerate(ranks):
                got = counts[i][0]
                assert got == K.parameter_server_kernels(
                    tensors, dp, server=rank == 0, asynchronous=asynchronous), (
                    dp, mode, layers, rank, got)
            if not asynchronous:
                server, own_push = ranks[0][i][:2]
                assert K.parameter_server_step_kernels(tensors, dp) == (
                    ranks[1][i][0] + server - own_push)


def test_parameter_server_and_ddp_copies_are_priced_where_they_run():
    """The demo in fp32 at dp 2 on an H100 (launch-bound): a synchronous parameter server's step
    waits, after the backward, for the launches of ``parameter_server_step_kernels`` (131 for
    its 39 tensors); an asynchronous one for the longer of the server's serving (an exchange,
    an update, PS_SERVE_OPS launches) and a worker's loop (its norm, push and pull's kernels,
    then its push served), here the worker's; and DataParallel's copy of each fresh gradient
    into its bucket (one per tensor) floors the all-reduce layout's backward, where a
    parameter server's backward has no hooks. A count left out of either (DataParallel's copies
    unfloored, the server's or a worker's packing unpriced) fails."""
    from tessera.planner import cost
    from tessera.planner.comm import p2p_link
    from tessera.planner.local.terms import rank_skew

    h100 = load_hardware("H100")
    layouts = {}
    for mode in ("allreduce", "ps", "ps-async"):
        cfg = make_config("demo", parallel=dict(dp=2, dp_mode=mode),
                          train=dict(precision="fp32", micro_batch_size=8, grad_accum=1))
        layouts[mode] = planner_workload(cfg, 2, h100)
    costs = {mode: cost.layout_costs(*layouts[mode]) for mode in layouts}
    tensors = sum(ch.tensors for ch in costs["ps"].chunks)
    assert tensors == 39
    launch = LAUNCH_US_GPU * 1e-6
    sync = K.parameter_server_step_kernels(tensors, 2)
    assert sync == 3 * 39 + 1 + 9 + 2
    # the server's one exchange (S + P + 2 values pushed, S + 3 pulled, fp32); no straggler on a
    # catalog GPU: the synchronous time is the exchange and the launches
    link = p2p_link(h100, 2)
    S = sum(ch.params for ch in costs["ps"].chunks)
    exchange = 2 * link.alpha + 4 * ((S + tensors + 2) + (S + 3)) * link.beta
    assert rank_skew(layouts["ps"][0], 2, 1.0) == 0.0
    # rel 1e-12: the same few terms summed in another order (float rounding, ~1e-16 each)
    assert costs["ps"].ps_time == pytest.approx(exchange + sync * launch, rel=1e-12)
    worker = K.parameter_server_kernels(tensors, 2, server=False, asynchronous=True)
    served = exchange + K.PS_SERVE_OPS * launch
    optimizer = costs["ps-async"].optimizer_time
    assert worker * launch > optimizer  # the worker's loop is the longer
    assert costs["ps-async"].ps_time == pytest.approx(worker * launch + served, rel=1e-12)
    # One micro-batch: the backward's hooks are DataParallel's copies alone. rel 1e-9: sums of
    # launch-bound stretches in float, each the same launches.
    backward = {mode: sum(ch.backward_compute for ch in costs[mode].chunks)
                for mode in ("allreduce", "ps")}
    assert backward["allreduce"] - backward["ps"] == pytest.approx(tensors * launch, rel=1e-9)
