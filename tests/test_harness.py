"""The multi-rank harness itself: results, failures with the failing rank's traceback, hangs,
and collectives that time out in seconds."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tessera.testing import RankFailure, run_ranks

pytestmark = pytest.mark.multiprocess


def _sum_ranks(offset):
    t = torch.tensor([dist.get_rank() + offset], dtype=torch.float32)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _rank_two_raises():
    if dist.get_rank() == 2:
        raise ValueError("planted failure on rank two")
    dist.barrier()


def _rank_one_hangs():
    if dist.get_rank() == 1:
        time.sleep(60)


def _rank_one_skips_the_all_reduce():
    group = dist.new_group([0, 1])  # like every Topology axis: a group made after start-up
    if dist.get_rank() == 1:
        time.sleep(60)  # never joins: a collective the other rank waits in forever
        return
    dist.all_reduce(torch.ones(1), group=group)


def _both_receive_first():
    """A pipeline-style deadlock: each rank waits for the other's activation before sending."""
    peer = 1 - dist.get_rank()
    buf = torch.empty(4)
    dist.recv(buf, src=peer)
    dist.send(buf, dst=peer)


def test_results_in_rank_order():
    assert run_ranks(_sum_ranks, 3, args=(10,)) == [(0, 33.0), (1, 33.0), (2, 33.0)]


def test_failure_carries_rank_and_traceback():
    with pytest.raises(RankFailure, match="rank 2 failed") as e:
        run_ranks(_rank_two_raises, 3, timeout=60)
    assert "planted failure on rank two" in str(e.value)
    assert "Traceback" in str(e.value)


def test_hang_is_reported_not_waited_out():
    t0 = time.monotonic()
    # Rank 0 is stuck too: it waits for rank 1 in the closing barrier.
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\] of 2 did not finish within 3s"):
        run_ranks(_rank_one_hangs, 2, timeout=3)
    # A deadlock guard, not a stopwatch: reported well before rank 1's 60 s sleep would end
    # (waited out, the run would end without a failure), with room for a busy machine.
    assert time.monotonic() - t0 < 45


def test_a_hung_collective_fails_in_seconds_naming_the_ranks():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_ranks(_rank_one_skips_the_all_reduce, 2, timeout=90, collective_timeout=2)
    elapsed = time.monotonic() - t0
    # Rank 0's all-reduce gives up after the collective timeout, and the report names rank 1,
    # still asleep, as not finished; before rank 1's 60 s sleep ends and well before the 90 s
    # run timeout (gloo's own default is 30 minutes): a bound between seconds and minutes,
    # with room for a busy machine, not a window.
    assert "rank 0 failed (ranks [1] of 2 had not finished" in str(e.value), str(e.value)
    assert "all_reduce" in str(e.value) or "Timed out" in str(e.value), str(e.value)
    assert elapsed < 45, elapsed


def test_a_point_to_point_deadlock_times_out_from_the_environment(monkeypatch):
    monkeypatch.setenv("TESSERA_TEST_COLLECTIVE_TIMEOUT", "2")
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank [01] failed") as e:
        run_ranks(_both_receive_first, 2, timeout=90)
    assert "_both_receive_first" in str(e.value)  # the traceback shows where it hung
    assert time.monotonic() - t0 < 60  # the 2 s collective timeout, not the 90 s run's
