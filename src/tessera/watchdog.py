"""Name the rank that stopped answering: a heartbeat through the rendezvous store.

A collective that waits on a dead or stopped rank fails only when the process group's timeout
(``train.collective_timeout_s``) runs out, and gloo's message then names a socket address, not
a rank; a rank stopped by SIGSTOP (or hung in the kernel) is seen by no one else at all. So each
rank runs a daemon thread that every `interval` seconds

1. adds 1 to its own counter ``beat/<rank>`` in the rendezvous store (torchrun's, at
   MASTER_ADDR:MASTER_PORT, through a client connection of its own: the main thread's
   connection may be blocked in a wait);
2. reads the counter of the next rank in a ring, ``(rank + 1) % world``. When it has not moved
   for `limit` seconds, and that rank has not marked itself ``done/<rank>`` (it finished), it
   publishes ``lost`` naming the rank;
3. reads ``lost``. Once any rank has published it, every rank still running prints the same one
   line, ``error: rank 1 stopped answering (...)``, and ends its process with ``os._exit(1)``:
   the main thread may be blocked inside a collective, which no exception reaches.

A second thread watches the store itself: when no round of the first has completed for
`limit` seconds (the store's host stopped: its connection stays open and an operation waits
without end; or it is gone), the rank names the store's host (rank 0 under tessera's launcher).

`limit` is half the collective timeout. The heartbeat then names the silent rank before a
collective blocked on it times out with gloo's message, unless that collective had already
waited half the timeout when the rank went silent (a rank that slow is a problem of its own).

The ring keeps the store's load at two reads and one write per rank per interval (O(world), not
O(world²) with everyone watching everyone); every rank still reads the verdict. A dead rank
(kill -9) is also seen at once by the launcher's agent, which stops and, with restarts left,
restarts the whole group; a stopped one is seen only here (and by the collective timeout).

A rank that dies is also seen by the ranks connected to it: their next collective fails at once
with gloo's "Connection closed by peer" (or "Connection reset by peer", "Broken pipe").
``peer_loss_reason`` tells that failure from any other, and ``trainer.run`` turns it into one
line, ``error: rank 0 lost a peer during step 7 (...): the job stops; ...``, in place of the
traceback through the step that happened to be waiting (a bug's traceback stays).

Keys live under ``tessera/watchdog/<restart>/<generation>/``: the restart count of the elastic
launcher, and how many runs this rank's process started before (the test harness runs several
in one process group), so no run reads another's beats or verdict.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

PREFIX = "tessera/watchdog"


def heartbeat_limit(timeout_s: float, interval_s: float) -> float:
    """Seconds of silence after which a rank counts as lost: half the collective timeout (at
    least two intervals)."""
    return max(timeout_s / 2, 2 * interval_s)


class Watchdog:
    """One rank's heartbeat and store-watching threads; see the module docstring. `store` is a
    connection of its
    own to the rendezvous store."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float,
                 interval_s: float | None = None,
                 on_lost: Callable[[str], None] | None = None):
        """`on_lost(message)` ends the rank (default: print ``error: message``, os._exit(1))."""
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.on_lost = on_lost or _print_and_exit
        self.interval_s = interval_s if interval_s is not None else min(1.0, timeout_s / 10)
        self.limit_s = heartbeat_limit(timeout_s, self.interval_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        generation = store.add(f"{PREFIX}/{restart}/generation/{rank}", 1)
        self.store = dist.PrefixStore(f"{PREFIX}/{restart}/{generation}", store)
        self.peer = (rank + 1) % world
        self.store_host: int | None = None
        """The rank whose process serves the store, if one does: the store's silence is its."""
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self._answered, self._store_error = time.monotonic(), "no answer"
        self._threads = [threading.Thread(target=self._loop, name="tessera-heartbeat",
                                          daemon=True),
                         threading.Thread(target=self._watch_store, name="tessera-store-watch",
                                          daemon=True)]

    @classmethod
    def start_for_run(cls, rank: int, world: int, timeout_s: float) -> Watchdog | None:
        """A running watchdog for this rank, or None on one rank or without a rendezvous
        address (MASTER_ADDR/MASTER_PORT, as torchrun and tessera.testing set them)."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world < 2 or not addr or not port:
            return None
        store = dist.TCPStore(addr, int(port), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        watchdog = cls(store, rank, world, timeout_s)
        # torchrun without its agent's store (tessera's launcher) puts it in rank 0's process.
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
            watchdog.store_host = 0
        watchdog.start()
        return watchdog

    def start(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        self._answered = time.monotonic()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Mark this rank finished (its watcher stops expecting beats) and end the threads."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.limit_s)
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store went first; nobody is left to watch us
            pass

    def _loop(self) -> None:
        """Beat, watch the peer, read the verdict; a store operation may block without end
        (its host stopped: the connection stays open), which _watch_store sees."""
        seen, moved = -1, time.monotonic()
        watching = True
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if watching:
                    count = self.store.add(f"beat/{self.peer}", 0)
                    now = time.monotonic()
                    if count != seen:
                        seen, moved = count, now
                    elif now - moved > self.limit_s:
                        if self.store.check([f"done/{self.peer}"]):
                            watching = False
                        else:
                            self.store.compare_set(
                                "lost", "", f"{self.peer} {now - moved:.1f} {self.rank}")
                if self.store.check(["lost"]):
                    self._exit(self._verdict(self.store.get("lost").decode()))
                self._answered = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the store itself is gone or failing
                self._store_error = str(e).splitlines()[0]

    def _watch_store(self) -> None:
        """The store's own silence: no round of _loop has completed for the limit."""
        while not self._stop.wait(self.interval_s):
            silent = time.monotonic() - self._answered
            if silent > self.limit_s:
                self._exit(self._store_verdict(silent, self._store_error))

    def _verdict(self, lost: str) -> str:
        rank, silent, seen_by = lost.split()
        return (f"rank {rank} stopped answering (no heartbeat for {silent} s, seen by rank "
                f"{seen_by}; collective timeout {self.timeout_s:g} s)")

    def _store_verdict(self, silent: float, error: str) -> str:
        if self.store_host is not None and self.store_host != self.rank:
            return (f"rank {self.store_host} stopped answering (the rendezvous store it serves "
                    f"has not answered rank {self.rank} for {silent:.1f} s: {error}; collective "
                    f"timeout {self.timeout_s:g} s)")
        return (f"the rendezvous store has not answered rank {self.rank} for {silent:.1f} s "
                f"({error}; collective timeout {self.timeout_s:g} s)")

    def _exit(self, message: str) -> None:
        with self._exiting:  # one verdict, from whichever thread reaches one first
            if self._stop.is_set():
                return
            self._stop.set()
        self.on_lost(message)


def _print_and_exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited")
"""What a collective says when a process it talks to went away: gloo's transport (a closed or
reset connection, a write to a closed one), torch's store client, NCCL's remote error."""


def peer_loss_reason(error: BaseException) -> str | None:
    """The first sentence of `error` (without gloo's source location) if it is a collective or
    store operation failing because a peer process went away, else None: torch's network errors
    (DistNetworkError) and the RuntimeErrors (DistBackendError among them) whose message says a
    connection closed. A timeout is not one: a rank that is alive but late (or a desync bug)
    keeps its traceback, and a silent rank is named by the Watchdog."""
    import torch.distributed as dist

    if not isinstance(error, RuntimeError):
        return None
    message = str(error)
    if not (isinstance(error, dist.DistNetworkError) or any(p in message for p in PEER_GONE)):
        return None
    first = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # "[.../pair.cc:553] "
    first = re.split(r"(?<=\S)\.(\s|$)", first)[0]  # the first sentence, ports kept
    return first[:160]
