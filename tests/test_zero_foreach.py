"""ShardedAdamW's multi-tensor update (``torch._foreach_*`` over all units) against the
per-unit single-tensor AdamW arithmetic, bit for bit on CPU."""

from __future__ import annotations

import pytest
import torch

import tessera.parallel.update_batches as update_batches_module
from tessera.config_io import make_config
from tessera.parallel.update_batches import UPDATE_BATCH_ELEMENTS, update_batches
from tessera.parallel.zero_state import ShardedAdamW
from tessera.step import build_executor
from tessera.testing import run_ranks
from tessera.topology import Topology

SEQ = 16
CASES = (("fp32", 1, 0.1, None), ("fp32", 2, 0.0, 1), ("bf16", 0, 0.1, 1), ("bf16", 2, 0.1, None),
         ("bf16", 1, 0.0, 20_000))
"""(precision, ZeRO stage, weight decay, update group cap) at dp=2: owned ranges that cut
through parameters (stages 1-2), flat units at stage 0 (bf16), with and without decay; all
units in one update group (None: the default cap), each unit alone (1), or a few groups."""


def _cfg(precision: str, stage: int, weight_decay: float):
    return make_config(
        None, model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ),
        parallel=dict(dp=2, zero_stage=stage),
        train=dict(micro_batch_size=2, grad_accum=1, precision=precision,
                   weight_decay=weight_decay),
        data=dict(seq_len=SEQ))


def _reference_step(unit, state: dict, grad: torch.Tensor, lr: float, betas, eps: float,
                    weight_decay: float) -> None:
    """One unit's update as single-tensor AdamW computes it (state: master, exp_avg,
    exp_avg_sq copies and the step count)."""
    beta1, beta2 = betas
    state["step"] += 1
    step = float(state["step"])
    master = state["master"]
    if weight_decay:
        for a, b in unit.decay_ranges():
            master[a:b].mul_(1 - lr * weight_decay)
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(state["exp_avg"], denom, value=-step_size)


def _foreach_rank() -> tuple[list[str], list[bool]]:
    """Per case, three steps of the optimizer and of the reference on copies of its state, the
    last with the first unit's step count ahead of the others'. Returns the mismatches (empty:
    every tensor equal bit for bit after every step) and, per case, whether the rank's owned
    elements mix decayed and undecayed ranges."""
    bad, mixed = [], []
    for precision, stage, wd, cap in CASES:
        update_batches_module.UPDATE_BATCH_ELEMENTS = cap or UPDATE_BATCH_ELEMENTS
        cfg = _cfg(precision, stage, wd)
        ex = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
        opt = ex.optimizer(cfg.train)
        assert isinstance(opt, ShardedAdamW)
        units = opt.units
        ref = [{"step": 0, "master": u.master.clone(),
                "exp_avg": opt.state[u.master]["exp_avg"].clone(),
                "exp_avg_sq": opt.state[u.master]["exp_avg_sq"].clone()} for u in units]
        group = opt.param_groups[0]
        for k in range(3):
            g = torch.Generator().manual_seed(10 * k + ex.topo.rank)
            tokens = torch.randint(0, cfg.model.vocab_size, (2, SEQ + 1), generator=g)
            opt.zero_grad()
            ex.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
            group["lr"] = 1e-2 * (k + 1)  # a moving lr: the step reads it each time
            grads = [u.owned_grad().float().clone() for u in units]
            if k == 2:  # units at different step counts are updated with their own counts
                opt.state[units[0].master]["step"] += 5
                ref[0]["step"] += 5
            opt.step()
            for u, r, grad in zip(units, ref, grads, strict=True):
                _reference_step(u, r, grad, group["lr"], group["betas"], group["eps"],
                                group["weight_decay"])
                state = opt.state[u.master]
                for key, got in (("master", u.master), ("exp_avg", state["exp_avg"]),
                                 ("exp_avg_sq", state["exp_avg_sq"])):
                    if not torch.equal(got, r[key]):
                        bad.append(f"{precision} stage {stage} wd {wd} step {k} {u.name} {key}")
                if state["step"] != r["step"]:
                    bad.append(f"{precision} stage {stage} step count {state['step']}")
        mixed.append(any(0 < sum(b - a for a, b in u.decay_ranges()) < u.master.numel()
                         for u in units))
    return bad, mixed


@pytest.mark.multiprocess
@pytest.mark.slow
def test_foreach_update_equals_per_unit_adamw_bit_for_bit():
    results = run_ranks(_foreach_rank, 2)
    for bad, _ in results:
        assert bad == []
    # a decay applied to the whole unit would be seen: each case has a rank whose units hold
    # both decayed matrices and undecayed norm gains
    assert all(any(case) for case in zip(*(mixed for _, mixed in results), strict=True))


def test_update_groups_are_consecutive_units_within_the_cap():
    """A group closes before the unit that would take it past the cap (a sum equal to the cap
    stays one group); a unit over the cap stands alone."""
    assert update_batches([10, 6, 1, 20, 3], cap=16) == [[0, 1], [2], [3], [4]]
    assert update_batches([4, 4, 4, 4], cap=8) == [[0, 1], [2, 3]]
    assert update_batches([], cap=8) == []
    assert update_batches([1] * 5) == [[0, 1, 2, 3, 4]]
