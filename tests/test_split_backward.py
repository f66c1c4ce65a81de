"""Split backward in the schedule IR: I (input gradient) and W (weight gradient) actions, their
dependencies, lowering, validation, sharding actions, simulated costs and in-flight counts."""

from __future__ import annotations

import pytest

from tessera.pipeline.schedule import (
    Action,
    B,
    F,
    I,
    Kind,
    Schedule,
    ScheduleError,
    W,
    add_sharding_actions,
    forward_only,
    input_keys,
    lower_comms,
    output_key,
    parse,
)
from tessera.pipeline.simulator import StageCosts, peak_inflight, simulate
from tessera.pipeline.validator import validate


def split_1f1b(pp: int, m: int, w_delay: int = 0) -> Schedule:
    """1F1B with each B split into I, then its W `w_delay` micro-batches later on every rank."""
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [F(r, mb) for mb in range(warmup)]
        # The backward slot of 1F1B's step i: I(i), and the W from w_delay steps before.
        slots = [[I(r, i)] + ([W(r, i - w_delay)] if i >= w_delay else []) for i in range(m)]
        for i in range(m - warmup):
            order += [F(r, warmup + i), *slots[i]]
        for slot in slots[m - warmup:]:
            order += slot
        order += [W(r, i) for i in range(max(m - w_delay, 0), m)]
        orders.append(order)
    return Schedule("split", orders, pp, m, tuple(range(pp)))


def test_kinds_and_string_form():
    assert I(2, 3) == Action(2, Kind.I, 3) and I(2, 3) is I(2, 3)
    assert str(I(0, 3)) == "0I3" and str(W(0, 3)) == "0W3"
    assert Action.parse("0I3") == I(0, 3) and Action.parse("12W0") == W(12, 0)
    assert Kind.I.is_compute and Kind.W.is_compute and not Kind.I.is_p2p
    assert [k.is_backward for k in (Kind.F, Kind.B, Kind.I, Kind.W)] == [False, True, True, True]
    assert [k.ends_weight_grad for k in (Kind.F, Kind.B, Kind.I, Kind.W)] == [
        False, True, False, True]
    s = split_1f1b(3, 4, w_delay=1)
    assert parse(s.to_string()) == s and s.split_backward and not s.forward_only
    assert not split_1f1b(2, 2).compute_only().forward_only


def test_dependencies_name_the_input_gradient_whoever_makes_it():
    # I and B both make chunk c's input gradient; I waits for the next chunk's, W for its I.
    assert output_key(B(1, 0)) == output_key(I(1, 0)) == (1, "I", 0)
    assert output_key(W(1, 0)) == (1, "W", 0) and output_key(F(1, 0)) == (1, "F", 0)
    assert input_keys(1, Kind.I, 0, 3) == [(1, "F", 0), (2, "I", 0)]
    assert input_keys(2, Kind.I, 0, 3) == [(2, "F", 0)]  # the last chunk starts from the loss
    assert input_keys(1, Kind.W, 5, 3) == [(1, "I", 5)]
    assert input_keys(1, Kind.B, 0, 3) == input_keys(1, Kind.I, 0, 3)


def test_lowering_sends_input_gradients_from_i_and_nothing_from_w():
    low = lower_comms(split_1f1b(2, 2))
    assert low.to_string().splitlines()[1:] == [
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1",
        "rank 1: 1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1",
    ]
    validate(low)
    assert forward_only(low).forward_only
    assert all(a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)
               for acts in forward_only(low).actions for a in acts)


def test_mixed_b_and_split_backwards_validate():
    # Chunk 1 uses B, chunk 0 I then W: chunk 0's I waits for chunk 1's B.
    s = parse("rank 0: 0F0 0F1 0I0 0I1 0W1 0W0\nrank 1: 1F0 1B0 1F1 1B1")
    validate(s)
    # Rank 1: F0 [1, 2], B0 [2, 4], F1 [4, 5], B1 [5, 7]; rank 0: I0 [4, 5] after 1B0,
    # I1 [7, 8] after 1B1, then W1, W0 (half a backward each).
    r = simulate(s, StageCosts(forward=1, backward=2))
    assert [(e.kind, e.microbatch, e.start) for e in r.timeline if e.rank == 0][2:] == [
        ("I", 0, 4.0), ("I", 1, 7.0), ("W", 1, 8.0), ("W", 0, 9.0)]
    assert r.makespan == 10.0


@pytest.mark.parametrize("text, message", [
    ("rank 0: 0F0 0W0 0I0", "weight gradient 0W0 comes before its input gradient 0I0"),
    ("rank 0: 0I0 0F0 0W0", "backward 0I0 comes before its forward"),
    ("rank 0: 0F0 0I0", r"0W0 \(the weight gradient \(W\) after I of micro-batch 0 on chunk 0\)"),
    ("rank 0: 0F0 0W0", r"0I0 \(the input gradient \(I\) before W"),
    ("rank 0: 0F0 0B0 0W0", "has 0B0 and 0W0: a backward is either B, or I then W"),
    ("rank 0: 0F0 0B0 0I0 0W0", "has 0B0 and 0I0"),
    ("rank 0: 0F0 0I0 0W0 0W0", "appears twice"),
])
def test_validator_refuses_broken_split_backwards(text, message):
    with pytest.raises(ScheduleError, match=message):
        validate(parse(text))


def test_i_waits_for_the_next_chunks_input_gradient():
    # Rank 0's chunk-0 I needs chunk 1's I, which rank 1 runs only after chunk 0's I: stuck.
    s = parse("rank 0: 0F0 0I0 0W0\nrank 1: 1F0 1W0 1I0")
    with pytest.raises(ScheduleError, match="comes before its input gradient"):
        validate(s)
    s = Schedule("x", [[F(0, 0), I(0, 0), W(0, 0)], [F(1, 0), I(1, 0), W(1, 0)]], 2, 1)
    validate(s)
    stuck = Schedule("x", [[F(0, 0), F(0, 1), I(0, 1), I(0, 0), W(0, 0), W(0, 1)],
                           [F(1, 0), I(1, 0), W(1, 0), F(1, 1), W(1, 1), I(1, 1)]], 2, 2)
    with pytest.raises(ScheduleError, match="comes before its input gradient"):
        validate(stuck)
    order_deadlock = Schedule("x", [[F(0, 0), F(0, 1), I(0, 1), I(0, 0), W(0, 0), W(0, 1)],
                                    [F(1, 0), F(1, 1), I(1, 0), I(1, 1), W(1, 0), W(1, 1)]],
                              2, 2)
    validate(order_deadlock)  # the receives come in send order, rank 0 just waits
    deadlock = Schedule("x", [[F(0, 0), I(0, 0), F(0, 1), W(0, 0), I(0, 1), W(0, 1)],
                              [F(1, 0), F(1, 1), I(1, 1), I(1, 0), W(1, 0), W(1, 1)]], 2, 2)
    with pytest.raises(ScheduleError, match="deadlocks|would be received"):
        validate(deadlock)


def test_reduction_follows_the_last_w_not_the_last_i():
    s = parse("rank 0: 0F0 0F1 0I0 0I1 0W0 0W1")
    sharded = add_sharding_actions(s)
    assert " ".join(map(str, sharded.actions[0])) == (
        "0UNSHARD 0F0 0F1 0I0 0I1 0W0 0W1 0REDUCE_GRAD 0RESHARD")
    validate(sharded)
    early = parse("rank 0: 0UNSHARD 0F0 0F1 0I0 0I1 0W0 0REDUCE_GRAD 0W1 0RESHARD")
    with pytest.raises(ScheduleError, match="0REDUCE_GRAD comes before 0W1"):
        validate(early)
    after_i = parse("rank 0: 0UNSHARD 0F0 0F1 0B0 0I1 0REDUCE_GRAD 0W1 0RESHARD")
    with pytest.raises(ScheduleError, match="comes before 0W1"):
        validate(after_i)


def test_simulator_costs_i_and_w_separately():
    s = split_1f1b(1, 2)  # one rank: F0 I0 W0 F1 I1 W1
    r = simulate(s, StageCosts(forward=1.0, backward=5.0, input_grad=2.0, weight_grad=0.5))
    assert r.makespan == 2 * (1.0 + 2.0 + 0.5)
    assert [(e.kind, e.end - e.start) for e in r.timeline[:3]] == [("F", 1.0), ("I", 2.0),
                                                                   ("W", 0.5)]
    # Default: I and W split the backward in halves; B keeps its own cost.
    assert simulate(s, StageCosts(forward=1.0, backward=3.0)).makespan == 2 * (1.0 + 3.0)
    assert StageCosts.units(s).cost(Kind.W, 0) == 1.0
    assert StageCosts.units(s).cost(Kind.B, 0) == 2.0
    assert StageCosts.units(parse("rank 0: 0F0 0B0")).cost(Kind.B, 0) == 1.0


def test_dp_reduction_starts_after_the_last_w():
    s = parse("rank 0: 0F0 0F1 0I0 0I1 0W0 0W1")
    r = simulate(s, StageCosts(forward=1, backward=2, dp_reduce=4.0))
    (dp,) = [e for e in r.timeline if e.kind == "dp"]
    assert dp.start == 6.0 and r.step_time == 10.0


def test_peak_inflight_counts_sets_until_their_w():
    s = split_1f1b(2, 4, w_delay=2)
    # Rank 1: F0 I0 F1 I1 F2 I2 W0 F3 ... holds three sets (two waiting for W) at F2; rank 0:
    # F0 F1 I0 F2 I1 F3 I2 W0 ..., four at F3 (two waiting for W); 3 if those count half.
    assert peak_inflight(s) == [4, 3]
    assert peak_inflight(s, w_held=0.5) == [3, 2]
    assert peak_inflight(s, w_held=0.0) == [2, 1]
    assert peak_inflight(split_1f1b(2, 4)) == [2, 1]  # W right after I: 1F1B's counts
