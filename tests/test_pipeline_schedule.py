"""Pipeline schedules without processes: IR, string form, validator, simulator closed forms."""

from __future__ import annotations

import itertools

import pytest
import torch

from tessera.config import ModelConfig
from tessera.errors import ConfigError
from tessera.model import build_model
from tessera.pipeline import validator
from tessera.pipeline.partition import Chunk, balance, partition
from tessera.pipeline.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    add_sharding_actions,
    lower_comms,
    parse,
)
from tessera.pipeline.schedules import (
    SCHEDULES,
    ScheduleSpec,
    build_schedule,
    closed_form_bubble,
    register,
)
from tessera.pipeline.simulator import StageCosts, peak_inflight, prepare, simulate
from tessera.pipeline.timeline import text_grid
from tessera.pipeline.validator import validate

VIRTUAL = {"interleaved": (1, 2, 3), "interleaved-lean": (1, 2, 3), "bfs": (1, 2, 3),
           "zb-v": (2,), "dualpipev": (2,)}
INTERLEAVED = ("interleaved", "interleaved-lean")


def grid_cases():
    """(name, p, v, m) for every schedule over a grid, keeping only what the schedule allows."""
    for name in SCHEDULES:
        for p, m in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 5, 8, 9, 12)):
            for v in VIRTUAL.get(name, (1,)):
                if SCHEDULES[name].refusal(p, m, v):
                    continue
                yield name, p, v, m


def test_action_string_form():
    assert str(Action(1, Kind.F, 0)) == "1F0"
    assert Action.parse("12RECV_B3") == Action(12, Kind.RECV_B, 3)
    with pytest.raises(ScheduleError, match="expected"):
        Action.parse("F0")


def test_every_generated_schedule_round_trips_through_the_string_form():
    for name, p, v, m in grid_cases():
        s = build_schedule(name, p, m, v)
        assert (s.n_ranks, s.n_chunks, s.n_microbatches, s.virtual) == (p, p * v, m, v)
        assert parse(s.to_string()) == s, (name, p, v, m)
        low = lower_comms(s)
        assert parse(low.to_string()) == low, (name, p, v, m)
        validate(low)


def test_simulated_bubble_equals_closed_forms():
    # Equal costs, free communication; backward twice the forward (the closed forms do not
    # depend on the ratio). Costs per chunk are 1/v of a rank's share, as with v chunks a rank.
    for name, p, v, m in grid_cases():
        r = simulate(build_schedule(name, p, m, v), StageCosts(forward=1 / v, backward=2 / v))
        expected = {"naive": p - 1, "gpipe": (p - 1) / m, "1f1b": (p - 1) / m,
                    "interleaved": (p - 1) / (v * m),
                    "interleaved-lean": (p - 1) / (v * m)}.get(name)
        if name == "bfs" and m >= p:
            expected = (p - 1) / (v * m)  # breadth-first matches interleaved once m >= p
        if name in ("zb-h1", "zb-v", "dualpipev"):
            # Split backwards at F = I = W (tests/test_zero_bubble.py): the closed forms
            # where they hold, m >= p (zb-h1) and m >= 2p (the V shapes).
            expected = closed_form_bubble(name, p, m, v)
        if expected is not None:
            assert r.bubble_fraction == pytest.approx(expected, abs=1e-9), (name, p, v, m)
        assert r.compute_time == pytest.approx(m * 3.0)
        assert r.step_time == pytest.approx(r.makespan)


def test_peak_inflight_closed_forms():
    for name, p, v, m in grid_cases():
        peaks = simulate(build_schedule(name, p, m, v), StageCosts(forward=1, backward=1)
                         ).peak_inflight
        if name == "gpipe":
            assert peaks == [m] * p
        elif name == "1f1b":
            assert peaks == [min(p - r, m) for r in range(p)]
            assert max(peaks) <= p
        elif name == "naive":
            assert peaks == [1] * p
        elif name == "bfs":
            assert peaks == [v * m] * p
        elif name == "interleaved-lean":  # 1F1B's warm-up plus the other chunks' first group
            assert peaks == [min(v * m, p - r + (v - 1) * p) for r in range(p)]


def test_lean_interleaving_holds_fewer_sets_and_pays_for_unhidden_transfers():
    """interleaved-lean runs Megatron's order with p - r - 1 fewer warm-up forwards: the same
    bubble with free transfers, p - r - 1 fewer sets at every rank's peak (the planner's closed
    form agrees), and a longer step once transfers cost time (Megatron's extra forwards are
    what hide them). Grouped too: G >= p, m a multiple of G."""
    from tessera.planner.pipeline import inflight

    for p, v, m, g in grouped_cases():
        lean = build_schedule("interleaved-lean", p, m, v, g)
        assert parse(lean.to_string()) == lean, (p, v, m, g)
        validate(lower_comms(lean))
        counted = simulate(lean, StageCosts(forward=1, backward=1)).peak_inflight
        assert counted == [min(v * m, p - r + (v - 1) * g) for r in range(p)] == \
            list(inflight("interleaved-lean", p, m, v, g)), (p, v, m, g)
        megatron = build_schedule("interleaved", p, m, v, g)
        if m > p:
            held = simulate(megatron, StageCosts(forward=1, backward=1)).peak_inflight
            assert [a - b for a, b in zip(held, counted, strict=True)] == \
                [min(p - r - 1, v * m - c) for r, c in enumerate(counted)], (p, v, m, g)
        free = StageCosts(forward=1 / v, backward=2 / v)
        assert simulate(lean, free).makespan == pytest.approx(
            simulate(megatron, free).makespan, abs=1e-9), (p, v, m, g)
    p, v, m = 4, 2, 8
    paid = StageCosts(forward=1 / v, backward=2 / v, p2p_latency=0.1)
    assert simulate(build_schedule("interleaved-lean", p, m, v), paid).makespan > \
        simulate(build_schedule("interleaved", p, m, v), paid).makespan + 1.0


def grouped_cases():
    """(p, v, m, G) for interleaved with micro-batch groups of G (Megatron-LM's
    microbatch_group_size_per_vp_stage, Llama 3's N) at and above p."""
    for p, v in itertools.product((1, 2, 3, 4), (2, 3)):
        for g in sorted({p, p + 1, 2 * p}):
            for m in (g, 2 * g, 3 * g):
                yield p, v, m, g


def test_interleaved_micro_batch_groups():
    """Every grouped schedule validates (no deadlock, every send matched) and round-trips; a
    group of p is Megatron's default schedule action for action; the peak in-flight sets per
    rank are 2(p - r - 1) + (v - 1)·G + 1 (Megatron's warm-up plus the first steady forward;
    all v·m when m = p), which the planner's closed form gives; the bubble is never below the
    default's. At p = 2 one direction between the two ranks carries both activations and
    gradients, whose order differs from the consumer's when G != p: the lowering receives a
    message the peer sent earlier first (NCCL's FIFO order), which validate checks."""
    from tessera.planner.pipeline import inflight

    for p, v, m, g in grouped_cases():
        s = build_schedule("interleaved", p, m, v, g)
        assert parse(s.to_string()) == s, (p, v, m, g)
        validate(lower_comms(s))
        counted = simulate(s, StageCosts(forward=1, backward=1)).peak_inflight
        want = [v * m] * p if m == p else \
            [min(v * m, 2 * (p - r - 1) + (v - 1) * g + 1) for r in range(p)]
        assert counted == want == list(inflight("interleaved", p, m, v, g)), (p, v, m, g)
        if m % p == 0:
            default = build_schedule("interleaved", p, m, v)
            if g == p:
                assert s.actions == default.actions
            costs = StageCosts(forward=1 / v, backward=2 / v)
            assert simulate(s, costs).bubble_fraction >= \
                simulate(default, costs).bubble_fraction - 1e-12, (p, v, m, g)


def test_micro_batch_group_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match=r"microbatches=6: .* multiple of the group size 4"):
        build_schedule("interleaved", 2, 6, 2, 4)
    with pytest.raises(ConfigError, match=r"group=2: micro-batch groups must hold at least pp=4"):
        build_schedule("interleaved", 4, 8, 2, 2)
    with pytest.raises(ConfigError, match=r"group=2: schedule '1f1b' has no micro-batch groups"):
        build_schedule("1f1b", 2, 4, 1, 2)
    with pytest.raises(ConfigError, match=r"group=-1: must be a non-negative integer"):
        build_schedule("interleaved", 2, 4, 2, -1)


def test_breadth_first_beats_depth_first_when_dp_reduction_is_costly():
    # Lamy-Poirier (2023): breadth-first finishes each chunk's backwards early, so its gradient
    # reduction overlaps the remaining backwards. With p=4, v=4, m=16, a chunk's backwards
    # take 2 time units in depth-first's tail but 8 in breadth-first's; a 3-unit reduction per
    # chunk fits behind breadth-first's compute, not depth-first's.
    p, v, m = 4, 4, 16
    costs = StageCosts(forward=1 / v, backward=2 / v, dp_reduce=3.0, dp_overlap=True)
    df = simulate(build_schedule("interleaved", p, m, v), costs)
    bf = simulate(build_schedule("bfs", p, m, v), costs)
    assert df.makespan == pytest.approx(bf.makespan)  # same bubble without dp
    assert bf.exposed_dp_time == pytest.approx(3.0)  # only the last chunk's reduction shows
    assert df.exposed_dp_time == pytest.approx(6.0)
    assert bf.step_time < df.step_time
    # Without overlap neither can hide anything: all 4 reductions come after the compute.
    flat = StageCosts(forward=1 / v, backward=2 / v, dp_reduce=3.0, dp_overlap=False)
    assert simulate(build_schedule("bfs", p, m, v), flat).exposed_dp_time == pytest.approx(12)
    assert simulate(build_schedule("interleaved", p, m, v), flat).exposed_dp_time == \
        pytest.approx(12)


def test_one_preparation_times_a_schedule_under_many_costs():
    # The planner prepares a schedule once and times it under each layout's costs: every
    # result must equal a fresh simulation's, whatever was timed with it before.
    schedule = add_sharding_actions(build_schedule("interleaved", 4, 8, 2), prefetch=1)
    prepared = prepare(schedule)
    n = schedule.n_chunks
    for k in range(3):
        costs = StageCosts(forward=[1 + 0.1 * c * k for c in range(n)],
                           backward=[2 + 0.3 * (n - c) * k for c in range(n)],
                           dp_reduce=0.5 * k, unshard=0.2 * k, p2p_latency=0.05 * k,
                           dp_overlap=k % 2 == 0)
        fresh, reused = simulate(schedule, costs), simulate(schedule, costs, prepared=prepared)
        assert reused.step_time == fresh.step_time and reused.makespan == fresh.makespan
        assert reused.timeline == fresh.timeline
        assert reused.peak_inflight == fresh.peak_inflight == peak_inflight(schedule)


def test_p2p_cost_delays_cross_rank_dependencies():
    s = build_schedule("gpipe", 2, 1)
    r = simulate(s, StageCosts(forward=1, backward=1, p2p_latency=0.5, p2p_bytes=100,
                               p2p_bandwidth=200))
    assert r.makespan == pytest.approx(4 + 2 * 1.0)  # one transfer each way, 0.5 + 0.5 s


def test_validator_catches_planted_deadlock():
    # Rank 0 waits for rank 1's gradient before sending the activation rank 1 needs.
    text = ("rank 0: 0F0 0RECV_B0 0B0 0SEND_F0\n"
            "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(parse(text))
    # Compute-only form: rank 1 wants micro-batch 1 first, which rank 0 only sends after its
    # backward of micro-batch 0, which needs rank 1's backward of micro-batch 0: a cycle.
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1F0 1B0 1B1"))


def test_validator_catches_planted_missing_receive():
    text = lower_comms(build_schedule("1f1b", 2, 2)).to_string().replace(" 1RECV_F1", "")
    with pytest.raises(ScheduleError, match="no matching receive 1RECV_F1"):
        validate(parse(text))


def test_validator_catches_structural_errors():
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(parse("rank 0: 0B0 0F0"))
    with pytest.raises(ScheduleError, match="missing"):
        validate(parse("# microbatches=2\nrank 0: 0F0 0B0"))
    with pytest.raises(ScheduleError, match="one rank"):
        validate(parse("rank 0: 0F0 0B0 1F0\nrank 1: 1F0 1B0"))
    with pytest.raises(ScheduleError, match="same order"):
        validate(parse("rank 0: 0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1\n"
                       "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"))



def test_validator_simulates_each_schedule_once(monkeypatch):
    """build_schedule checks a schedule and its lowered form; checking a copy, or the lowered
    form (what the runtime runs), simulates nothing again. A schedule that failed, or one
    changed since it passed, is checked again."""
    simulated: list[Schedule] = []
    blocking = validator._simulate_blocking
    monkeypatch.setattr(validator, "_PASSED", {})
    monkeypatch.setattr(validator, "_simulate_blocking",
                        lambda s: simulated.append(s) or blocking(s))
    s = build_schedule("gpipe", 2, 2)
    assert [x.is_lowered for x in simulated] == [False, True]
    validate(build_schedule("gpipe", 2, 2))
    validate(lower_comms(s))
    assert len(simulated) == 2
    deadlocked = "rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1F0 1B0 1B1"
    for _ in range(2):
        with pytest.raises(ScheduleError, match="deadlocks"):
            validate(parse(deadlocked))
    assert len(simulated) == 4
    s.actions[0].reverse()
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(s)

def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"microbatches=3: interleaved 1F1B needs .* pp=2"):
        build_schedule("interleaved", 2, 3, 2)
    with pytest.raises(ConfigError, match="virtual=2"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ConfigError, match="schedule='zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ConfigError, match="pp=0"):
        build_schedule("gpipe", 0, 4)


def test_new_schedules_plug_in_through_the_registry():
    # A toy schedule: GPipe with backwards in reverse micro-batch order.
    def reverse_gpipe(pp, m, v):
        return [[Action(r, Kind.F, i) for i in range(m)] +
                [Action(r, Kind.B, i) for i in reversed(range(m))] for r in range(pp)]

    spec = register(ScheduleSpec(name="test-reverse", generate=reverse_gpipe,
                                 description="test"))
    try:
        s = build_schedule("test-reverse", 3, 4)
        assert simulate(s, StageCosts(forward=1, backward=1)).bubble_fraction == \
            pytest.approx(2 / 4)
        # The planner counts what it has no closed form for, and waits the longer transient
        # before extrapolating in m.
        from tessera.planner.pipeline import UNKNOWN_STEADY_AFTER_PERIODS, inflight

        assert spec.closed_form_inflight is None
        assert spec.steady_after_periods == UNKNOWN_STEADY_AFTER_PERIODS == 2
        assert inflight("test-reverse", 3, 4) == (4, 4, 4)
    finally:
        del SCHEDULES[spec.name]


def test_config_accepts_exactly_the_registered_schedules():
    """The config checks `parallel.schedule` against the registry: every built-in name is
    accepted, a schedule added with register() becomes trainable by name, and once removed it
    is refused naming the field and the registered names."""
    from tessera.config import ParallelConfig
    from tessera.errors import ConfigError

    for name in SCHEDULES:
        ParallelConfig(schedule=name, virtual_stages=SCHEDULES[name].min_virtual)
    spec = register(ScheduleSpec(name="test-gpipe-copy", generate=SCHEDULES["gpipe"].generate,
                                 description="test"))
    try:
        assert ParallelConfig(pp=2, schedule=spec.name).schedule == spec.name
    finally:
        del SCHEDULES[spec.name]
    with pytest.raises(ConfigError, match=r"^parallel.schedule='test-gpipe-copy': must be one "
                                          r"of naive, gpipe, 1f1b"):
        ParallelConfig(schedule=spec.name)


def test_text_grid_shows_bubbles():
    grid = text_grid(build_schedule("gpipe", 2, 2))
    assert grid.splitlines() == ["rank 0 | F0 F1 .  .  B0 B1",
                                 "rank 1 | .  F0 F1 B0 B1 ."]
    assert isinstance(build_schedule("interleaved", 2, 2, 2), Schedule)


# ---------------------------------------------------------------------------------------------
# Partitioning


def test_balance_splits_evenly_and_shifts_blocks_away_from_a_heavy_head():
    assert balance([1.0] * 8, 4) == [2, 2, 2, 2]
    assert balance([1.0] * 8, 2, last_extra=2.0) == [5, 3]
    assert balance([1.0] * 7, 3, last_extra=2.0) == [3, 3, 1]
    assert balance([1.0] * 7, 3, first_extra=2.0) == [1, 3, 3]
    assert balance([1.0, 1.0, 4.0, 1.0, 1.0], 3) == [2, 1, 2]
    # A real configuration: a 32k vocabulary's head outweighs a block at d_model 256.
    cfg = ModelConfig(vocab_size=32000, d_model=256, n_layers=8, n_heads=4)
    sizes = [len(s.layers) for s in partition(cfg, 4, seq_len=256)]
    assert sum(sizes) == 8 and sizes[-1] < sizes[0]


def test_partition_explicit_split_and_errors():
    cfg = ModelConfig(n_layers=6)
    specs = partition(cfg, 3, split=[1, 3, 2])
    assert [list(s.layers) for s in specs] == [[0], [1, 2, 3], [4, 5]]
    assert [(s.has_embedding, s.has_head) for s in specs] == [(True, False), (False, False),
                                                               (False, True)]
    with pytest.raises(ConfigError, match="stages exceed model.n_layers=6"):
        partition(cfg, 7)
    with pytest.raises(ConfigError, match="must add up to model.n_layers=6"):
        partition(cfg, 3, split=[1, 1, 1])
    with pytest.raises(ConfigError, match="at least one block"):
        partition(cfg, 3, split=[0, 3, 3])


@pytest.mark.parametrize("tie", [False, True])
def test_chunks_start_from_the_reference_weights_and_compose_to_it(tie):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, max_seq_len=16,
                      tie_embeddings=tie)
    ref = build_model(cfg, seed=3)
    specs = partition(cfg, 3)
    # Chunks 0 and 2 on different "ranks": the last holds a copy of a tied embedding.
    chunks = [Chunk(cfg, s, seed=3) for s in specs]
    ref_params = dict(ref.named_parameters())
    seen = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            ref_name = chunk.reference_name(name)
            assert torch.equal(p, ref_params[ref_name]), name
            seen.add(ref_name)
    assert seen == set(ref_params)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    x = tokens
    for chunk in chunks:
        x = chunk(x)
    assert torch.equal(x, ref(tokens))  # same ops in the same order: bitwise equal
    # Chunks 0 and 2 on one rank: the head uses that rank's embedding, one parameter.
    first = Chunk(cfg, specs[0], seed=3)
    last = Chunk(cfg, specs[2], seed=3, shared_embedding=first.tok_embeddings)
    if tie:
        assert last.head_weight() is first.tok_embeddings.weight
        assert "output.weight" not in dict(last.named_parameters())
