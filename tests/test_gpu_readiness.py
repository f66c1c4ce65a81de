"""What a GPU run relies on, checked on the CPU: collectives make their scratch on the input's
device, AdamW's kernel choice, the DDP side thread's stream fence, the parameter server's
receives naming their source, and `plan calibrate` measuring on the run's device and backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cli_errors import cli_error
from tessera import collectives as C
from tessera.config import TrainConfig
from tessera.optim import adamw, adamw_implementation
from tessera.parallel.ddp import on_device_of, stream_event, wait_for
from tessera.testing import run_ranks


class OffDeviceTensors(TorchDispatchMode):
    """Records every op whose output tensor is not on `device` (with `strict`, raises at the
    first, where its traceback shows the line). Used under ``with torch.device("meta")``: a
    tensor made without ``device=`` lands on meta, so a ``torch.zeros(n)`` that would sit on
    the CPU while the data is on a GPU shows up here."""

    def __init__(self, device: str, strict: bool = False):
        super().__init__()
        self.device, self.strict = device, strict
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != self.device:
                self.found.append(f"{func} -> {t.device.type}")
                if self.strict:  # before the tensor reaches the wire, where a peer would hang
                    raise AssertionError(f"made off the input's device: {self.found[-1]}")
        return out


def _collective_calls(rank: int, world: int) -> dict:
    """Every collective and algorithm, on shapes that take every branch (uneven shards, the
    fold of non-powers of two, bf16's wide accumulators)."""
    calls = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.arange(3 * world + 2, dtype=dtype) + rank  # not divisible by world
        even = torch.arange(2 * world, dtype=dtype) + rank
        for alg in C.ALL_REDUCE_ALGORITHMS:
            calls[f"all_reduce {alg} {dtype}"] = lambda a=alg, x=x: C.all_reduce(
                x.clone(), op="avg", algorithm=a
            )
        for alg in C.REDUCE_SCATTER_ALGORITHMS:
            calls[f"reduce_scatter {alg} {dtype}"] = lambda a=alg, x=x: C.reduce_scatter(
                x, algorithm=a
            )
            calls[f"reduce_scatter even {alg} {dtype}"] = lambda a=alg, e=even: C.reduce_scatter(
                e, algorithm=a
            )
        for alg in C.ALL_GATHER_ALGORITHMS:
            lo, hi = C.shard_bounds(x.numel(), world)[rank]
            calls[f"all_gather {alg} {dtype}"] = lambda a=alg, s=x[lo:hi], n=3 * world + 2: (
                C.all_gather(s, algorithm=a, numel=n)
            )
            calls[f"all_gather equal {alg} {dtype}"] = lambda a=alg, x=x: C.all_gather(
                x[:2], algorithm=a
            )
        for alg in C.BROADCAST_ALGORITHMS:
            calls[f"broadcast {alg} {dtype}"] = lambda a=alg, x=x: C.broadcast(
                x.clone(), root=1, algorithm=a
            )
        for alg in C.REDUCE_ALGORITHMS:
            calls[f"reduce {alg} {dtype}"] = lambda a=alg, x=x: C.reduce(
                x.clone(), root=1, algorithm=a
            )
        for alg in C.SCATTER_ALGORITHMS:
            out = torch.empty(2, dtype=dtype)  # made here: the call runs under a meta default
            calls[f"scatter {alg} {dtype}"] = lambda a=alg, e=even, o=out: C.scatter(
                o, e if rank == 1 else None, root=1, algorithm=a
            )
        for alg in C.GATHER_ALGORITHMS:
            calls[f"gather {alg} {dtype}"] = lambda a=alg, x=x: C.gather(x[:2], root=1, algorithm=a)
        for alg in C.ALL_TO_ALL_ALGORITHMS:
            calls[f"all_to_all {alg} {dtype}"] = lambda a=alg, e=even: C.all_to_all(e, algorithm=a)
    return calls


def _every_collective_on_cpu_inputs_under_meta_default() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    done = []
    for name, call in _collective_calls(rank, world).items():
        try:
            with torch.device("meta"), OffDeviceTensors("cpu", strict=True):
                call()
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
        done.append(name)
    return done


@pytest.mark.multiprocess
@pytest.mark.slow
def test_collectives_allocate_on_the_inputs_device():
    # 3 ranks: not a power of two, so the recursive algorithms fold.
    done = run_ranks(_every_collective_on_cpu_inputs_under_meta_default, 3)
    assert all(len(d) == len(done[0]) > 50 for d in done)


def test_off_device_recorder_catches_a_factory_without_device():
    recorder = OffDeviceTensors("cpu")
    x = torch.ones(4)
    with torch.device("meta"), recorder:
        torch.zeros(x.numel())
        torch.empty_like(x)  # follows x: not reported
        torch.zeros(2, device=x.device)
    assert len(recorder.found) == 1 and "meta" in recorder.found[0]


def test_adamw_is_fused_where_the_parameters_are_on_cuda():
    assert adamw_implementation({"cuda"}) == {"fused": True}
    assert adamw_implementation({"cpu"}) == {"foreach": False}
    assert adamw_implementation({"cpu", "cuda"}) == {"foreach": False}  # one kernel, one device
    opt = adamw([torch.nn.Parameter(torch.ones(2, 2))], TrainConfig())
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]
    # The CUDA choice is a valid AdamW configuration (torch also fuses on the CPU).
    params = [torch.nn.Parameter(torch.ones(2, 2))]
    torch.optim.AdamW(params, **adamw_implementation({"cuda"}))


def test_ddp_stream_fence_is_a_no_op_on_cpu():
    t = torch.ones(3)
    assert stream_event(t) is None
    wait_for(None, t)
    with on_device_of(t):
        pass


def _async_server_receives_from_named_sources() -> dict:
    from dp_parity import distributed_run, tiny_config

    sources = []
    real = dist.recv

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        sources.append(src if group_src is None else group_src)
        return real(tensor, src=src, group=group, tag=tag, group_src=group_src)

    dist.recv = recv
    try:
        engine, _ = distributed_run(tiny_config(dp=3, dp_mode="ps-async", max_staleness=2), steps=2)
    finally:
        dist.recv = real
    return {"server": engine.model.server.ps.is_server, "sources": sources}


@pytest.mark.multiprocess
def test_async_parameter_server_names_every_source():
    """NCCL cannot receive from any source: the server takes one push from each worker, in
    rank order, every step."""
    server = next(r for r in run_ranks(_async_server_receives_from_named_sources, 3) if r["server"])
    assert server["sources"] == [1, 2, 1, 2]


def test_calibrate_measures_on_the_runs_device_and_backend(monkeypatch):
    from tessera.planner.local import calibrate as cal
    from tessera.planner.local.rates import block_step
    from tessera.planner.models import load_model

    seen = {}

    def fake_run_ranks(fn, world, args=(), timeout=0, backend="gloo"):
        seen.update(args=args, backend=backend)
        return [
            {
                "mm": 1.0,
                "attn": 1.0,
                "bw": 1.0,
                "overhead": 0.0,
                "passes": 1.0,
                "optimizer": 0.0,
                "jitter_fixed": 0.0,
                "jitter_rate": 0.0,
                "mm_large": 1.0,
                "mm_tail": 0.0,
                "p2p_alpha": 1e-5,
                "p2p_beta": 1e-9,
                "alpha": 1e-5,
                "beta": 1e-9,
                "gather_efficiency": 1.0,
                "zero_unit": 0.0,
                "zero_passes": 0.0,
                "zero_waits": 0.0,
                "ddp_tensor": 0.0,
                "ddp_passes": 2.0,
                "launch": 1e-5,
                "compiled": None,
            }
        ] * world

    monkeypatch.setattr("tessera.testing.run_ranks", fake_run_ranks)
    spec = load_model("demo")
    hw = cal.calibrate(spec, 32, 2, device="cpu", backend="gloo")
    assert seen == {"args": (spec, 32, 2, "cpu"), "backend": "gloo"}
    assert "cpu, gloo" in hw.source
    # A rank measures with its device as the default: one block's step makes nothing elsewhere.
    recorder = OffDeviceTensors("meta")
    with cal.rank_device("meta", 0), recorder:
        block_step(spec, 16, 1)()
    assert recorder.found == []


def test_calibrate_refuses_a_device_or_backend_this_machine_lacks():
    if not torch.cuda.is_available():
        assert cli_error(["plan", "calibrate", "--device", "cuda"]) == (
            "error: --device='cuda': no CUDA device on this machine"
        )
    assert cli_error(["plan", "calibrate", "--device", "cpu", "--backend", "nccl"]) == (
        "error: --backend='nccl': NCCL needs --device cuda, not cpu"
    )
