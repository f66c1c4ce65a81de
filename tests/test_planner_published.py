"""The planner against published numbers: ZeRO, Megatron-LM, Korthikanti et al., bubbles.

No processes; the whole file runs in about a second.
"""

from __future__ import annotations

import pytest

from tessera.pipeline.schedules import closed_form_bubble
from tessera.pipeline.simulator import StageCosts
from tessera.planner.estimate import estimate
from tessera.planner.formulas import (
    hardware_flops_per_step,
    layer_activation_bytes,
    megatron_hardware_flops,
    megatron_model_flops,
    megatron_params,
    model_flops_per_step,
    training_days,
    zero_max_params,
    zero_model_state_bytes,
)
from tessera.planner.hardware import load_hardware
from tessera.planner.models import MEGATRON_WEAK_SCALING, gpt, load_model
from tessera.planner.pipeline import time_pipeline
from tessera.planner.workload import Layout, Workload


def test_zero_paper_7_5b_model_state():
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12."""
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        got = zero_model_state_bytes(7.5e9, stage, 64) / 1e9
        # The paper prints one decimal: the exact values are 120, 31.41, 16.64, 1.875 GB.
        assert got == pytest.approx(gb, abs=0.05), (stage, got)


def test_zero_slide_largest_model_per_80gb():
    """80 GB / 16 B per parameter = 5B without ZeRO; 19B, 36B, 320B with ZeRO-1/2/3 at N=64."""
    expected = {0: 5e9, 1: 19e9, 2: 36e9, 3: 320e9}
    for stage, params in expected.items():
        got = zero_max_params(80e9, stage, 64)
        # The slide rounds to whole billions (19.1B, 36.1B): 3% covers the rounding.
        assert got == pytest.approx(params, rel=0.03), (stage, got)


def test_zero_memory_inside_a_layout():
    """The per-rank model state of a pure data-parallel layout is the ZeRO formula on the
    model's own parameter count, for every stage."""
    spec = load_model("gpt3-6.7b")
    hw = load_hardware("A100-80GB")
    w = Workload(model=spec, hardware=hw, gpus=64, global_batch=64, seq_len=2048)
    for stage in range(4):
        e = estimate(w, Layout(dp=64, zero_stage=stage, recompute="full"), simulate=False)
        state = e.memory.params + e.memory.grads + e.memory.optimizer
        # Exact up to float rounding: both count the same parameters.
        assert state == pytest.approx(zero_model_state_bytes(spec.param_count, stage, 64),
                                      rel=1e-12)


@pytest.mark.parametrize("row", MEGATRON_WEAK_SCALING, ids=lambda r: r.model.name)
def test_megatron_eq2_parameter_counts(row):
    """Narayanan et al. 2021, eq. (2) and Table 1's parameter column (billions, 1 decimal)."""
    m = row.model
    eq2 = megatron_params(m.layers, m.hidden, m.vocab_size, m.max_seq_len)
    assert eq2 / 1e9 == pytest.approx(row.billions, abs=0.05)  # the table's rounding
    # Counting the spec's tensors adds only the final LayerNorm (2h) to eq. (2).
    assert m.param_count - eq2 == pytest.approx(2 * m.hidden, abs=1e-3 * m.hidden)


def test_flops_formulas_generalize_megatron():
    """For the GPT form the generalized counts equal Megatron's 72 and 96 coefficients."""
    spec = gpt("x", hidden=4096, layers=36, heads=32)
    B, s = 512, 2048
    args = (B, s, spec.layers, spec.hidden, spec.vocab_size)
    # Exact algebraic identities; 1e-12 allows float rounding only.
    assert model_flops_per_step(spec, B, s) == pytest.approx(megatron_model_flops(*args),
                                                             rel=1e-12)
    assert hardware_flops_per_step(spec, B, s, "full") == pytest.approx(
        megatron_hardware_flops(*args), rel=1e-12)


def test_megatron_training_time_estimates():
    """§5.1: GPT-3 175B, 1024 A100s at 140 TFLOP/s, 300B tokens ≈ 34 days; 1T, 3072 GPUs at
    163 TFLOP/s, 450B tokens ≈ 84 days. ±3%, as the paper rounds to whole days."""
    assert training_days(300e9, 175e9, 1024, 140e12) == pytest.approx(34, rel=0.03)
    assert training_days(450e9, 1e12, 3072, 163e12) == pytest.approx(84, rel=0.03)


def test_megatron_weak_scaling_throughput():
    """Table 1's TFLOP/s per GPU, predicted from the table's own layouts (A100 80GB, fp16,
    full recomputation, no flash attention in 2021, interleaving where the paper's script
    used it). One set of constants for all rows; within ±10% per row, ±5% on average."""
    hw = load_hardware("A100-80GB")
    errors = []
    for row in MEGATRON_WEAK_SCALING:
        w = Workload(model=row.model, hardware=hw, gpus=row.gpus, global_batch=row.global_batch,
                     seq_len=2048, flash_attention=False)
        layout = Layout(dp=row.gpus // (row.tp * row.pp), tp=row.tp, pp=row.pp,
                        virtual_stages=row.virtual_stages, micro_batch=row.micro_batch,
                        recompute="full",
                        schedule="interleaved" if row.virtual_stages > 1 else "1f1b")
        predicted = estimate(w, layout).tflops_per_gpu
        error = predicted / row.tflops_per_gpu - 1
        print(f"{row.model.name:>16}: predicted {predicted:6.1f}, paper {row.tflops_per_gpu}, "
              f"error {100 * error:+.1f}%")
        assert abs(error) <= 0.10, (row.model.name, predicted)
        errors.append(error)
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    assert mean_abs <= 0.05, mean_abs


def test_korthikanti_table2_activation_memory():
    """Korthikanti et al. 2022, Table 2 (bytes per layer, fp16): reproduced exactly by counting
    the stored tensors for the GPT form."""
    spec = gpt("x", hidden=12288, layers=96, heads=96)
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh, ash = s * b * h, a * s / h
    cases = {
        (1, False, "none"): sbh * (34 + 5 * ash),
        (t, False, "none"): sbh * (10 + 24 / t + 5 * ash / t),
        (t, True, "none"): sbh / t * (34 + 5 * ash),
        (t, False, "selective"): sbh * (10 + 24 / t),
        (t, True, "selective"): sbh * 34 / t,
        (1, False, "full"): 2 * sbh,
    }
    for (tp, sp, recompute), expected in cases.items():
        got = layer_activation_bytes(spec, b, s, tp, sp, recompute, flash=False, e=2)
        assert got == pytest.approx(expected, rel=1e-12), (tp, sp, recompute)


@pytest.mark.parametrize("name,p,m,v", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1), ("1f1b", 8, 200, 1),
    ("interleaved", 4, 8, 2), ("interleaved", 4, 96, 3), ("gpipe", 8, 400, 1),
])
def test_simulated_bubbles_equal_closed_forms(name, p, m, v):
    """Equal costs, free communication: the planner's simulations (exact at small m,
    extrapolated from two simulations at large m) give (p−1)/m, interleaved (p−1)/(v·m)."""
    costs = StageCosts(forward=1.0 / v, backward=2.0 / v)
    timing = time_pipeline(name, p, m, v, costs)
    bubble = timing.bubble / timing.compute_time
    # Exact up to the 6-significant-digit normalization of the simulation cache.
    assert bubble == pytest.approx(closed_form_bubble(name, p, m, v), rel=1e-5)
    assert len(timing.simulated_m) == (2 if 2 * p * v * m > 3000 else 1)
