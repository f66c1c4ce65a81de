"""Zero-bubble schedules (zb-h1, zb-v, dualpipev): valid orders, simulated bubble and memory,
torch.distributed.pipelining's orders, the CLI and the layout rule. No processes."""

from __future__ import annotations

import pytest

from tessera.errors import ConfigError
from tessera.pipeline.schedule import Kind, lower_comms, parse
from tessera.pipeline.schedules import SCHEDULES, build_schedule, closed_form_bubble
from tessera.pipeline.simulator import StageCosts, peak_inflight, simulate
from tessera.pipeline.timeline import chrome_trace, legend_handles, shade, text_grid
from tessera.pipeline.validator import validate

ZB = {"zb-h1": 1, "zb-v": 2, "dualpipev": 2}
"""The zero-bubble schedules and their chunks per rank."""
F_I_W = StageCosts(forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0)
"""F = I = W = 1 per chunk and micro-batch (a B is I + W = 2): the paper's T_F = T_B = T_W."""


@pytest.mark.parametrize("name", ZB)
@pytest.mark.parametrize("p", (2, 4, 8))
@pytest.mark.parametrize("k", (1, 2, 3))
def test_orders_are_valid_and_deadlock_free(name, p, k):
    m, v = k * p, ZB[name]
    s = build_schedule(name, p, m, v)  # validated: compute-only and lowered
    assert (s.n_ranks, s.n_chunks, s.virtual) == (p, p * v, v)
    assert parse(s.to_string()) == s
    validate(lower_comms(s))
    assert s.split_backward
    if v == 2:  # the V: rank r holds chunks r and 2p-1-r
        assert s.chunk_rank == tuple(list(range(p)) + list(reversed(range(p))))
        assert all(s.chunks_of(r) == [r, 2 * p - 1 - r] for r in range(p))
    for acts in s.actions:  # every pair: B, or I and a later W
        kinds = {}
        for a in acts:
            kinds.setdefault((a.chunk, a.microbatch), []).append(a.kind)
        assert all(ks in ([Kind.F, Kind.B], [Kind.F, Kind.I, Kind.W]) for ks in kinds.values())


def test_zb_h1_bubble_is_a_third_of_1f1b():
    """At F = I = W ZB-H1's bubble is (p-1)/(3m) of the ideal step exactly (tolerance 1e-9,
    float rounding of unit sums): only the forward fill, p-1 units before the last rank's
    first forward, where 1F1B's is (p-1)(F+B) = 3(p-1) units."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 3 * p):
            zb = simulate(build_schedule("zb-h1", p, m), F_I_W)
            one = simulate(build_schedule("1f1b", p, m), F_I_W)
            assert zb.compute_time == one.compute_time == 3 * m
            assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m), abs=1e-9)
            assert one.bubble_fraction == pytest.approx((p - 1) / m, abs=1e-9)
            assert closed_form_bubble("zb-h1", p, m) == pytest.approx(zb.bubble_fraction)
    assert closed_form_bubble("zb-h1", 4, 3) is None  # m < p: no closed form


@pytest.mark.parametrize("name", ("zb-v", "dualpipev"))
def test_v_schedules_have_no_bubble_beyond_the_fill(name):
    """At F = I = W per chunk (a chunk is half a rank's layers), once m >= 2p the bubble is
    (p-1)/(6m) exactly (tolerance 1e-9): the last rank's first forward waits for p-1 chunk
    forwards, which no schedule avoids (every rank does the same 6m units of work, so the
    makespan is at least 6m + p - 1). Interleaved 1F1B at v = 2 pays (p-1)/(2m), three times
    as much; at m = p (p >= 4) the V shapes do not reach the bound."""
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p, 4 * p):
            s = build_schedule(name, p, m, 2)
            r = simulate(s, F_I_W)
            assert r.compute_time == 6 * m
            assert r.makespan >= 6 * m + p - 1  # the fill: a lower bound for any order
            assert r.bubble_fraction == pytest.approx((p - 1) / (6 * m), abs=1e-9)
            assert closed_form_bubble(name, p, m, 2) == pytest.approx(r.bubble_fraction)
            lean = simulate(build_schedule("interleaved", p, m, 2), F_I_W)
            assert lean.bubble_fraction == pytest.approx((p - 1) / (2 * m), abs=1e-9)
        assert closed_form_bubble(name, p, p, 2) is None
        if p >= 4:
            short = simulate(build_schedule(name, p, p, 2), F_I_W)
            assert short.bubble_fraction > (p - 1) / (6 * p) + 0.01


def test_in_flight_memory_matches_1f1b_and_dualpipev_published_count():
    """Counting a set until its W (simulator.W_HELD = 1): ZB-H1 holds p sets on every rank,
    1F1B's largest (its rank 0); ZB-V 2p half-size (chunk) sets, i.e. p of a rank's worth:
    1F1B's memory; DualPipeV 2p + 1 chunk sets, the DualPipe repository's "PP + 1" activation
    count for DualPipeV (PP = 2p stages on p devices)."""
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p):
            one = peak_inflight(build_schedule("1f1b", p, m))
            assert peak_inflight(build_schedule("zb-h1", p, m)) == [max(one)] * p
            assert peak_inflight(build_schedule("zb-v", p, m, 2)) == [2 * p] * p
            assert peak_inflight(build_schedule("dualpipev", p, m, 2)) == [2 * p + 1] * p
            for name, v in ZB.items():
                spec = SCHEDULES[name]
                assert list(spec.closed_form_inflight(p, m, v, 0)) == peak_inflight(
                    build_schedule(name, p, m, v))
    # Counting what W holds as half a set, ZB-H1's deferred W cost rank r only r/2 sets.
    assert peak_inflight(build_schedule("zb-h1", 4, 8), w_held=0.5) == [4, 3.5, 3, 2.5]


def test_closed_form_in_flight_counts_hold_for_every_m():
    for name, v in ZB.items():
        spec = SCHEDULES[name]
        for p in (1, 2, 3, 5):
            for m in range(1, 3 * p + 2):
                counted = peak_inflight(build_schedule(name, p, m, v))
                assert list(spec.closed_form_inflight(p, m, v, 0)) == counted, (name, p, m)


def _torch_orders(cls, p: int, m: int) -> list[list[str]]:
    """torch's per-rank compute orders as our strings: its stage index is our chunk, its
    F/I/W/B are ours, its idle slots (None) are left out, and DualPipeV's OVERLAP_F_B (a
    forward and a full backward run together) is its two sub-actions, forward first."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    orders = []
    for ops in get_schedule_ops(cls, p, m):
        flat = []
        for a in ops:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                flat.append(f"{sub.stage_index}{sub.computation_type.value}"
                            f"{sub.microbatch_index}")
        orders.append(flat)
    return orders


@pytest.mark.parametrize("name, cls_name", [("zb-v", "ScheduleZBVZeroBubble"),
                                            ("dualpipev", "ScheduleDualPipeV")])
def test_orders_equal_torch_pipelining(name, cls_name):
    """Our orders equal torch.distributed.pipelining's, action for action. torch refuses
    DualPipeV with fewer than 2p micro-batches; at m = p ours is the same construction with
    the paired steady state empty (validated above). ZB-V below 2p - 1 micro-batches (p + 1)
    is the order of 2p - 1 with the missing ones left out, as torch's."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, cls_name)
    for p in (2, 4, 8):
        for m in (p, p + 1, 2 * p - 1, 2 * p, 3 * p):
            ours = [[str(a) for a in acts] for acts in build_schedule(name, p, m, 2).actions]
            if name == "dualpipev" and m < 2 * p:
                with pytest.raises(ValueError, match="at least as many microbatches"):
                    _torch_orders(cls, p, m)
                continue
            assert ours == _torch_orders(cls, p, m), (p, m)


def test_v_schedules_take_two_chunks_per_rank_only():
    for name in ("zb-v", "dualpipev"):
        with pytest.raises(ConfigError, match=rf"^virtual=3: {name} runs 2 chunks per rank"):
            build_schedule(name, 4, 8, 3)
        with pytest.raises(ConfigError, match=rf"^virtual=1: {name} runs 2 chunks per rank"):
            build_schedule(name, 4, 8, 1)
    with pytest.raises(ConfigError, match="has one chunk per rank"):
        build_schedule("zb-h1", 4, 8, 2)


def test_layout_refuses_a_v_schedule_without_two_virtual_stages():
    from tessera.config import Config, ParallelConfig, TrainConfig
    from tessera.layout import validate as validate_layout

    cfg = Config(parallel=ParallelConfig(pp=2, schedule="zb-v"), train=TrainConfig(grad_accum=4))
    cfg.model.n_layers = 4
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=1: zb-v runs 2 chunks"):
        validate_layout(cfg)
    cfg.parallel.virtual_stages = 2
    validate_layout(cfg)
    cfg.parallel.schedule = "zb-h1"
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=2: needs schedule"):
        validate_layout(cfg)


def test_text_grid_and_pictures_show_i_and_w():
    s = build_schedule("zb-h1", 2, 2)
    assert text_grid(s).splitlines() == ["rank 0 | F0 F1 .  I0 W0 I1 W1",
                                         "rank 1 | .  F0 I0 F1 I1 W0 W1"]
    r = simulate(s, StageCosts.units(s))
    trace = chrome_trace(r.timeline)["traceEvents"]
    names = {e["name"] for e in trace if e.get("cat") in ("I", "W")}
    assert "I0 chunk 0 (input grad)" in names and "W1 chunk 1 (weight grad)" in names
    assert all(e["tid"] == 0 for e in trace if e.get("cat") in ("I", "W"))
    base = (0.5, 0.5, 0.5)
    assert len({shade(base, k) for k in ("F", "I", "B")}) == 3  # I has its own shade
    labels = [h.get_label() for h in legend_handles({"F", "I", "W"}, 1)]
    assert "input grad I (mid)" in labels and "weight grad W (dark, dotted)" in labels
    assert "backward (dark)" not in labels


def test_schedule_cli_prints_and_draws_zb_v(tmp_path):
    from typer.testing import CliRunner

    from tessera.cli import app

    result = CliRunner().invoke(app, ["schedule", "--schedule", "zb-v", "--pp", "4",
                                      "--microbatches", "8", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "schedule zb-v: pp=4 virtual=2 microbatches=8 chunks=8" in out
    assert "rank 0 | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0" in out
    assert ("bubble fraction: 0.0625 simulated (backward = 2 x forward, split into I = W = "
            "half of it, free communication); closed form 0.0625") in out
    assert "activation sets per rank: 8 8 8 8" in out
    assert (tmp_path / "zb-v_pp4_v2_m8.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["schedule", "--schedule", "dualpipev", "--virtual", "3"])
    assert bad.exit_code == 2
    assert "error: --virtual=3: dualpipev runs 2 chunks per rank" in bad.output


# -- the planner ----------------------------------------------------------------------------


def test_planner_lower_bound_holds_for_split_backwards():
    """The search prunes by a bound below any schedule's time. After a split-backward rank's
    last action (a W) nothing need follow, so the bound counts no drain there, and the V
    shapes' ranks hold chunks r and 2p-1-r: the bound stays below the simulation. With 1F1B's
    drain it would not (ZB-H1 at p = 4, m = 8, F = I = W: bound 33 > 27)."""
    import random

    from tessera.planner.pipeline import build, lower_bound

    rng = random.Random(0)
    for _ in range(60):
        name = rng.choice(list(ZB))
        p, v = rng.choice([1, 2, 3, 4]), ZB[name]
        m = rng.randint(1, 9)
        n = p * v
        f = [rng.uniform(0.5, 2) for _ in range(n)]
        b = [x * rng.uniform(1.5, 3) for x in f]
        d = [rng.uniform(0, 3) for _ in range(n)]
        lat, ovl = rng.choice([0.0, 0.1, 1.0]), rng.random() < 0.5
        s = build(name, p, m, v)
        sim = simulate(s, StageCosts(forward=f, backward=b, p2p_latency=lat, dp_reduce=d,
                                     dp_overlap=ovl))
        bound = lower_bound(f, b, d, lat if p > 1 else 0.0, ovl, p, m, drain=False,
                            owner=s.chunk_rank)
        assert bound <= sim.step_time * (1 + 1e-12), (name, p, v, m)
    zb = simulate(build("zb-h1", 4, 8, 1), F_I_W)
    assert zb.makespan == 27.0
    assert lower_bound([1.0] * 4, [2.0] * 4, [0.0] * 4, 0.0, True, 4, 8) == 33.0
    assert lower_bound([1.0] * 4, [2.0] * 4, [0.0] * 4, 0.0, True, 4, 8, drain=False) == 27.0


def test_planner_prices_the_v_placement_and_split_backwards():
    """zb-v's rank 0 holds the first and the last chunk (the embedding and the head), where
    interleaved's rank p-1 holds the head; its in-flight count is 2p chunk sets. zb-h1 takes
    1F1B's costs with a third of its bubble, and holds p sets on every rank (the last rank's
    deferred W), so its last stage needs more memory than 1F1B's."""
    from tessera.planner.estimate import estimate, memory_by_rank
    from tessera.planner.hardware import load_hardware
    from tessera.planner.models import load_model
    from tessera.planner.pipeline import rank_chunks
    from tessera.planner.workload import Layout, Workload

    assert rank_chunks("zb-v", 4, 2, 0) == (0, 7) and rank_chunks("dualpipev", 4, 2, 3) == (3, 4)
    assert rank_chunks("interleaved", 4, 2, 0) == (0, 4)
    w = Workload(model=load_model("gpt3-6.7b"), hardware=load_hardware("A100-80GB"), gpus=32,
                 global_batch=64, seq_len=2048)
    v_shape = estimate(w, Layout(dp=8, pp=4, virtual_stages=2, schedule="zb-v"))
    looped = estimate(w, Layout(dp=8, pp=4, virtual_stages=2, schedule="interleaved"))
    assert v_shape.inflight == (8, 8, 8, 8)
    zb_mem, il_mem = memory_by_rank(v_shape), memory_by_rank(looped)
    assert zb_mem[0].params > il_mem[0].params and zb_mem[3].params < il_mem[3].params
    # The planner simulates costs rounded to 6 significant digits (pipeline._normalized), and
    # ZB-H1 reaches its bound exactly: equal up to that rounding.
    assert v_shape.lower_bound <= v_shape.step_time * (1 + 1e-6)
    one = estimate(w, Layout(dp=8, pp=4, schedule="1f1b"))
    zb = estimate(w, Layout(dp=8, pp=4, schedule="zb-h1"))
    assert zb.busy == pytest.approx(one.busy)
    assert zb.inflight == (4, 4, 4, 4) and one.inflight == (4, 3, 2, 1)
    assert memory_by_rank(zb)[3].activations > memory_by_rank(one)[3].activations
    assert (zb.makespan - zb.busy) < 0.5 * (one.makespan - one.busy)
    assert zb.step_time < one.step_time
    assert zb.lower_bound == pytest.approx(zb.step_time, rel=1e-6)


def test_planner_extrapolation_matches_full_simulation():
    """At large m the planner simulates two m a period apart past the warm-up
    (``ScheduleSpec.steady_after_periods``: 1 for zb-h1, 2 for the V shapes) and extrapolates:
    equal to simulating the true m to 1e-5 (costs normalized to 6 significant digits) on the
    planner's cost structure (heavier last chunk, p2p latency, dp reductions)."""
    from tessera.planner.estimate import _per_chunk, estimate
    from tessera.planner.hardware import load_hardware
    from tessera.planner.models import load_model
    from tessera.planner.pipeline import build, time_pipeline
    from tessera.planner.workload import Layout, Workload

    w = Workload(model=load_model("megatron-145.6b"), hardware=load_hardware("A100-80GB"),
                 gpus=384, global_batch=2304, seq_len=2048)
    for name, v in ZB.items():
        L = Layout(dp=6, tp=8, pp=8, virtual_stages=v, micro_batch=1, schedule=name,
                   recompute="selective")
        est = estimate(w, L, simulate=False)
        c = est.costs
        fs, bs, ds = _per_chunk(c)
        costs = StageCosts(forward=fs, backward=bs, p2p_latency=c.p2p_latency,
                           p2p_bytes=c.p2p_bytes, p2p_bandwidth=c.p2p_bandwidth, dp_reduce=ds,
                           dp_overlap=c.dp_overlap)
        fast = time_pipeline(name, L.pp, est.m, v, costs)
        assert len(fast.simulated_m) == 2, name
        full = simulate(build(name, L.pp, est.m, v), costs, timeline=False)
        assert fast.step_time == pytest.approx(full.step_time, rel=1e-5), name
        assert fast.makespan == pytest.approx(full.makespan, rel=1e-5), name
    # Slow transfers (70% of a forward) and a 6% heavier head: zb-h1 is linear in m only from
    # two periods on, the V shapes from up to seven (ScheduleSpec.steady_after_periods).
    for name, v in ZB.items():
        n = 8 * v
        costs = StageCosts(forward=[1.0] * (n - 1) + [1.06], backward=[2.0] * (n - 1) + [2.12],
                           p2p_latency=0.7)
        fast = time_pipeline(name, 8, 400, v, costs)
        assert len(fast.simulated_m) == 2, name
        full = simulate(build(name, 8, 400, v), costs, timeline=False)
        assert fast.makespan == pytest.approx(full.makespan, rel=1e-5), name
