"""Run a function on N gloo ranks: the harness every multi-process test and benchmark uses.

    results = run_ranks(my_check, world_size=4, args=(cfg,))

``my_check(*args)`` runs in N processes with the default process group already initialized
(gloo on CPU, one thread each so N ranks do not oversubscribe 2 cores). Each rank's return
value comes back in rank order. If any rank raises, the call raises ``RankFailure`` carrying
that rank's traceback; if ranks are still running after `timeout` seconds they are killed and
``RankFailure`` says which ones hung.

The rendezvous store lives in the parent on a port the OS picks, so parallel tests never race
for a free port. Ranks start from a fork server that has imported torch once: a rank starts in
a fraction of a second, and it is forked from a clean single-threaded process. Forking the test
process itself is not safe: its store server thread (or a thread a library started) may hold a
lock at the moment of the fork, and the child then hangs in ``init_process_group``. So `fn` and
its arguments must be picklable: a module-level function in an importable module.
"""

from __future__ import annotations

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


class RankFailure(AssertionError):
    """A rank raised, or hung past the timeout."""


def _rank_main(fn: Callable, args: Sequence, kwargs: dict, rank: int, world_size: int,
               port: int, backend: str, threads: int, conn: Any) -> None:
    try:
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
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


def run_ranks(fn: Callable, world_size: int, args: Sequence = (), kwargs: dict | None = None,
              *, timeout: float = 180.0, backend: str = "gloo", threads: int = 1,
              start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` ranks; return the per-rank results."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "tessera.testing"])
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                           timeout=timedelta(seconds=60), wait_for_workers=False)
    pipes, procs = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, args, kwargs or {}, rank, world_size,
                                                 server.port, backend, threads, send),
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
                failure = f"rank {rank} failed:\n{payload}"
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
