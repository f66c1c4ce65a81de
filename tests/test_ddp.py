"""Our bucketed, overlapped DDP against one process on the whole batch (N = 2, 4)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dp_parity import (
    GLOBAL_BATCH,
    STEPS,
    assert_matches_reference,
    distributed_run,
    tiny_config,
)
from tessera.errors import ConfigError
from tessera.parallel.ddp import DataParallel, build_buckets
from tessera.testing import assert_close_summed, run_ranks

SMALL_BUCKET_MB = 0.01  # ~2600 fp32 elements: the tiny model splits into 13 buckets


def ddp_cases(world: int) -> dict:
    """Every DDP check of one world size, in one set of ranks (process start-up dominates)."""
    out = {}
    for accum in (1, 2):
        cfg = tiny_config(dp=world, accum=accum, bucket_mb=SMALL_BUCKET_MB)
        engine, run = distributed_run(cfg, shadow=True)
        out[f"backend accum={accum}"] = run
    out["n_buckets"] = len(engine.model.wrappers[0].buckets)
    # Our point-to-point all-reduces, run from the background thread.
    for algorithm in ("ring", "rabenseifner"):
        cfg = tiny_config(dp=world, accum=2, bucket_mb=SMALL_BUCKET_MB,
                          allreduce_algorithm=algorithm)
        engine, run = distributed_run(cfg, shadow=True)
        run["bytes_sent"] = engine.model.wrappers[0].comm_stats.bytes_sent
        out[f"{algorithm} accum=2"] = run
    out["overlap"] = launched_before_backward_ends(engine)
    out["unused"] = unused_parameter_grads()
    out["double_backward"] = second_backward_error()
    out["hook_time"] = hook_time()
    return out


def launched_before_backward_ends(engine) -> list[bool]:
    """Which buckets' all-reduces had started when backward reached the embedding (the module
    whose gradient backward produces last), before that gradient was computed."""
    ddp, seen = engine.model.wrappers[0], []
    handle = engine.model.chunks[0].tok_embeddings.register_full_backward_pre_hook(
        lambda module, grad_output: seen.append([b.work is not None for b in ddp.buckets]))
    x = torch.randint(0, 256, (2, 16))
    engine.model.chunks[0].zero_grad(set_to_none=True)
    ddp(x).float().pow(2).mean().backward()
    handle.remove()
    ddp.finish_gradient_sync()
    embedding = engine.model.chunks[0].tok_embeddings.weight
    assert ddp.buckets[-1].params == [embedding]  # alone, and last
    return seen[0]


class Branchy(nn.Module):
    """`b` is used only where asked, `c` never: the cases DDP must get right."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + self.b(x)
        return self.d(h)


def branchy_inputs(rank: int) -> list[tuple[torch.Tensor, bool]]:
    """Two micro-batches: rank 1 uses `b` in the first only (inside no_sync)."""
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(3, 4, generator=g), rank == 1), (torch.randn(3, 4, generator=g), False)]


def unused_parameter_grads() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    # A tiny bucket size puts every parameter in its own bucket; reverse order makes `c`'s
    # buckets come right after `d`'s, so a never-ready bucket sits before the others.
    ddp = DataParallel(Branchy(), dist.group.WORLD, bucket_mb=1e-6)
    got = {}
    # Two steps: the last backward synchronized, then every backward under no_sync and the
    # reduction in finish_gradient_sync(). The second also checks that no stale slot leaks in.
    for pattern in ("last synced", "all no_sync"):
        ddp.module.zero_grad(set_to_none=True)
        (x0, u0), (x1, u1) = branchy_inputs(rank)
        with ddp.no_sync():
            ddp(x0, u0).sum().backward()
            if pattern == "all no_sync":
                ddp(x1, u1).sum().backward()
        if pattern == "last synced":
            ddp(x1, u1).sum().backward()
        ddp.finish_gradient_sync()
        got[pattern] = {n: None if p.grad is None else p.grad.clone()
                        for n, p in ddp.module.named_parameters()}
    # Reference: one process, every rank's micro-batches, gradients of the mean over ranks.
    ref = Branchy()
    for r in range(world):
        for x, use_b in branchy_inputs(r):
            (ref(x, use_b).sum() / world).backward()
    want = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    return dict(got=got, want=want)


def second_backward_error() -> str:
    ddp = DataParallel(Branchy(), dist.group.WORLD, bucket_mb=1e-6)
    x = torch.randn(3, 4)
    ddp(x, True).sum().backward()
    try:
        ddp(x, True).sum().backward()
    except RuntimeError as e:
        message = str(e)
    else:
        message = ""
    ddp.finish_gradient_sync()  # drain what was launched, on every rank alike
    return message


def hook_time() -> tuple[float, float, float]:
    """DataParallel.hook_seconds before a backward, after it, and the backward's wall time."""
    ddp = DataParallel(Branchy(), dist.group.WORLD, bucket_mb=1e-6)
    before = ddp.hook_seconds
    start = time.perf_counter()
    ddp(torch.randn(3, 4), True).sum().backward()
    wall = time.perf_counter() - start
    ddp.finish_gradient_sync()
    return before, ddp.hook_seconds, wall


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_single_process(world):
    results = run_ranks(ddp_cases, world, args=(world,))
    assert GLOBAL_BATCH % (world * 2) == 0
    for rank, res in enumerate(results):
        assert res["n_buckets"] > 3, "the test must exercise several buckets"
        for label in ("backend accum=1", "backend accum=2", "ring accum=2",
                      "rabenseifner accum=2"):
            assert_matches_reference(res[label], f"N={world} rank {rank} {label}")
        # Ring: each rank sends 2(N-1)/N of every bucket (+ its flags), once per step.
        ring_bytes = res["ring accum=2"]["bytes_sent"]
        model_bytes = 4 * sum(p.numel() for p in res["ring accum=2"]["params"].values())
        assert 2 * (world - 1) / world * model_bytes <= ring_bytes / STEPS
        assert ring_bytes / STEPS <= 2 * (world - 1) / world * model_bytes * 1.01
        # Replicas stay bit-identical: the same reduced gradients and the same optimizer steps.
        for name, p in res["backend accum=1"]["params"].items():
            assert torch.equal(p, results[0]["backend accum=1"]["params"][name]), name

        # Overlap: when backward reaches the embedding, every other bucket is in flight or
        # done (each launched as soon as backward had filled it), the embedding's not yet.
        assert all(res["overlap"][:-1]) and not res["overlap"][-1], res["overlap"]

        want = res["unused"]["want"]
        for pattern, got in res["unused"]["got"].items():
            assert got["c.weight"] is None and got["c.bias"] is None  # used on no rank
            for name in ("a.weight", "a.bias", "b.weight", "b.bias", "d.weight", "d.bias"):
                # Each gradient sums the 3 rows of 2 micro-batches on each of the N ranks.
                assert_close_summed(got[name], want[name], terms=3 * 2 * world,
                                    msg=f"{pattern}: {name}")

        assert "no_sync" in res["double_backward"]

        # The hooks' own time (what plan calibrate prices them from): counted from zero, by
        # hooks that ran inside the backward.
        before, after, wall = res["hook_time"]
        assert before == 0.0 and 0.0 < after <= wall, res["hook_time"]


def test_buckets_follow_backward_order_and_capacity():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))  # 110 + 110 params
    params = list(model.parameters())
    buckets = build_buckets(params, bucket_bytes=4 * 110)
    assert [b.params for b in buckets] == [[params[3], params[2]], [params[1], params[0]]]
    assert all(b.flat.numel() == 110 + 2 for b in buckets)  # gradients + one flag per param
    huge = build_buckets(params, bucket_bytes=1)  # each parameter alone, none dropped
    assert [b.params for b in huge] == [[p] for p in reversed(params)]


@pytest.mark.parametrize("bad", [0, -1.0])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ConfigError, match=r"parallel.bucket_mb=.*must be > 0"):
        DataParallel(nn.Linear(2, 2), None, bucket_mb=bad)
    with pytest.raises(ConfigError, match=r"parallel.bucket_mb=.*must be > 0"):
        tiny_config(bucket_mb=bad)


def test_unknown_algorithm_is_refused():
    with pytest.raises(ConfigError, match="parallel.allreduce_algorithm='tree'"):
        DataParallel(nn.Linear(2, 2), None, algorithm="tree")
