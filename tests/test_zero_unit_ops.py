"""The step's per-tensor work as multi-tensor ops (``tessera.parallel.zero``'s
``zero_unit_grads``, ``scale_unit_grads``, ``publish_unit_parameters`` and
``ParallelModel.scale_grads``) against the per-tensor ops they replace, bit for bit on CPU:
the clipping multiplies every gradient the rank holds by the factor (and leaves them as they
are when the norm is below the maximum or the maximum is 0), the optimizer's step
leaves each unit's parameters equal to its master cast, zero_grad zeroes every unit's buffer
and marks it fresh at stages 2-3; one publish over several models all-gathers every one's units
at stages 1-2. The number of ops is pinned by
tests/test_planner_kernels.py::test_step_kernels_match_dispatched_ops."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config_io import make_config
from tessera.parallel.zero import publish_unit_parameters
from tessera.step import build_executor
from tessera.testing import run_ranks
from tessera.topology import Topology

SEQ = 16
UNCLIPPED = 1e6
"""Above any gradient norm here: the gradients stay as they are."""
CLIP_SHARE = 0.75
"""Each case clips to this share of its gradient norm: just below it, so a rule that clips
only well above the maximum is seen."""
CASES = (("bf16", dict(dp=2, zero_stage=2)), ("bf16", dict(dp=2, zero_stage=3)),
         ("fp32", dict(dp=2, zero_stage=1)), ("fp32", dict(dp=2, zero_stage=0)),
         ("bf16", dict(pp=2, schedule="interleaved", virtual_stages=2)))
"""(precision, parallel): flat units at stages 2, 3 (bf16) and 1 (fp32, masters aliasing the
parameters), per-parameter gradients (fp32 stage 0), and two ZeroModels on each rank (bf16
at stage 0, two pipeline chunks per rank)."""


def _cfg(precision: str, parallel: dict):
    return make_config(
        None, model=dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ),
        parallel=parallel, data=dict(seq_len=SEQ),
        train=dict(micro_batch_size=2, grad_accum=2, precision=precision))


def _grads(ex) -> list[torch.Tensor]:
    """Every gradient tensor the clipping scales on this rank."""
    if ex.model.sharded:
        return [u.grad for z in ex.model.zeros for u in z.units]
    return [p.grad for p in ex.model.parameters() if p.grad is not None]


def _unit_ops_rank() -> list[str]:
    """Per case, one step: mismatches against the per-tensor reference (empty: all equal)."""
    bad = []
    for precision, parallel in CASES:
        cfg = _cfg(precision, parallel)
        ex = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
        opt = ex.optimizer(cfg.train)
        name = f"{precision} {parallel}"
        if parallel.get("pp") and len(ex.model.zeros) != 2:
            bad.append(f"{name}: {len(ex.model.zeros)} ZeroModels on a rank, not 2")
        g = torch.Generator().manual_seed(ex.topo.rank)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 2, SEQ + 1), generator=g)
        opt.zero_grad(set_to_none=True)
        ex.forward_backward([(t[:, :-1], t[:, 1:]) for t in tokens])
        before = [grad.clone() for grad in _grads(ex)]
        norm = ex.clip_grad_norm_(UNCLIPPED)
        if ex.clip_grad_norm_(0.0) != norm:  # 0: only measured
            bad.append(f"{name}: the norm changed without a clipping")
        for i, (got, ref) in enumerate(zip(_grads(ex), before, strict=True)):
            if not torch.equal(got, ref):
                bad.append(f"{name}: gradient {i} scaled by max_norm 0 or above the norm")
        max_norm = CLIP_SHARE * norm
        if ex.clip_grad_norm_(max_norm) != norm:
            bad.append(f"{name}: the norm changed without a clipping")
        factor = max_norm / (norm + 1e-6)
        for i, (got, ref) in enumerate(zip(_grads(ex), before, strict=True)):
            if not torch.equal(got, ref.mul_(factor)):
                bad.append(f"{name}: gradient {i} not clipped as by its mul_")
        opt.step()
        for z in ex.model.zeros:
            for u in z.units:
                target = u.shard if z.stage == 3 else u.full[u.own_lo:u.own_hi]
                if not torch.equal(target, u.master.to(target.dtype)):
                    bad.append(f"{name}: {u.name} parameters are not its master cast")
                u.grad_fresh = False
        opt.zero_grad(set_to_none=True)
        for z in ex.model.zeros:
            for u in z.units:
                if u.grad.count_nonzero() or u.grad_fresh != (z.stage >= 2):
                    bad.append(f"{name}: {u.name} gradient buffer not zeroed / marked fresh")
    return bad


@pytest.mark.multiprocess
@pytest.mark.slow
def test_unit_ops_equal_per_tensor_ops_bit_for_bit():
    for bad in run_ranks(_unit_ops_rank, 2):
        assert bad == []


def _publish_rank() -> list[str]:
    """Two ZeroModels on the rank (stage 1 fp32, masters aliasing the parameters, and stage 2
    bf16), every master moved: after one ``publish_unit_parameters`` call over both, each
    unit's full parameters are every rank's masters cast, put side by side (gathered here by
    torch.distributed itself)."""
    zeros = []
    for precision, stage in (("fp32", 1), ("bf16", 2)):
        cfg = _cfg(precision, dict(dp=2, zero_stage=stage))
        zeros += build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu")).model.zeros
    for z in zeros:
        for u in z.units:
            u.master.add_(1.0 + dist.get_rank())  # a different move on each rank
    publish_unit_parameters(zeros)
    bad = []
    for z in zeros:
        for u in z.units:
            want = torch.empty(u.padded, dtype=torch.float32)
            dist.all_gather_into_tensor(want, u.master.contiguous())
            if not torch.equal(u.full, want.to(u.full.dtype)):
                bad.append(f"stage {z.stage} {u.name}: parameters are not the gathered masters")
    return bad


@pytest.mark.multiprocess
@pytest.mark.slow
def test_publish_gathers_every_models_units():
    for bad in run_ranks(_publish_rank, 2):
        assert bad == []
