"""The planner's mixture-of-experts terms (tessera.planner.moe): the active model, expert
memory, all-to-all traffic and its link, and the ranking of layouts with ep."""

from __future__ import annotations

import pytest

from tessera.config_io import make_config
from tessera.model import active_param_count, param_count
from tessera.planner.hardware import load_hardware
from tessera.planner.models import from_model_config
from tessera.planner.moe import MoESpec, active_spec, ep_degrees, moe_terms, rank_ep_layouts
from tessera.planner.workload import Layout, Workload


def _mixtral(gpus: int = 64) -> tuple[Workload, MoESpec]:
    cfg = make_config("mixtral-8x7b")
    spec = from_model_config("mixtral-8x7b", cfg.model, 4096)
    w = Workload(model=spec, hardware=load_hardware("H100"), gpus=gpus, global_batch=256,
                 seq_len=4096)
    return w, MoESpec.from_model_config(cfg.model)


def test_preset_shapes_and_active_parameters():
    mixtral = make_config("mixtral-8x7b").model
    olmoe = make_config("olmoe-1b-7b").model
    # published: Mixtral 46.7B total, 12.9B active; OLMoE 6.9B total, 1.3B active
    assert param_count(mixtral) / 1e9 == pytest.approx(46.7, abs=0.1)
    assert active_param_count(mixtral) / 1e9 == pytest.approx(12.9, abs=0.1)
    assert param_count(olmoe) / 1e9 == pytest.approx(6.9, abs=0.1)
    assert active_param_count(olmoe) / 1e9 == pytest.approx(1.3, abs=0.1)


def test_active_spec_is_the_dense_model_one_token_uses():
    w, moe = _mixtral()
    assert active_spec(w.model, moe).ffn_hidden == 2 * 14336


def test_expert_memory_and_all_to_all_formulas():
    w, moe = _mixtral()
    h, f = 4096, 14336
    L = Layout(dp=16, tp=1, pp=4, micro_batch=1)
    t = moe_terms(w, L, w.model, moe, ep=8)
    # 32/4 MoE layers on a stage; 1 expert held, 2 counted by the active model; 16 B/param
    assert t.expert_bytes == pytest.approx(8 * (1 - 2) * 3 * h * f * 16)
    # m = 256/16 micro-batches; 4 all-to-alls of b·s·k·h bf16 bytes, 7/8 leave the rank
    assert t.alltoall_bytes == pytest.approx(4 * 8 * 16 * 4096 * 2 * h * 2 * 7 / 8)
    assert t.intra_node  # 8 ranks 1 apart: one node of 8 GPUs
    t2 = moe_terms(w, Layout(dp=8, tp=2, pp=4, micro_batch=1), w.model, moe, ep=8)
    assert not t2.intra_node  # 8 ranks 2 apart span 16 GPUs
    assert t2.alltoall_time / t2.alltoall_bytes > t.alltoall_time / t.alltoall_bytes
    assert moe_terms(w, L, w.model, moe, ep=1).alltoall_time == 0


def test_ep_degrees_divide_dp_and_the_experts():
    assert ep_degrees(16, 8) == [1, 2, 4, 8]
    assert ep_degrees(6, 8) == [1, 2]


def test_ranking_puts_fitting_layouts_first_and_needs_ep_for_mixtral():
    w, moe = _mixtral()
    layouts = [Layout(dp=dp, tp=tp, pp=pp, micro_batch=1, recompute="full")
               for dp, tp, pp in [(64, 1, 1), (16, 1, 4), (8, 2, 4), (8, 8, 1)]]
    plans = rank_ep_layouts(w, moe, layouts)
    assert plans[0].fits and plans[0].ep > 1  # 47B parameters do not fit without ep
    assert all(not p.fits for p in plans if p.ep == 1)
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)
    fitting = [p.step_time for p in plans if p.fits]
    assert fitting == sorted(fitting)
    assert "ep=" in plans[0].describe()


def test_plan_command_ranks_moe_presets_with_ep():
    from typer.testing import CliRunner

    from tessera.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "mixtral-8x7b", "--gpus", "64",
                                      "--hardware", "H100-SXM", "--global-batch", "256",
                                      "--seq", "4096", "--tp", "1,2", "--pp", "1,2",
                                      "--top", "3"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("mixture of experts: E=8 top-2")
    assert len(lines) == 4 and all(" ep=" in ln and "all-to-all" in ln for ln in lines[1:])


def test_a_runs_moe_part_is_what_its_model_runs():
    """``active_workload``, the one place the run summary and the preflight's memory read a
    run's MoE part from: the active model's MLPs hold the parameters one token uses in
    tessera's model (top-k experts and the shared expert on every moe_every-th block; the
    router's E·h per MoE block is the one thing left out, and ffn_hidden is rounded), the
    terms are those of the run's ep, and the preflight's expert bytes are these terms'."""
    from tessera.model import mlp_params
    from tessera.planner.engine import layout_of
    from tessera.planner.moe import active_workload
    from tessera.preflight import BYTES_HARDWARE, memory_per_rank

    cfg = make_config("moe-demo", overrides=["model.moe_every=2", "model.moe_shared_expert=true",
                                             "parallel.dp=4"])
    m = cfg.model
    w = Workload.from_config(cfg, load_hardware(BYTES_HARDWARE))
    L = layout_of(cfg)
    active, terms = active_workload(w, L, cfg)
    runtime = sum(mlp_params(m, i, active=True) for i in range(m.n_layers))
    router = m.moe_experts * m.d_model * sum(m.is_moe_layer(i) for i in range(m.n_layers))
    mlps = m.n_layers * 3 * m.d_model * active.model.ffn_hidden
    assert abs(mlps - (runtime - router)) <= m.n_layers * 3 * m.d_model / 2  # the rounding
    moe = MoESpec.from_model_config(m)
    assert terms == moe_terms(w, L, w.model, moe, ep=2)
    assert terms.expert_bytes != moe_terms(w, L, w.model, moe, ep=1).expert_bytes
    assert [r.experts for r in memory_per_rank(cfg)] == [terms.expert_bytes]
    dense = make_config("tiny")
    w_dense = Workload.from_config(dense, load_hardware(BYTES_HARDWARE))
    assert active_workload(w_dense, layout_of(dense), dense) == (w_dense, None)
