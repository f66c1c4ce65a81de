"""Launch N local ranks through torch's elastic launcher (what `torchrun` runs).

`tessera train --nproc N ...` calls :func:`launch`, which runs ``python -m tessera.train ...``
on N ranks with a single-node rendezvous that listens on loopback only. For several machines,
run torchrun yourself on each (`torchrun --nnodes ... -m tessera.train ...`): the ranks are the
same code either way.

With ``max_restarts`` > 0 the launcher's agent restarts every rank when one fails (it exits
non-zero, is killed, or the watchdog of another rank names it silent); the restarted ranks see
``TORCHELASTIC_RESTART_COUNT`` > 0 and resume from the newest complete checkpoint
(``run_dir.run_start``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import uuid
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import run as torchrun

UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
LOOPBACK, LOOPBACK_INTERFACE = "127.0.0.1", "lo"
"""Local runs listen on loopback only: the rendezvous here, rank 0's store (MASTER_ADDR, from
--local-addr; ``loopback_store``) and gloo's connections (GLOO_SOCKET_IFNAME) in the ranks."""


def launch(nproc: int, train_argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m tessera.train *train_argv` on `nproc` local ranks, restarting them all
    up to `max_restarts` times; return an exit code."""
    parser = get_args_parser()
    # Without this, a training flag that prefixes a launcher flag (--virtual, of
    # --virtual-local-rank) is taken for the launcher's.
    parser.allow_abbrev = False
    # torchrun --standalone would serve the rendezvous on every interface (a TCPStore binds
    # all of them whatever host it is given): serve it here, on a socket bound to loopback,
    # for as long as the launcher runs (the store owns and closes the descriptor).
    listener = socket.create_server((LOOPBACK, 0))
    port = listener.getsockname()[1]
    rendezvous = TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True,  # noqa: F841
                          wait_for_workers=False, master_listen_fd=listener.detach())
    args = parser.parse_args(
        ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{port}",
         f"--rdzv-id={uuid.uuid4()}", "--rdzv-conf=is_host=false", f"--local-addr={LOOPBACK}",
         f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
         "--module", "tessera.train", *train_argv])
    # The ranks' store is rank 0's, new for each attempt, not the rendezvous's own: shared,
    # it keeps the keys of the attempt before a restart, and a restarted rank can read the
    # dead ranks' addresses from them (gloo: "Connection refused"; pytorch/pytorch#135712).
    os.environ.setdefault(UNSHARED_STORE, "1")
    # gloo listens on the address the host name resolves to, unless told an interface.
    if LOOPBACK_INTERFACE in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    try:
        torchrun(args)
    except ChildFailedError as e:
        print(f"error: {failure_line(e, nproc, max_restarts)}", file=sys.stderr, flush=True)
        first = next(iter(e.failures.values()), None)
        code = first.exitcode if first is not None else 1
        return code if code > 0 else 1
    return 0


def failure_line(e: ChildFailedError, nproc: int, max_restarts: int) -> str:
    """One line naming each rank that failed in the last attempt and how it ended."""
    how = []
    for rank, failure in sorted(e.failures.items()):
        ended = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
                 else f"exit code {failure.exitcode}")
        how.append(f"rank {rank} {ended}")
    restarts = f" after {max_restarts} restart(s)" if max_restarts else ""
    return (f"{len(e.failures)} of {nproc} ranks failed{restarts} ({', '.join(how)}); see "
            "their output above")


def loopback_store(timeout: timedelta) -> TCPStore | None:
    """The ranks' store for init_process_group, when rank 0 serves it on a loopback
    MASTER_ADDR (a local launch: torchrun without its agent's store): rank 0 listens on a
    socket bound to that address, the others connect. None otherwise (torch's env:// then
    makes the store, listening on every interface)."""
    addr = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "False" or not _is_loopback(addr):
        return None
    port, rank = int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if rank != 0:
        return TCPStore(addr, port, world, is_master=False, timeout=timeout)
    # The store owns the listening descriptor from now on (and closes it).
    listening = socket.create_server((addr, port)).detach()
    return TCPStore(addr, port, world, is_master=True, multi_tenant=True, timeout=timeout,
                    wait_for_workers=False, master_listen_fd=listening)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False
