"""tessera's data-parallel engine work measured from outside, on a chain of one-layer modules
against the chain unwrapped: per-unit and per-tensor costs that do not depend on the model."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from tessera.planner.local.timing import samples


class _Chain(torch.nn.Module):
    """`count` bias-free d×d linears in a row: per-unit and per-tensor engine costs are timed
    on it with one input row, so the model's own work is a matrix-vector product per layer."""

    def __init__(self, count: int, d: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False)
                                           for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _chain_backward(model: torch.nn.Module, x: torch.Tensor, sync: str) -> None:
    """One forward + backward of a chain on `x`, then its gradients dropped. `sync`: "plain"
    (an unwrapped chain), "no_sync" (a DataParallel wrapper's hooks run, nothing is reduced)
    or "sync" (the wrapper's gradient sync after the backward)."""
    if sync == "no_sync":
        with model.no_sync():
            model(x).sum().backward()
    else:
        model(x).sum().backward()
        if sync == "sync":
            model.finish_gradient_sync()
    for param in model.parameters():
        param.grad = None


def extra_per_layer(make: Callable[[torch.nn.Module], torch.nn.Module], count: int, d: int,
                     hooks_only: bool = False) -> float:
    """Seconds per layer that wrapping a `_Chain(count, d)` with `make` adds to its forward +
    backward on one row, in thread CPU time (medians over interleaved rounds, so a slow minute
    hits both alike): with the wrapper's gradient sync, or with `hooks_only` its backward
    inside ``no_sync()`` (DataParallel: the hooks run, nothing is reduced)."""
    torch.manual_seed(0)
    plain = _Chain(count, d)
    torch.manual_seed(0)
    wrapped = make(_Chain(count, d))
    x = torch.randn(1, d)

    def base() -> None:
        _chain_backward(plain, x, "plain")

    def other() -> None:
        _chain_backward(wrapped, x, "no_sync" if hooks_only else "sync")

    plain_t, wrapped_t = [], []
    for _ in range(3):
        plain_t += samples(base, 5, warmup=1)
        wrapped_t += samples(other, 5, warmup=1)
    return max(0.0, statistics.median(wrapped_t) - statistics.median(plain_t)) / count


def zero_unit_costs(bandwidth: float) -> tuple[float, float]:
    """tessera's ZeRO-3 work per unit per micro-batch besides its collectives, as (seconds
    fixed, passes over the unit's parameter bytes at `bandwidth` bytes/s): a chain of one-layer
    units wrapped in ZeRO-3 over a group of this rank alone (Topology.solo: its gathers and
    reductions move nothing) against the chain unwrapped, with tiny layers (8×8: the fixed
    part, the hooks and bookkeeping) and with 1024×1024 layers (the part that grows with the
    unit: fresh buffers for the gathered parameters and the flattened gradient, and its
    copy). Measured directly, not as a difference of two model steps, whose noise was as
    large as the effect. Every rank of the default group must call it (it creates the
    one-rank groups)."""
    from tessera.parallel.zero import ZeroModel
    from tessera.topology import Topology

    solo = Topology.solo().groups["dp"]

    def wrap(chain: torch.nn.Module) -> torch.nn.Module:
        return ZeroModel(chain, solo, stage=3,
                         units=[(f"u{i}", [layer]) for i, layer in enumerate(chain.layers)])

    fixed = extra_per_layer(wrap, 32, 8)
    d = 1024  # 4 MiB units: each pass is ~10x the noise of the timings here
    large = extra_per_layer(wrap, 8, d)
    return fixed, max(0.0, large - fixed) * bandwidth / (4 * d * d)
