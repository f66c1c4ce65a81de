"""Test support: the multi-rank harness, and the tolerance of every parity comparison.

Ranks. ``run_ranks`` runs a function on N gloo ranks: the harness every multi-process test and
benchmark uses.

    results = run_ranks(my_check, world_size=4, args=(cfg,))

``my_check(*args)`` runs in N processes with the default process group already initialized
(gloo on CPU, one thread each so N ranks do not oversubscribe 2 cores). Each rank's return
value comes back in rank order. If any rank raises, the call raises ``RankFailure`` carrying
that rank's traceback and the ranks that had not finished; if ranks are still running after
`timeout` seconds they are killed and ``RankFailure`` says which ones hung. Each rank's
collectives time out after `collective_timeout_s()` seconds (20, or
TESSERA_TEST_COLLECTIVE_TIMEOUT), so a deadlock fails in seconds, not after gloo's default.

The rendezvous store lives in the parent on a port the OS picks, so parallel tests never race
for a free port. Ranks start from a fork server that has imported torch once: a rank starts in
a fraction of a second, and it is forked from a clean single-threaded process. Forking the test
process itself is not safe: its store server thread (or a thread a library started) may hold a
lock at the moment of the fork, and the child then hangs in ``init_process_group``. So `fn` and
its arguments must be picklable: a module-level function in an importable module.

Tolerances. A parity test compares a parallel run with the single-device model; the two compute
the same sums in another order (other ranks, other shards, other kernel blocking), nothing
else. ``assert_close_summed(actual, expected, terms=n)`` bounds one such comparison by
n·ε·(magnitude of what was summed) times a small safety factor (`summation_bound` has the
derivation); ``summation_error`` gives the share of that bound used, for checks made on a rank;
``assert_curves_close`` compares per-step metric curves of two free-running trainings.

What the bound does not cover is Adam: AdamW divides each gradient entry by its own running
RMS, so an entry whose gradient is itself round-off sized takes a visibly different step in
two runs whose gradients differ only by round-off, and the parameters that differ feed every
later step. No bound on the parameters of two free-running runs follows from the summation
bound, short of lr·steps (how far Adam can move anything), which would let real bugs through.
So the parity tests compare each step against the single-device model started from the run's
own parameters (tests/dp_parity.py's ``Shadow``): its gradients within the summation bound,
then AdamW applied to the run's parameters and the run's own gradients, which leaves only the
roundings of the elementwise update.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tessera.host_memory import keep_freed_memory

COLLECTIVE_TIMEOUT_ENV = "TESSERA_TEST_COLLECTIVE_TIMEOUT"
DEFAULT_COLLECTIVE_TIMEOUT = 20.0


class RankFailure(AssertionError):
    """A rank raised, or hung past the timeout."""


def _rank_main(fn: Callable, args: Sequence, kwargs: dict, rank: int, world_size: int,
               port: int, backend: str, threads: int, collective_timeout: float,
               keep_host_memory: bool, conn: Any) -> None:
    try:
        torch.set_num_threads(threads)
        if keep_host_memory and backend == "gloo":  # a CPU rank, as tessera.trainer does
            keep_freed_memory()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=60))
        # Groups made later (dist.new_group, DeviceMesh: every Topology axis) get torch's
        # default timeout, not the default group's: make it the same short one, in this rank's
        # process only.
        c10d.default_pg_timeout = timedelta(seconds=collective_timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        result = fn(*args, **kwargs)
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def collective_timeout_s() -> float:
    """The timeout a test rank's collectives get: TESSERA_TEST_COLLECTIVE_TIMEOUT seconds, 20
    unless set. Collectives in these tests move kilobytes between ranks doing the same work,
    so a wait of 20 s means a rank is missing, not slow; gloo's default (30 min) would only
    delay the report of a deadlock."""
    return float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT))


def run_ranks(fn: Callable, world_size: int, args: Sequence = (), kwargs: dict | None = None,
              *, timeout: float = 180.0, backend: str = "gloo", threads: int = 1,
              start_method: str = "forkserver",
              collective_timeout: float | None = None,
              keep_host_memory: bool = True) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` ranks; return the per-rank results.

    `timeout`: seconds for the whole run before the ranks still running are killed.
    `collective_timeout`: seconds any one collective or receive may wait before it raises on
    its rank (default `collective_timeout_s()`): a deadlock fails fast, naming the rank that
    timed out and the ranks that had not finished.
    `keep_host_memory`: each rank on gloo (a CPU rank; GPU ranks use NCCL) keeps the host
    memory it frees, as a CPU training rank does (:func:`tessera.host_memory.keep_freed_memory`;
    the trainer applies it on CPU ranks only); False leaves malloc as it comes."""
    if collective_timeout is None:
        collective_timeout = collective_timeout_s()
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # torch._dynamo: AdamW imports it lazily, ~1.4 s per rank if not preloaded.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    "tessera.testing"])
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                           timeout=timedelta(seconds=60), wait_for_workers=False)
    pipes, procs = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, args, kwargs or {}, rank, world_size,
                                                 server.port, backend, threads,
                                                 collective_timeout, keep_host_memory, send),
                        daemon=True)
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)

    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    failure: str | None = None
    while pending and failure is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready = mp.connection.wait([pipes[r] for r in pending], timeout=min(remaining, 1.0))
        for conn in ready:
            rank = pipes.index(conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "error", f"rank {rank} died without a result " \
                                           f"(exit code {procs[rank].exitcode})"
            pending.discard(rank)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                still = sorted(pending)
                waiting = (f" (ranks {still} of {world_size} had not finished: hung, or waiting "
                           f"for rank {rank})") if still else ""
                failure = f"rank {rank} failed{waiting}:\n{payload}"
                break
    for p in procs:
        if failure is not None or pending:
            p.kill()
        p.join(timeout=10)
    del server
    if failure is not None:
        raise RankFailure(failure)
    if pending:
        raise RankFailure(f"ranks {sorted(pending)} of {world_size} did not finish within "
                          f"{timeout:.0f}s (deadlock or too slow)")
    return results


# ---------------------------------------------------------------------------------------------
# Tolerances of parity comparisons.

SAFETY = 4.0
"""Default safety factor of `summation_bound` (see its docstring for what it covers)."""

_LOG_ENV = "TESSERA_TOLERANCE_LOG"


def summation_bound(terms: int, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32,
                    safety: float = SAFETY) -> float | torch.Tensor:
    """How far apart two computations of the same sum can land when they add its `terms` terms
    in different orders: ``safety · terms · ε(dtype) · scale``.

    Derivation: floating-point summation of n terms returns Σxᵢ + e with
    |e| ≤ (n−1)·u·Σ|xᵢ| + O(u²), u = ε/2 the unit round-off (Higham, "Accuracy and Stability of
    Numerical Algorithms", 2nd ed., §4.2, recursive summation; pairwise, blocked and ring orders
    have smaller constants). Two orders each within that of the exact sum lie within
    n·ε·Σ|xᵢ| of each other. `scale` is Σ|xᵢ| in the units of the result (divided by n for a
    mean), i.e. the result's magnitude had nothing cancelled; it may be a tensor (elementwise).

    `safety` covers what the formula leaves out when a test cannot know Σ|xᵢ| per element and
    passes the magnitude of the result instead (`assert_close_summed`'s default): sums that
    partly cancel, and terms that themselves carry round-off from reordered sums upstream
    (activations of a layer computed in another blocking). Measured under ATEN_CPU_CAPABILITY
    default, avx2 and avx512 (TESSERA_TOLERANCE_LOG over the whole suite): the parity tests of
    this repository use at most 1.6% of their bounds, the conjugate-operator checks 7% (exact
    Σ|xᵢ|, safety 4), the collective tests 53% (exact Σ|xᵢ|, safety 1). A one-line bug uses
    far more: the subtlest planted so far, the vocabulary padding entering the softmax, 6x.
    """
    return safety * terms * torch.finfo(dtype).eps * scale


def assert_close_summed(actual: torch.Tensor | float, expected: torch.Tensor | float, *,
                        terms: int, scale: float | torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float32, safety: float = SAFETY,
                        msg: str = "") -> None:
    """Assert that `actual` equals `expected` up to reordering the sums that produced them.

    ``|actual − expected| <= summation_bound(terms, scale, dtype, safety)`` elementwise, where

    - `terms`: how many values were added into each element along the reduction whose order
      differs (e.g. the tokens of the global batch for a data-parallel gradient: each rank sums
      its tokens, then the ranks' partial sums are added);
    - `scale`: the magnitude of what was summed (Σ|xᵢ|, in the result's units); by default the
      largest magnitude in `expected`. One scale per tensor is deliberate: an element whose terms
      cancel to ~0 carries the round-off of terms as large as its neighbours', which a relative
      tolerance per element (or a fixed absolute one) denies it;
    - `dtype`: the precision the sums ran in (fp32 unless told).

    The message names the worst element and how the bound was made. With the environment
    variable TESSERA_TOLERANCE_LOG=path, every check appends ``share-of-bound-used msg`` to that
    file: the headroom each tolerance has on this machine's kernels.
    """
    used, detail = _summation_check(actual, expected, terms, scale, dtype, safety, msg)
    if used > 1.0:
        raise AssertionError(detail)


def summation_error(actual: torch.Tensor | float, expected: torch.Tensor | float, *,
                    terms: int, scale: float | torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, safety: float = SAFETY,
                    msg: str = "") -> float:
    """The share of `assert_close_summed`'s bound that |actual − expected| uses (<= 1 is
    within it): for checks made where they cannot raise, e.g. on a rank that collects results
    for the test process to assert on."""
    return _summation_check(actual, expected, terms, scale, dtype, safety, msg)[0]


def assert_curves_close(actual: Sequence[float], expected: Sequence[float], *,
                        terms_per_step: int, msg: str = "") -> None:
    """Assert that two per-step metric curves (losses, gradient norms) of free-running
    trainings that differ only in the order of their sums agree: the value of step k (1-based)
    within the summation bound over k·terms_per_step terms, relative to its own magnitude.

    Why k·terms: every step reorders one more sum of terms_per_step terms (e.g. the global
    batch's tokens), whose round-off moves the parameters, and a loss sees a parameter change
    only through ⟨g, Δp⟩. Adam's amplification of round-off (module docstring) lands on
    entries whose gradient is itself round-off sized, which such a metric barely sees, so the
    differences add up step by step rather than compound. Gradients and parameters are not
    compared this way: see the module docstring.
    """
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise AssertionError(f"{msg}: {len(actual)} steps != expected {len(expected)}")
    for k, (got, want) in enumerate(zip(actual, expected, strict=True), 1):
        assert_close_summed(got, want, terms=k * terms_per_step, msg=f"{msg} step {k}")


def _as_float64(actual, expected, msg: str) -> tuple[torch.Tensor, torch.Tensor]:
    actual_t = torch.as_tensor(actual).detach().double().cpu()
    expected_t = torch.as_tensor(expected).detach().double().cpu()
    if actual_t.shape != expected_t.shape:
        raise AssertionError(f"{msg}: shape {tuple(actual_t.shape)} != expected "
                             f"{tuple(expected_t.shape)}")
    return actual_t, expected_t


def _summation_check(actual, expected, terms: int, scale, dtype: torch.dtype, safety: float,
                     msg: str) -> tuple[float, str]:
    actual_t, expected_t = _as_float64(actual, expected, msg)
    if scale is None:
        scale = float(expected_t.abs().max()) if expected_t.numel() else 0.0
    bound = summation_bound(terms, scale, dtype, safety)
    return _within(actual_t, expected_t, bound, lambda: (
        f"bound = {safety:g} safety x {terms} terms x eps({str(dtype).removeprefix('torch.')})"
        f" x scale {_fmt_scale(scale)}"), msg)


def _log(used: float, msg: str) -> None:
    path = os.environ.get(_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{used:.4g} {msg}\n")


def _fmt_scale(scale: float | torch.Tensor) -> str:
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        return f"(elementwise, max {float(scale.max()):.3g})" if scale.numel() else "(empty)"
    return f"{float(scale):.3g}"


def _within(actual: torch.Tensor, expected: torch.Tensor, bound: float | torch.Tensor,
            how: Callable[[], str], msg: str) -> tuple[float, str]:
    """The largest share of `bound` that |actual − expected| uses (NaN and inf use all of it
    unless equal), and the message that names the worst element."""
    err = (actual - expected).abs()
    largest = float(err.max()) if err.numel() else 0.0
    if math.isfinite(largest) and not isinstance(bound, torch.Tensor):  # the common case, fast
        worst = largest / bound if largest > 0 else 0.0
        _log(worst, msg)
        if worst <= 1.0:
            return worst, ""
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    err = torch.where(same, torch.zeros_like(actual), err.nan_to_num(nan=float("inf")))
    bound_t = torch.as_tensor(bound, dtype=torch.float64).expand_as(err)
    # 0 where equal, inf where the bound is 0 and not met.
    used = torch.where(err == 0, torch.zeros_like(err), err / bound_t)
    worst = float(used.max()) if used.numel() else 0.0
    if not (math.isfinite(largest) and not isinstance(bound, torch.Tensor)):
        _log(worst, msg)
    if worst <= 1.0:
        return worst, ""
    i = int(used.flatten().argmax())
    index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), err.shape)) \
        if err.dim() else ()
    return worst, (
        f"{msg}: |actual - expected| = {float(err.flatten()[i]):.3g} at {index} (actual "
        f"{float(actual.flatten()[i]):.8g}, expected {float(expected.flatten()[i]):.8g}) is "
        f"{worst:.3g}x the {how()} = {float(bound_t.flatten()[i]):.3g}")


def rank_micro_batches(x: torch.Tensor, y: torch.Tensor, topo: Any,
                       microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of a global batch (`x`, `y`: [B, T] inputs and targets), as the
    trainer's loader gives it: rows B·d/dp to B·(d+1)/dp for data-parallel rank d, cut into
    `microbatches` micro-batches, each reduced to this context-parallel rank's tokens
    (``data.loader.cp_shard``; the whole sequence at cp = 1). `topo`: a ``Topology``."""
    from tessera.data.loader import cp_shard

    coords, n = topo.coords(), x.shape[0]
    d, dp = coords["dp"], topo.dp
    rows = slice(d * n // dp, (d + 1) * n // dp)
    return [cp_shard(mb, coords["cp"], topo.cp)
            for mb in zip(x[rows].chunk(microbatches), y[rows].chunk(microbatches), strict=True)]
