"""Timestamps of data-parallel collectives, and the communication time a step was exposed to.

DDP buckets and ZeRO units start collectives that run beside compute (backend threads, or our
side thread). What the step pays for them is the time the compute thread *waits* on their
handles: a collective finished behind compute costs a wait of ~0, one still running when its
result is needed costs the rest of its run. So each wrapper keeps a :class:`CommLog` of

- instants, ``start == end``: "launch" (a DDP bucket's all-reduce started), "gather" and
  "reduce" (a ZeRO unit's all-gather / reduction started), "backward_end" (the step's last
  backward returned: ``finish_gradient_sync`` was called);
- intervals: "wait" (the compute thread blocked on a handle, from the call to its return).

``exposed()`` is the sum of the waits: the measured exposed communication of the step, the
quantity the planner predicts as ``Estimate.breakdown()["dp_exposed"]``. Recording costs two
``time.perf_counter()`` calls and an append per collective; it is always on. The executor
clears the logs when a step starts (``Executor.forward_backward``); code that drives a wrapper
directly for many steps clears it itself (the log grows by a few events per collective).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class CommEvent:
    what: str
    """"launch", "gather", "reduce", "backward_end" (instants) or "wait" (an interval)."""
    name: str
    """The bucket ("bucket3") or ZeRO unit ("block2") it concerns; "" for backward_end."""
    start: float
    end: float
    """time.perf_counter() seconds; equal to start for instants."""


class CommLog:
    """One wrapper's collective timestamps since the last ``clear()``."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def clear(self) -> None:
        self.events = []

    def mark(self, what: str, name: str = "") -> None:
        t = time.perf_counter()
        self.events.append(CommEvent(what, name, t, t))

    @contextlib.contextmanager
    def wait(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.events.append(CommEvent("wait", name, t0, time.perf_counter()))

    def exposed(self) -> float:
        """Seconds the compute thread spent blocked on collectives (sum of the waits)."""
        return sum(e.end - e.start for e in self.events if e.what == "wait")

    def times(self, what: str) -> list[float]:
        return [e.start for e in self.events if e.what == what]
