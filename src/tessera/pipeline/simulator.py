"""Time a schedule without running it: the same IR the runtime executes, with given costs.

Model. Each rank runs its compute actions in its listed order, one at a time. A forward of
micro-batch m on chunk c starts when the rank is free and the forward of (c-1, m) has finished,
plus one point-to-point transfer if chunk c-1 lives on another rank; a backward of (c, m)
needs its own forward and the backward of (c+1, m) (plus a transfer); the last chunk's backward
starts from the loss, computed in its forward. A split backward's I waits as a B does (for the
next chunk's B or I), and its W for its I alone; I and W have their own costs
(``StageCosts.input_grad``, ``weight_grad``; by default half the backward each). Transfers
cost ``p2p_latency + p2p_bytes / p2p_bandwidth`` and do not occupy the ranks (non-blocking
sends, as in the runtime).

Data-parallel gradient reduction: each chunk's gradients take ``dp_reduce[c]`` seconds to
reduce over the dp group, on a per-rank communication channel that runs one reduction at a
time. With ``dp_overlap`` a chunk's reduction may start as soon as its last backward (B or W)
is done (overlapping later compute, as bucketed DDP does); otherwise all start after the
rank's last compute action. The step ends when every rank's compute and reductions are done.

ZeRO-3 sharding actions (``schedule.add_sharding_actions``) use the same channel, in the order
the rank reaches them: ``UNSHARD`` of chunk c takes ``unshard[c]`` seconds from when the rank
reaches it (after its previous compute action) or the channel frees up, and the chunk's next
compute action waits for it; ``REDUCE_GRAD`` takes ``dp_reduce[c]`` the same way (and replaces
the chunk's reduction above); ``RESHARD`` is free. Their boxes are 'unshard' and 'reduce'.

Definitions (shared with the planner and the runtime's measured numbers):

- ``makespan``: the time until the last compute action finishes;
- ``compute_time``: the largest per-rank busy compute time;
- ``bubble_fraction = (makespan - compute_time) / compute_time``, so equal costs and free
  communication give (p-1)/m for GPipe and 1F1B and (p-1)/(v·m) for interleaved 1F1B;
- ``step_time``: the makespan plus the data-parallel reduction left exposed after it;
- ``peak_inflight[r]``: the largest number of (micro-batch, chunk) activation sets rank r holds
  at once (forward done, backward not yet; a split backward's set counts until its W, see
  :data:`W_HELD`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera.pipeline.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    input_keys,
    output_key,
)


@dataclass(kw_only=True)
class StageCosts:
    """Costs in seconds; per-chunk sequences are indexed by chunk (0..p·v-1)."""

    forward: float | Sequence[float]
    """Forward time of one micro-batch on a chunk."""
    backward: float | Sequence[float]
    """Backward time of one micro-batch on a chunk (a B action)."""
    input_grad: float | Sequence[float] | None = None
    """Time of an I action (input gradient only); None: half the backward."""
    weight_grad: float | Sequence[float] | None = None
    """Time of a W action (weight gradient only); None: the backward less the I time."""
    p2p_latency: float = 0.0
    """Fixed cost of one point-to-point transfer between ranks."""
    p2p_bytes: float = 0.0
    """Activation (or activation-gradient) bytes per transfer."""
    p2p_bandwidth: float = math.inf
    """Point-to-point bandwidth in bytes/s."""
    dp_reduce: float | Sequence[float] = 0.0
    """Time to reduce one chunk's gradients across the data-parallel group (all-reduce, or
    ZeRO-3's reduce-scatter at a REDUCE_GRAD action)."""
    unshard: float | Sequence[float] = 0.0
    """Time to all-gather one chunk's parameters across the data-parallel group (ZeRO-3's
    UNSHARD action)."""
    dp_overlap: bool = True
    """A chunk's reduction may start once its last backward is done (else all at the end)."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "input_grad", "weight_grad", "dp_reduce",
                     "unshard"):
            values = getattr(self, name)
            if values is None:
                continue
            values = [values] if isinstance(values, int | float) else list(values)
            if any(not math.isfinite(x) or x < 0 for x in values):
                raise ValueError(f"StageCosts.{name}={getattr(self, name)!r}: must be finite "
                                 f"and >= 0")
        for name in ("p2p_latency", "p2p_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"StageCosts.{name}={getattr(self, name)!r}: must be >= 0")
        if self.p2p_bandwidth <= 0:
            raise ValueError(f"StageCosts.p2p_bandwidth={self.p2p_bandwidth!r}: must be > 0")

    @staticmethod
    def _at(values: float | Sequence[float], chunk: int, name: str) -> float:
        if isinstance(values, int | float):
            return float(values)
        if chunk >= len(values):
            raise ValueError(f"StageCosts.{name} has {len(values)} entries; chunk {chunk} "
                             f"needs one")
        return float(values[chunk])

    @classmethod
    def units(cls, schedule: Schedule | None = None) -> StageCosts:
        """Unit costs: F = B = 1, or, for a schedule with split backwards, F = I = W = 1 and
        B = I + W = 2 (the zero-bubble paper's T_F = T_B = T_W)."""
        if schedule is not None and schedule.split_backward:
            return cls(forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0)
        return cls(forward=1.0, backward=1.0)

    def compute(self, a: Action) -> float:
        return self.cost(a.kind, a.chunk)

    def cost(self, kind: Kind, chunk: int) -> float:
        """Seconds of compute action `kind` on `chunk`."""
        if kind is Kind.F:
            return self._at(self.forward, chunk, "forward")
        backward = self._at(self.backward, chunk, "backward")
        if kind is Kind.B:
            return backward
        i = (backward / 2 if self.input_grad is None
             else self._at(self.input_grad, chunk, "input_grad"))
        if kind is Kind.I:
            return i
        return (max(backward - i, 0.0) if self.weight_grad is None
                else self._at(self.weight_grad, chunk, "weight_grad"))

    def reduce(self, chunk: int) -> float:
        return self._at(self.dp_reduce, chunk, "dp_reduce")

    def gather(self, chunk: int) -> float:
        return self._at(self.unshard, chunk, "unshard")

    @property
    def transfer(self) -> float:
        return self.p2p_latency + (0.0 if self.p2p_bytes == 0 else
                                   self.p2p_bytes / self.p2p_bandwidth)


@dataclass(frozen=True)
class TimelineEvent:
    """One box of the timeline: kind 'F', 'B', 'I', 'W' (compute), 'dp' (gradient reduction of
    a chunk), 'unshard' / 'reduce' (ZeRO-3's parameter all-gather / gradient reduce-scatter of
    a chunk), 'wait' (the runtime waiting for a receive); microbatch -1 for all but compute."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass(kw_only=True)
class SimResult:
    step_time: float
    """Makespan including the exposed data-parallel reduction."""
    compute_time: float
    """Largest per-rank busy compute time."""
    bubble_fraction: float
    """(makespan - compute_time) / compute_time, without data-parallel reduction."""
    peak_inflight: list[int]
    """Per rank: peak number of (micro-batch, chunk) activation sets held."""
    exposed_dp_time: float
    """step_time - makespan: reduction time not hidden behind compute."""
    makespan: float
    """Time until the last compute action ends."""
    busy: list[float] = field(default_factory=list)
    """Per rank busy compute time."""
    timeline: list[TimelineEvent] = field(default_factory=list)


def peak_unsharded(schedule: Schedule) -> list[int]:
    """Per rank, the most chunks gathered (UNSHARD issued, RESHARD not yet) at once."""
    peaks = []
    for acts in schedule.actions:
        held: set[int] = set()
        peak = 0
        for a in acts:
            if a.kind is Kind.UNSHARD:
                held.add(a.chunk)
                peak = max(peak, len(held))
            elif a.kind is Kind.RESHARD:
                held.discard(a.chunk)
        peaks.append(peak)
    return peaks


def unshard_counts(schedule: Schedule) -> list[dict[int, int]]:
    """Per rank, chunk -> UNSHARDs (parameter all-gathers of the chunk) per step."""
    return [{c: sum(1 for a in acts if a.kind is Kind.UNSHARD and a.chunk == c)
             for c in schedule.chunks_of(r)} for r, acts in enumerate(schedule.actions)]


W_HELD = 1.0
"""How much of a (micro-batch, chunk) activation set counts as held between its I and its W.
W needs the inputs of the chunk's linear layers and the output gradients I computed for them;
the runtime frees the rest at I, but how much that is depends on the model, so the count is
the upper bound: the whole set, until W. With it ZB-H1's and ZB-V's peaks equal 1F1B's
largest (rank 0's p sets; ZB-V's 2p half-size sets), the zero-bubble paper's accounting."""


def peak_inflight(schedule: Schedule, w_held: float = W_HELD) -> list[float]:
    """Per rank, the most (micro-batch, chunk) activation sets held at once: a set counts 1
    from its F to its B (or its I), then `w_held` until its W."""
    peaks: list[float] = []
    for acts in schedule.actions:
        held = peak = 0.0
        for a in acts:
            if a.kind is Kind.F:
                held += 1
                peak = max(peak, held)
            elif a.kind is Kind.B:
                held -= 1
            elif a.kind is Kind.I:
                held -= 1 - w_held
            elif a.kind is Kind.W:
                held -= w_held
        peaks.append(int(peak) if peak == int(peak) else peak)
    return peaks


@dataclass(frozen=True)
class Prepared:
    """What :func:`simulate` reads off a schedule before timing it; it depends on the
    schedule alone, so a caller timing one schedule under many costs (the planner) makes it
    once with :func:`prepare`. Compute actions are numbered, keyed by ``schedule.output_key``
    (chunk, what, micro-batch): plain tuples are cheaper than Actions. Each rank's steps are
    (action, its number, the (number, on another rank) pairs it waits for, its kind's value),
    number
    -1 for a
    sharding action; a dependency missing from the schedule gets the number `never`, which
    never finishes: its rank stays blocked and the schedule is refused."""

    orders: list[list[Action]]
    steps: list[list[tuple[Action, int, tuple[tuple[int, bool], ...], str]]]
    never: int
    computed: frozenset[int]
    """The chunks with compute actions."""
    peak_inflight: list[float]
    split: bool = False
    """Some backward is split into I and W."""


def prepare(schedule: Schedule) -> Prepared:
    owner, n = schedule.chunk_rank, schedule.n_chunks
    orders = [[a for a in acts if not a.kind.is_p2p] for acts in schedule.actions]
    number = {output_key(a): i
              for i, a in enumerate(a for acts in orders for a in acts if a.kind.is_compute)}
    never = len(number)
    steps = []
    for r, order in enumerate(orders):
        mine = []
        for a in order:
            kind = a.kind
            if kind.is_sharding:
                mine.append((a, -1, (), kind._value_))
                continue
            deps = tuple((number.get(d, never), owner[d[0]] != r)
                         for d in input_keys(a.chunk, kind, a.microbatch, n))
            mine.append((a, number[output_key(a)], deps, kind._value_))
        steps.append(mine)
    return Prepared(orders=orders, steps=steps, never=never,
                    computed=frozenset(c for c, _, _ in number),
                    peak_inflight=peak_inflight(schedule), split=schedule.split_backward)


def simulate(schedule: Schedule, costs: StageCosts, timeline: bool = True,
             prepared: Prepared | None = None) -> SimResult:
    """Time `schedule` under `costs` (see module doc). `timeline=False` leaves the result's
    timeline empty (the planner needs only the times); `prepared`: ``prepare(schedule)``
    where the caller keeps it."""
    if prepared is None:
        prepared = prepare(schedule)
    orders, steps, never = prepared.orders, prepared.steps, prepared.never
    finish: list[float | None] = [None] * (never + 1)
    # Per-chunk compute costs, looked up once (a chunk that has actions and no entry raises).
    kinds = (Kind.F, Kind.B, Kind.I, Kind.W) if prepared.split else (Kind.F, Kind.B)
    cost_of = {(k.value, c): costs.cost(k, c) for k in kinds for c in prepared.computed}
    transfer = costs.transfer
    free = [0.0] * schedule.n_ranks
    busy = [0.0] * schedule.n_ranks
    channel = [0.0] * schedule.n_ranks  # when each rank's dp communication channel is free
    pc = [0] * schedule.n_ranks
    events: list[TimelineEvent] = []
    last_backward: dict[int, float] = {}
    gathered: dict[int, float] = {}  # chunk -> when its latest all-gather is done
    reduced_by_action: set[int] = set()

    def collective(r: int, kind: str, chunk: int, cost: float) -> float:
        start = max(free[r], channel[r])
        channel[r] = start + cost
        if cost > 0 and timeline:
            events.append(TimelineEvent(r, kind, -1, chunk, start, channel[r]))
        return channel[r]

    # Each rank runs its actions in order until one waits for an action not yet finished; it
    # is woken when that one finishes. A rank's times depend only on its own order and the
    # finish times it waits for, so the order in which ranks are visited changes nothing.
    waiting: dict[int, list[int]] = {}
    runnable = deque(range(schedule.n_ranks))
    while runnable:
        r = runnable.popleft()
        mine, i = steps[r], pc[r]
        while i < len(mine):
            a, me, deps, kind = mine[i]
            if me < 0:  # a sharding action
                if a.kind is Kind.UNSHARD:
                    gathered[a.chunk] = collective(r, "unshard", a.chunk, costs.gather(a.chunk))
                elif a.kind is Kind.REDUCE_GRAD:
                    reduced_by_action.add(a.chunk)
                    collective(r, "reduce", a.chunk, costs.reduce(a.chunk))
                i += 1
                continue
            ready = max(free[r], gathered.get(a.chunk, 0.0))
            blocked = -1
            for d, remote in deps:
                done = finish[d]
                if done is None:
                    blocked = d
                    break
                ready = max(ready, done + transfer if remote else done)
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            cost = cost_of[kind, a.chunk]
            finish[me] = free[r] = end = ready + cost
            busy[r] += cost
            if timeline:
                events.append(TimelineEvent(r, a.kind.value, a.microbatch, a.chunk, ready, end))
            if (kind == "B" or kind == "W") and end > last_backward.get(a.chunk, 0.0):
                last_backward[a.chunk] = end
            runnable.extend(waiting.pop(me, ()))
            i += 1
        pc[r] = i
    if any(pc[r] < len(o) for r, o in enumerate(orders)):
        stuck = ", ".join(f"rank {r} at {o[pc[r]]}" for r, o in enumerate(orders)
                          if pc[r] < len(o))
        raise ScheduleError(f"schedule {schedule.name!r} cannot run: {stuck} waits forever")

    makespan = max(free, default=0.0)
    step_time = makespan
    for r in range(schedule.n_ranks):
        chunks = [c for c in schedule.chunks_of(r) if c not in reduced_by_action]
        ready = {c: last_backward.get(c, 0.0) if costs.dp_overlap else free[r] for c in chunks}
        for c in sorted(chunks, key=lambda c: (ready[c], c)):
            cost = costs.reduce(c)
            if cost == 0:
                continue
            start = max(channel[r], ready[c])
            channel[r] = start + cost
            if timeline:
                events.append(TimelineEvent(r, "dp", -1, c, start, channel[r]))
        step_time = max(step_time, channel[r])
    compute_time = max(busy, default=0.0)
    bubble = (makespan - compute_time) / compute_time if compute_time > 0 else 0.0
    return SimResult(step_time=step_time, compute_time=compute_time, bubble_fraction=bubble,
                     peak_inflight=prepared.peak_inflight, exposed_dp_time=step_time - makespan,
                     makespan=makespan, busy=busy, timeline=events)
