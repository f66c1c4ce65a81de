"""Rank maps of the (pp, dp, cp, tp) grid, and the process groups built from them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config import ConfigError, ParallelConfig
from tessera.testing import run_ranks
from tessera.topology import Topology, axis_groups, rank_grid


def test_tp_fastest_varying():
    topo = Topology(dp=2, tp=2, pp=2)
    assert topo.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.all_groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert topo.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}


@pytest.mark.parametrize("dp, tp, pp, cp", [(1, 1, 1, 1), (8, 1, 1, 1), (1, 8, 1, 1),
                                            (2, 2, 2, 1), (1, 2, 2, 2), (3, 2, 1, 1),
                                            (2, 1, 3, 2)])
def test_groups_partition_the_world(dp, tp, pp, cp):
    grid = rank_grid(dp, tp, pp, cp)
    world = dp * tp * pp * cp
    assert torch.equal(grid.flatten(), torch.arange(world))
    for axis, size in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
        groups = axis_groups(grid, axis)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))
        topo = Topology(dp=dp, tp=tp, pp=pp, cp=cp)
        for g in groups:  # members differ only in this axis's coordinate
            others = [{k: v for k, v in topo.coords(r).items() if k != axis} for r in g]
            assert all(o == others[0] for o in others)


def test_dp_cp_group_holds_every_replica():
    """'dpcp': the ranks at one (pp, tp) over dp and cp, over which context parallelism
    averages gradients; with cp = 1 it is the dp group."""
    topo = Topology(dp=2, tp=2, pp=2, cp=2)
    assert topo.all_groups("dpcp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                       [9, 11, 13, 15]]
    assert topo.size("dpcp") == 4
    assert Topology(dp=4, tp=2).all_groups("dpcp") == Topology(dp=4, tp=2).all_groups("dp")


def _dpcp_sums():
    topo = Topology.build(ParallelConfig(dp=2, cp=2, tp=2))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=topo.group("dpcp"))
    return t.item()


@pytest.mark.multiprocess
def test_dp_cp_process_group_reduces_over_its_ranks():
    topo = Topology(dp=2, cp=2, tp=2)
    for rank, total in enumerate(run_ranks(_dpcp_sums, 8)):
        assert total == sum(topo.ranks("dpcp", rank))


def test_expert_groups_fold_into_dp():
    topo = Topology(dp=4, tp=2, ep=2)
    assert topo.all_groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]


def _group_sums():
    topo = Topology.build(ParallelConfig(dp=2, tp=2, pp=2))
    out = {}
    for axis in ("pp", "dp", "tp", "ep", "mp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=topo.group(axis))
        out[axis] = t.item()
    return out, topo.coords()


@pytest.mark.multiprocess
def test_process_groups_reduce_over_their_ranks():
    results = run_ranks(_group_sums, 8)
    topo = Topology(dp=2, tp=2, pp=2)
    for rank, (sums, coords) in enumerate(results):
        assert coords == topo.coords(rank)
        for axis, total in sums.items():
            assert total == sum(topo.ranks(axis, rank)), (rank, axis)


def _mismatch():
    Topology.build(ParallelConfig(dp=3))


@pytest.mark.multiprocess
def test_layout_must_match_world():
    with pytest.raises(AssertionError, match="dp\\*tp\\*pp\\*cp=3 must equal the world size 2"):
        run_ranks(_mismatch, 2)
    with pytest.raises(ConfigError):
        Topology.build(ParallelConfig(dp=2))  # a single process is a world of one
