"""The planner's mixture-of-experts terms (tessera.planner.moe): the active model, expert
memory, all-to-all traffic and its link, and the ranking of layouts with ep."""

from __future__ import annotations

import dataclasses

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
    # 32/4 MoE layers on a stage; 1 expert held, 2 counted by the active model, and the
    # router's E·h; 16 B/param
    assert t.expert_bytes == pytest.approx(8 * ((1 - 2) * 3 * h * f + 8 * h) * 16)
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
    # tessera runs expert parallelism in fp32 only (tessera.layout): in bf16 every ep > 1
    # plan is refused, and 47B parameters fit nowhere
    assert not any(p.fits for p in rank_ep_layouts(w, moe, [Layout(dp=16, tp=1, pp=4,
                                                                  micro_batch=1,
                                                                  recompute="full")]))
    w = dataclasses.replace(w, precision="fp32")
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
    router's E·h per MoE block is in the terms instead, and ffn_hidden is rounded), the
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


def test_tessera_prices_moe_blocks_whole_on_every_tp_rank():
    """tessera keeps MoE blocks whole on every tp rank (``parallel.expert_parallel``): at tp 2
    the planner's per-rank feed-forward parameters (the active model's MLPs plus the terms'
    experts and router) are what tessera's tp-2 model holds on a rank, counted on the model
    ``apply_tensor_parallel`` builds over a one-process fake group of two ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tessera.model import Transformer, mlp_params
    from tessera.parallel.tp_plan import apply_tensor_parallel
    from tessera.planner.engine import layout_of
    from tessera.planner.moe import active_workload
    from tessera.preflight import BYTES_HARDWARE

    cfg = make_config("moe-demo", overrides=["model.moe_every=2", "model.moe_shared_expert=true",
                                             "parallel.dp=1", "parallel.ep=1", "parallel.tp=2"])
    m = cfg.model
    w = Workload.from_config(cfg, load_hardware(BYTES_HARDWARE))
    L = layout_of(cfg)
    assert w.tessera_engine and L.tp == 2 and L.zero_stage == 0
    active, terms = active_workload(w, L, cfg)
    state = sum(w.bytes[:3])  # model-state bytes per parameter, unsharded
    planner = m.n_layers * 3 * m.d_model * active.model.ffn_hidden // L.tp
    planner += terms.expert_bytes / state
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = apply_tensor_parallel(Transformer(m), dist.group.WORLD)
        held = sum(p.numel() for block in model.layers
                   for p in block.feed_forward.parameters())
    finally:
        dist.destroy_process_group()
    split = sum(mlp_params(m, i) for i in range(m.n_layers)) / 2
    assert held > 1.5 * split  # the MoE blocks are whole on the rank, not split
    assert planner == pytest.approx(held, abs=m.n_layers * 3 * m.d_model / 2)  # the rounding


def test_moe_compute_per_rank_is_the_same_at_tp_1_and_2():
    """tessera's MoE layers compute whole on every tp rank: the active model's per-rank MLP
    GEMMs of all-MoE Mixtral are the same at tp 2 as at tp 1 (attention halves), and of a model
    with dense blocks between the MoE ones only the dense blocks' share halves. Another
    engine's (kernels 'fused') splits them over tp like a dense MLP."""
    from tessera.planner.compute import block_gemm_shapes
    from tessera.planner.moe import moe_tp

    def mlp(w, moe, tp):  # the per-rank MLP GEMMs' k·n summed
        spec = active_spec(w.model, moe, moe_tp(w, tp))
        qkv, *mlp_in, out, mlp_out = block_gemm_shapes(spec, tp)
        return sum(k * n for k, n in (*mlp_in, mlp_out))

    w, moe = _mixtral()
    assert w.tessera_engine
    assert mlp(w, moe, 2) == mlp(w, moe, 1) == 3 * 4096 * 2 * 14336
    assert active_spec(w.model, moe, 2).ffn_hidden == 2 * 2 * 14336
    fused = dataclasses.replace(w, kernels="fused")
    assert not fused.tessera_engine and mlp(fused, moe, 2) == mlp(fused, moe, 1) / 2
    every2 = dataclasses.replace(moe, every=2)
    h, f = 4096, 14336  # 16 dense blocks (f, split) and 16 MoE blocks (2f, whole) averaged
    assert mlp(w, every2, 2) == 3 * h * (f / 2 + 2 * f) / 2
    assert mlp(w, every2, 1) == 3 * h * (f + 2 * f) / 2


def test_tessera_moe_plans_are_layouts_tessera_runs():
    """The MoE ranking proposes only (layout, ep) pairs ``tessera.layout.validate`` accepts
    with the experts set: the active model's search offers sequence parallelism (a dense
    model's option), which per-sequence routing refuses, and in bf16 expert parallelism is
    refused (fp32 only). An allow-list that skipped the MoE rules would list them."""
    from tessera.planner.moe import active_layouts, moe_for_model, refusal
    from tessera.planner.search import SearchSpace

    cfg = make_config("moe-demo")
    moe = moe_for_model("moe-demo")
    for precision in ("bf16", "fp32"):
        w = Workload(model=from_model_config("moe-demo", cfg.model, cfg.data.seq_len),
                     hardware=load_hardware("H100"), gpus=8, global_batch=32,
                     seq_len=cfg.data.seq_len, precision=precision)
        candidates = active_layouts(w, moe, SearchSpace(sequence_parallel=(True, False)), 20)
        assert any(L.sequence_parallel for L in candidates)
        plans = rank_ep_layouts(w, moe, candidates)
        assert plans and not any(p.layout.sequence_parallel for p in plans)
        eps = {p.ep for p in plans}
        assert eps == {1} if precision == "bf16" else eps > {1}
        sp = next(L for L in candidates if L.sequence_parallel)
        active = dataclasses.replace(w, model=active_spec(w.model, moe, sp.tp))
        assert "sequence_parallel" in (refusal(w, active, sp, moe, 1) or "")


def _active(w: Workload, moe: MoESpec, tp: int) -> Workload:
    from tessera.planner.moe import moe_tp

    return dataclasses.replace(w, model=active_spec(w.model, moe, moe_tp(w, tp)))


def test_a_tessera_moe_block_has_attentions_tp_collectives_only():
    """tessera holds an MoE block whole on every tp rank: at tp 2 its tensor-parallel
    communication is attention's one all-reduce forward and one backward (one more for a
    recomputed forward), where a dense block (and another engine's MoE block, split over tp
    like a dense MLP) has the MLP's too. A dense block of the active model is priced as the
    same dense model without MoE blocks."""
    from tessera.planner.comm import allreduce_time, group_link
    from tessera.planner.compute import block_costs
    from tessera.planner.local.terms import rank_skew

    w, moe = _mixtral()
    h, s = 4096, 4096
    for recompute, passes in (("none", 1), ("full", 2)):
        a = _active(w, moe, 2)
        one = allreduce_time(2 * s * h, 2, group_link(a.hardware, 2))  # b·s·h bf16 bytes
        dense = block_costs(a, 2, 1, 1, False, recompute)
        mixed = block_costs(a, 2, 1, 1, False, recompute, moe=True)
        assert mixed.tp_forward == pytest.approx(one + rank_skew(a, 2, mixed.forward))
        assert mixed.tp_backward == pytest.approx(
            passes * one + rank_skew(a, 2, mixed.backward + mixed.recompute))
        assert dense.tp_forward == pytest.approx(2 * one + 2 * rank_skew(a, 2, dense.forward / 2))
        assert dense.tp_backward == pytest.approx(2 * passes * one)
        plain = dataclasses.replace(a, model=dataclasses.replace(a.model, moe=None))
        assert dense == block_costs(plain, 2, 1, 1, False, recompute)
        fused = _active(dataclasses.replace(w, kernels="fused"), moe, 2)
        split = block_costs(fused, 2, 1, 1, False, recompute, moe=True)
        assert split.tp_forward == block_costs(fused, 2, 1, 1, False, recompute).tp_forward
        assert split.tp_forward == pytest.approx(2 * one)


def test_router_gemm_is_priced_in_each_moe_block():
    """An MoE block computes its router, (b·s, h)·(h, E): 2·b·s·h·E FLOPs forward and twice
    that backward at the GEMM rate plus one GEMM's fixed tail each, on every tp rank; a dense
    block has none."""
    from tessera.planner.compute import block_costs

    w, moe = _mixtral()
    h, s, b = 4096, 4096, 2
    for tp in (1, 2):
        a = _active(w, moe, tp)
        hw = a.compute_hardware
        router = 2 * b * s * h * moe.experts / hw.matmul_flops + hw.matmul_tail_us * 1e-6
        dense = block_costs(a, tp, 1, b, False, "full")
        mixed = block_costs(a, tp, 1, b, False, "full", moe=True)
        assert mixed.forward - dense.forward == pytest.approx(router, rel=1e-9)
        assert mixed.recompute - dense.recompute == pytest.approx(router, rel=1e-9)
        assert mixed.backward - dense.backward == pytest.approx(2 * router, rel=1e-9)


def test_each_chunk_counts_its_own_moe_blocks():
    """With an MoE block every second block (blocks 1, 3, 5, ...) and stages of 7, 9, 9 and 7
    blocks the chunks hold 3, 5, 4 and 4 MoE blocks: each chunk's compute and tensor-parallel
    time is its dense blocks' plus its MoE blocks', the two middle chunks of 9 blocks apart."""
    from tessera.planner.compute import block_costs, compute_chunks

    w, moe = _mixtral()
    a = _active(w, dataclasses.replace(moe, every=2), 2)
    sizes = (7, 9, 9, 7)
    chunks = compute_chunks(a, 2, 1, 4, 1, 1, "none", False, "ring", sizes, True)
    dense = block_costs(a, 2, 1, 1, False, "none")
    mixed = block_costs(a, 2, 1, 1, False, "none", moe=True)
    assert dense.tp_forward > mixed.tp_forward and mixed.forward > dense.forward
    bare = compute_chunks(dataclasses.replace(a, model=dataclasses.replace(a.model, moe=None)),
                          2, 1, 4, 1, 1, "none", False, "ring", sizes, True)
    for ch, plain, nl, k in zip(chunks, bare, sizes, (3, 5, 4, 4), strict=True):
        for field in ("forward_compute", "backward_compute", "tp_forward", "tp_backward"):
            added = k * (getattr(mixed, field.removesuffix("_compute"))
                         - getattr(dense, field.removesuffix("_compute")))
            assert getattr(ch, field) == pytest.approx(getattr(plain, field) + added), (k, field)
        assert ch.tp_backward == pytest.approx((nl - k) * dense.tp_backward
                                               + k * mixed.tp_backward)
    assert chunks[1] is not chunks[2] and not chunks.uniform_middle


def test_moe_model_flops_are_the_models_own_with_the_router():
    """The planner's model FLOPs (MFU) of an active model are what ``tessera.model``'s
    flops_per_token counts for the mixture of experts (k experts, the shared expert and the
    router per MoE block), the same at tp 1 and tp 2 though tessera's tp-2 ranks each run the
    MoE blocks whole; the hardware FLOPs count what the ranks run: the router on each."""
    from tessera.model import flops_per_token
    from tessera.planner.formulas import hardware_flops_per_step, model_flops_per_step

    cfg = make_config("moe-demo", overrides=["model.moe_every=2", "model.moe_shared_expert=true"])
    s, B = cfg.data.seq_len, 8
    w = Workload(model=from_model_config("moe-demo", cfg.model, s), hardware=load_hardware("H100"),
                 gpus=2, global_batch=B, seq_len=s)
    moe = MoESpec.from_model_config(cfg.model)
    runtime = B * s * flops_per_token(cfg.model, s)
    for tp in (1, 2):
        spec = _active(w, moe, tp).model
        assert model_flops_per_step(spec, B, s) == pytest.approx(runtime, rel=1e-12)
    spec = _active(w, moe, 2).model
    bare = dataclasses.replace(spec, moe=None)  # the blocks as the ranks run them, no router
    routers = 6 * B * s * (cfg.model.n_layers // 2) * moe.experts * cfg.model.d_model
    assert hardware_flops_per_step(spec, B, s, "none") - hardware_flops_per_step(
        bare, B, s, "none") == pytest.approx(2 * routers)  # on each of the 2 tp ranks
    assert hardware_flops_per_step(spec, B, s, "full") - hardware_flops_per_step(
        bare, B, s, "full") == pytest.approx(2 * routers * 4 / 3)  # forward recomputed
