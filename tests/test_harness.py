"""The multi-rank harness itself: results, failures with the failing rank's traceback, hangs."""

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
    assert time.monotonic() - t0 < 20
