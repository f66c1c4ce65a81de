"""The process topology: which rank does what, built once and passed explicitly.

Ranks are laid out on a grid ``arange(world).view(pp, dp, cp, tp)``: tp varies fastest, so a
tensor-parallel group is a block of consecutive ranks (one node, on GPUs, where the fast links
are), then cp, then dp, and pp slowest (pipeline sends cross nodes, which need least bandwidth).
Expert parallelism folds into the dp axis: the ``ep`` group of a rank is the block of ``ep``
consecutive dp indices that contains it, at the same (pp, cp, tp); its ``edp`` (expert-data)
group is the dp ranks at its position in every ep block: the replicas of the same experts.

There is no module-level state: every layer, optimizer and schedule that needs a group receives
this object (or one of its groups) as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import ParallelConfig
from tessera.errors import ConfigError

AXES = ("pp", "dp", "cp", "tp")


def rank_grid(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> torch.Tensor:
    """The rank of every coordinate: grid[pp, dp, cp, tp]."""
    return torch.arange(pp * dp * cp * tp).view(pp, dp, cp, tp)


def axis_groups(grid: torch.Tensor, axis: str) -> list[list[int]]:
    """The rank lists of every group along `axis`: ranks that differ only in that coordinate."""
    i = AXES.index(axis)
    moved = grid.movedim(i, -1).reshape(-1, grid.shape[i])
    return [row.tolist() for row in moved]


@dataclass
class Topology:
    """This rank's place in the (pp, dp, cp, tp) grid and the process groups of each axis."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    rank: int = 0
    mesh: Any = None
    """torch DeviceMesh with dims ('pp', 'dp', 'cp', 'tp'); None in a single process."""
    groups: dict[str, Any] = field(default_factory=dict)
    """ProcessGroup of each axis ('pp', 'dp', 'cp', 'tp', 'ep', 'edp' = dp/ep replicas of the
    same experts, 'mp' = tp×pp, and 'dpcp' = dp×cp, over which gradients are averaged under
    context parallelism) for this rank."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def grid(self) -> torch.Tensor:
        return rank_grid(self.dp, self.tp, self.pp, self.cp)

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """{'pp': i, 'dp': j, 'cp': k, 'tp': l} of `rank` (this rank by default)."""
        rank = self.rank if rank is None else rank
        where = (self.grid == rank).nonzero()[0].tolist()
        return dict(zip(AXES, where, strict=True))

    def ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """The ranks of `rank`'s group along `axis` ('pp', 'dp', 'cp', 'tp', 'ep', 'mp' or
        'dpcp')."""
        rank = self.rank if rank is None else rank
        for ranks in self.all_groups(axis):
            if rank in ranks:
                return ranks
        raise KeyError(rank)

    def all_groups(self, axis: str) -> list[list[int]]:
        if axis in AXES:
            return axis_groups(self.grid, axis)
        if axis == "ep":
            return [g[i:i + self.ep] for g in axis_groups(self.grid, "dp")
                    for i in range(0, self.dp, self.ep)]
        if axis == "edp":  # the same position in every ep block
            return [g[j::self.ep] for g in axis_groups(self.grid, "dp") for j in range(self.ep)]
        if axis == "mp":  # model-parallel: everything but dp and cp, i.e. one model replica
            g = self.grid.permute(1, 2, 0, 3).reshape(self.dp * self.cp, -1)
            return [row.tolist() for row in g]
        if axis == "dpcp":  # every replica of the same parameters: dp × cp at one (pp, tp)
            g = self.grid.permute(0, 3, 1, 2).reshape(self.pp * self.tp, -1)
            return [row.tolist() for row in g]
        raise KeyError(f"unknown axis {axis!r}")

    def group(self, axis: str) -> Any:
        """This rank's ProcessGroup along `axis`, None in a single process."""
        return self.groups.get(axis)

    def size(self, axis: str) -> int:
        return {"ep": self.ep, "edp": self.dp // self.ep, "mp": self.tp * self.pp,
                "dpcp": self.dp * self.cp}.get(axis) \
            or getattr(self, axis)

    def local_rank_in(self, axis: str) -> int:
        return self.ranks(axis).index(self.rank)

    def describe(self) -> str:
        return (f"world={self.world_size} pp={self.pp} dp={self.dp} cp={self.cp} tp={self.tp}"
                f" ep={self.ep} rank={self.rank} coords={self.coords()}")

    @classmethod
    def solo(cls) -> Topology:
        """A one-rank topology for this rank inside a larger world: every axis a process
        group of this rank alone (every rank must call it: each creates every rank's group,
        as dist.new_group requires), so a model built on it reaches no other rank. What N
        independent single-process runs would do, inside one launch (benchmarks/dp_cost.py
        runs such a control beside a data-parallel model)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group([r]) for r in range(world)]
        axes = (*AXES, "ep", "edp", "mp", "dpcp")
        return cls(rank=0, groups={axis: groups[rank] for axis in axes})

    @classmethod
    def build(cls, cfg: ParallelConfig, device_type: str = "cpu") -> Topology:
        """Validate the layout against the world and create every group (all ranks must call)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if cfg.world_size != world:
            raise ConfigError("parallel", f"dp={cfg.dp} tp={cfg.tp} pp={cfg.pp} cp={cfg.cp}",
                              f"dp*tp*pp*cp={cfg.world_size} must equal the world size {world}")
        topo = cls(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep,
                   rank=dist.get_rank() if dist.is_initialized() else 0)
        if not dist.is_initialized():
            return topo
        from torch.distributed.device_mesh import init_device_mesh

        topo.mesh = init_device_mesh(device_type, (cfg.pp, cfg.dp, cfg.cp, cfg.tp),
                                     mesh_dim_names=AXES)
        topo.groups = {axis: topo.mesh.get_group(axis) for axis in AXES}
        # Groups that are not mesh axes; dist.new_group must be called by every rank for every
        # group, in the same order.
        axes = ["ep", "mp"] + (["edp"] if cfg.ep > 1 else []) + (["dpcp"] if cfg.cp > 1 else [])
        for axis in axes:
            for ranks in topo.all_groups(axis):
                group = dist.new_group(ranks)
                if topo.rank in ranks:
                    topo.groups[axis] = group
        if cfg.cp == 1:  # dp × 1 is the dp group itself
            topo.groups["dpcp"] = topo.groups["dp"]
        if cfg.ep == 1:  # every dp rank holds every expert
            topo.groups["edp"] = topo.groups["dp"]
        return topo
