"""Rank maps of the (pp, dp, cp, tp) grid, and the process groups built from them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config import ParallelConfig
from tessera.errors import ConfigError
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


def _solo_model_grads():
    """Each rank trains the tiny model alone on its own batch inside a 2-rank world (and a
    data-parallel model beside it, to be sure the world's groups exist and are not used)."""
    from tessera.config_io import make_config
    from tessera.parallelize import parallelize
    from tessera.step import Executor

    cfg = make_config("tiny", parallel=dict(dp=1), train=dict(grad_accum=1, micro_batch_size=2))
    torch.manual_seed(cfg.train.seed)
    ex = Executor(parallelize(cfg, Topology.solo(), torch.device("cpu")))
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1), generator=g)
    loss = ex.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    return loss, {n: t.clone() for n, t in ex.model.full_grads().items()}


@pytest.mark.multiprocess
def test_solo_topology_reaches_no_other_rank():
    """Topology.solo: a model built on it inside a 2-rank world is the single-process model:
    each rank's loss and gradients on its own batch equal one process's on that batch,
    bitwise (the same kernels on the same shapes, and nothing averaged with the other rank)."""
    from tessera.config_io import make_config
    from tessera.model import build_model, cross_entropy

    cfg = make_config("tiny", parallel=dict(dp=1), train=dict(grad_accum=1, micro_batch_size=2))
    results = run_ranks(_solo_model_grads, 2)
    for rank, (loss, grads) in enumerate(results):
        model = build_model(cfg.model, cfg.train.seed)
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1), generator=g)
        want = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        want.backward()
        assert loss == want.item()
        for name, p in model.named_parameters():
            assert torch.equal(grads[name], p.grad), (rank, name)
    assert results[0][0] != results[1][0]  # different batches: nothing was averaged
