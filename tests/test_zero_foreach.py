"""ShardedAdamW's multi-tensor update (``torch._foreach_*`` over all units) against the
per-unit single-tensor AdamW arithmetic, bit for bit on CPU; its fused update (torch's fused
AdamW kernel, the CUDA default, forced here on CPU) against the same arithmetic within a
rounding bound; and the rule that picks between them."""

from __future__ import annotations

import pytest
import torch

import tessera.optim
import tessera.parallel.update_batches as update_batches_module
from tessera.config_io import make_config
from tessera.parallel.update_batches import UPDATE_BATCH_ELEMENTS, update_batches
from tessera.parallel.zero_state import ShardedAdamW
from tessera.step import build_executor
from tessera.testing import run_ranks, summation_bound, summation_error
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


def _micro_step(ex, opt: ShardedAdamW, cfg, k: int) -> list[torch.Tensor]:
    """Step k's gradients: a fresh batch (seeded by k and the rank) through the executor, the
    lr moved (the step must read it each time); returns copies of the units' owned gradients
    in fp32, what the reference steps with."""
    g = torch.Generator().manual_seed(10 * k + ex.topo.rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, SEQ + 1), generator=g)
    opt.zero_grad()
    ex.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    opt.param_groups[0]["lr"] = 1e-2 * (k + 1)
    return [u.owned_grad().float().clone() for u in opt.units]


def _recording(update, calls: list[list[str]]):
    """`update` (ShardedAdamW's per-group update) that first appends its units' names to
    `calls`: the groups the step updates together."""
    def record(units, step: int, group: dict) -> None:
        calls.append([u.name for u in units])
        update(units, step, group)
    return record


def _foreach_rank() -> tuple[list[str], list[bool]]:
    """Per case, three steps of the optimizer and of the reference on copies of its state, the
    last with the first unit's step count ahead of the others'. Returns the mismatches (empty:
    every tensor equal bit for bit after every step, and the units updated together in the
    groups ``update_batches`` makes, which bound the update's temporaries) and, per case,
    whether the rank's owned elements mix decayed and undecayed ranges."""
    bad, mixed = [], []
    for precision, stage, wd, cap in CASES:
        update_batches_module.UPDATE_BATCH_ELEMENTS = cap or UPDATE_BATCH_ELEMENTS
        cfg = _cfg(precision, stage, wd)
        ex = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
        opt = ex.optimizer(cfg.train)
        assert isinstance(opt, ShardedAdamW)
        units = opt.units
        calls: list[list[str]] = []
        opt._update = _recording(opt._update, calls)
        ref = _state_copies(opt)
        group = opt.param_groups[0]
        for k in range(3):
            grads = _micro_step(ex, opt, cfg, k)
            if k == 2:  # units at different step counts are updated with their own counts
                opt.state[units[0].master]["step"] += 5
                ref[0]["step"] += 5
            calls.clear()
            opt.step()
            if k < 2:  # one step count: the groups are update_batches' over every unit
                want = [[units[i].name for i in b]
                        for b in update_batches([u.master.numel() for u in units])]
                if calls != want:
                    bad.append(f"{precision} stage {stage} cap {cap} step {k} groups {calls}")
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


def _fused_bound_step(unit_ref: dict, grad: torch.Tensor, lr: float, betas, eps: float,
                      n: int) -> None:
    """Advance the elementwise scales of the fused update's tolerance by the step just taken
    by `unit_ref` (after ``_reference_step``; `n`: how many updates it has taken).

    The fused kernel computes AdamW's formula with other roundings (fp32 ε per operation, in
    another order and fusion), so each quantity differs from the single-tensor arithmetic by
    round-off that adds up over the steps (the masters, exp_avg and exp_avg_sq are not fed
    back through the model: both paths step from the same gradients):

    - exp_avg m = β1·m + (1−β1)·g: ≤ 3 roundings a step on each path, of terms at most
      S = β1·S + (1−β1)·|g| (S bounds |m| and what may cancel in it); earlier differences
      shrink by β1 ≤ S's own decay, so after n steps |Δm| ≤ 3n·ε·S ("m_scale");
    - exp_avg_sq v: the same, with terms that never cancel (v ≥ 0): |Δv| ≤ 3n·ε·v;
    - the master moves by lr/bc1 · m/(√(v/bc2) + eps): its difference is ε·lr/bc1 ·
      S/denominator times (3n from Δm + 1.5n from Δv under the root + ~8 roundings of the
      quotient and of the bias corrections, which may be computed from fp32 betas: 2ε
      relative at step 1), plus 2ε·|master| for the decay and the subtraction; the
      differences of earlier steps carry over unchanged ("master_scale").

    ``summation_error`` then allows SAFETY (4) times these bounds; a real bug moves elements
    by far more (a skipped decay by lr·weight_decay·|w| = 10⁻³·|w| a step, checked below)."""
    beta1, beta2 = betas
    step = unit_ref["step"]
    unit_ref["m_scale"].mul_(beta1).add_(grad.abs(), alpha=1 - beta1)
    denom = (unit_ref["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(eps)
    unit_ref["master_scale"].add_(unit_ref["m_scale"] / denom,
                                  alpha=(5 * n + 8) * lr / (1 - beta1 ** step))
    unit_ref["master_scale"].add_(unit_ref["master"].abs(), alpha=2)


def _state_copies(opt: ShardedAdamW) -> list[dict]:
    """Per unit, copies of its master and moments, its step count and zeroed tolerance
    scales (``_fused_bound_step``)."""
    return [{"step": 0, "master": u.master.clone(),
             "exp_avg": opt.state[u.master]["exp_avg"].clone(),
             "exp_avg_sq": opt.state[u.master]["exp_avg_sq"].clone(),
             "m_scale": torch.zeros_like(u.master),
             "master_scale": torch.zeros_like(u.master)} for u in opt.units]


def _picked(default: ShardedAdamW, train) -> dict:
    """Which path ShardedAdamW takes: by default on CPU (`default`), under a rule that calls
    its masters' device fused (and which device types it asked the rule about), and forced
    off under that rule."""
    seen: list[set[str]] = []

    def rule(types: set[str]) -> dict[str, bool]:
        seen.append(types)
        return {"fused": True}

    cpu_rule = tessera.optim.adamw_implementation
    tessera.optim.adamw_implementation = rule
    try:
        ruled = ShardedAdamW(default.zeros, train)
        forced_off = ShardedAdamW(default.zeros, train, fused=False)
    finally:
        tessera.optim.adamw_implementation = cpu_rule
    return {"cpu": default.fused, "ruled": ruled.fused, "asked": seen,
            "forced_off": forced_off.fused}


def _fused_rank() -> dict:
    """Per case, three steps of a fused ShardedAdamW (forced: CPU's default is the multi-tensor
    path) against the single-tensor reference on copies of its state, the last with the first
    unit's step count ahead (the kernel's device step counts are refilled from the host's).
    Returns the largest share of the tolerance (``_fused_bound_step``) each case used, and
    where the case decays, the smallest largest-share a reference that skips the decay uses;
    and which path the default rule picks on CPU and on a device the rule calls fused."""
    out: dict = {"used": [], "no_decay": [], "picked": {}}
    for precision, stage, wd, cap in CASES:
        update_batches_module.UPDATE_BATCH_ELEMENTS = cap or UPDATE_BATCH_ELEMENTS
        cfg = _cfg(precision, stage, wd)
        ex = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
        default = ex.optimizer(cfg.train)
        out["picked"] = out["picked"] or _picked(default, cfg.train)
        opt = ShardedAdamW(default.zeros, cfg.train, fused=True)
        units = opt.units
        ref, no_decay = _state_copies(opt), _state_copies(opt)
        group = opt.param_groups[0]
        used, used_no_decay = 0.0, 0.0
        for k in range(3):
            grads = _micro_step(ex, opt, cfg, k)
            if k == 2:
                opt.state[units[0].master]["step"] += 5
                ref[0]["step"] += 5
                no_decay[0]["step"] += 5
            opt.step()
            for u, r, r0, grad in zip(units, ref, no_decay, grads, strict=True):
                lr, betas, eps = group["lr"], group["betas"], group["eps"]
                _reference_step(u, r, grad, lr, betas, eps, group["weight_decay"])
                _reference_step(u, r0, grad, lr, betas, eps, 0.0)
                _fused_bound_step(r, grad, lr, betas, eps, k + 1)
                state = opt.state[u.master]
                assert state["step"] == r["step"]
                # the host's record of the kernel's count is the count (no refill needed)
                assert opt._device_step_values[u.master] == r["step"]
                assert float(opt._device_steps[u.master]) == r["step"]
                label = f"{precision} stage {stage} wd {wd} step {k} {u.name}"
                used = max(used,
                           summation_error(u.master, r["master"], terms=1,
                                           scale=r["master_scale"], msg=f"{label} master"),
                           summation_error(state["exp_avg"], r["exp_avg"], terms=3 * (k + 1),
                                           scale=r["m_scale"], msg=f"{label} exp_avg"),
                           summation_error(state["exp_avg_sq"], r["exp_avg_sq"],
                                           terms=3 * (k + 1), scale=r["exp_avg_sq"],
                                           msg=f"{label} exp_avg_sq"))
                miss = (u.master - r0["master"]).abs()
                bound = summation_bound(1, r["master_scale"])
                used_no_decay = max(used_no_decay, float(torch.where(
                    miss > 0, miss / bound, torch.zeros_like(miss)).max()))
        out["used"].append(used)
        if wd:
            out["no_decay"].append(used_no_decay)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fused_update_matches_adamw_within_rounding_and_is_chosen_on_cuda():
    """The fused path (torch's fused AdamW kernel with weight_decay=0 after ShardedAdamW's own
    decay of the matrix ranges) computes AdamW's step: every master and moment within the
    rounding bound of ``_fused_bound_step`` after every step, fp32 and bf16, stages 0-2, with
    and without decay, one or several update groups; a reference that skips the decay is far
    outside it. The rule: the multi-tensor path on CPU, fused where
    ``optim.adamw_implementation`` says fused for the masters' device types, unless forced."""
    for out in run_ranks(_fused_rank, 2):
        assert max(out["used"]) <= 1.0, out["used"]
        assert len(out["no_decay"]) == sum(1 for case in CASES if case[2])
        assert min(out["no_decay"]) > 10, out["no_decay"]
        assert out["picked"] == {"cpu": False, "ruled": True, "asked": [{"cpu"}],
                                 "forced_off": False}


def test_fused_rule_is_the_per_parameter_optimizers():
    """One rule for both optimizers: fused exactly when every tensor lives on CUDA."""
    assert tessera.optim.uses_fused_adamw({"cuda"})
    assert tessera.optim.adamw_implementation({"cuda"}) == {"fused": True}
    for types in ({"cpu"}, {"cuda", "cpu"}, {"meta"}, set()):
        assert not tessera.optim.uses_fused_adamw(types)
        assert tessera.optim.adamw_implementation(types) == {"foreach": False}


def test_update_groups_are_consecutive_units_within_the_cap():
    """A group closes before the unit that would take it past the cap (a sum equal to the cap
    stays one group); a unit over the cap stands alone."""
    assert update_batches([10, 6, 1, 20, 3], cap=16) == [[0, 1], [2], [3], [4]]
    assert update_batches([4, 4, 4, 4], cap=8) == [[0, 1], [2, 3]]
    assert update_batches([], cap=8) == []
    assert update_batches([1] * 5) == [[0, 1, 2, 3, 4]]
    # an empty unit before one over the cap still leaves that one alone
    assert update_batches([0, 10, 2], cap=5) == [[0], [1], [2]]
    # the default cap is 2**26 elements: two halves fill one group, one element more does not
    assert update_batches([1 << 25, 1 << 25, 1]) == [[0, 1], [2]]
