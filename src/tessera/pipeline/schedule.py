"""The pipeline schedule as data: per-rank ordered action lists, a string form, a validator.

One representation drives everything else in ``tessera.pipeline``: the generators in
``schedules.py`` produce it, ``simulator.py`` times it, ``runtime.py`` executes it over
torch.distributed, ``timeline.py`` draws it, and the planner reads the simulator's numbers.

An :class:`Action` is one of

- ``F``/``B``: forward/backward of micro-batch ``m`` on model chunk ``c`` (compute actions);
- ``SEND_F``/``RECV_F``: the activation leaving chunk ``c`` / entering chunk ``c`` for ``m``;
- ``SEND_B``/``RECV_B``: the gradient leaving chunk ``c`` (w.r.t. its input) / entering it
  (w.r.t. its output);
- ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` (ZeRO-3, *sharding actions*, no micro-batch): start
  the all-gather of chunk ``c``'s parameters over the data-parallel group (the chunk's next
  compute waits for it) / free them / start the reduce-scatter of the gradients the chunk
  accumulated over its micro-batches (waited for at the step's end).

Its compact string form follows torchtitan: ``{chunk}{kind}{microbatch}``, e.g. ``1F0``
(forward of micro-batch 0 on chunk 1) or ``2RECV_B3``; sharding actions are ``{chunk}{kind}``,
e.g. ``1UNSHARD``. A :class:`Schedule` is one list per rank; its string form is one line per
rank, ``rank 0: 0F0 0F1 0B0 0B1``.

Chunks are the p·v pieces of the model in order (chunk 0 holds the embedding, chunk p·v-1 the
head and loss). Which rank runs a chunk is read off the schedule itself (the rank whose list
holds its compute actions), so looping placement (chunk c on rank c mod p), V-shapes or any
other placement are all the same data.

:func:`lower_comms` adds the send/receive actions a compute-only schedule needs: right after a
compute action, the sends of what it produced for another rank; right before one, the receives
of what it consumes from another rank. Consecutive communication actions on a rank form one
*batch*, posted together (``batch_isend_irecv`` in the runtime).

:func:`add_sharding_actions` adds the sharding actions for ZeRO-3 (see its docstring: a chunk
is gathered once per run of consecutive compute actions on it, one compute action ahead).

:func:`validate` checks a schedule before anything runs:

1. every forward and backward of every (chunk, micro-batch) appears exactly once, all of a
   chunk's actions on one rank, and each forward before its backward on that rank;
2. (lowered schedules) every send has its receive and vice versa, on the right ranks, each
   receive before the compute that consumes it and each send after the compute that produces it;
3. it cannot deadlock: execution is simulated with *blocking* semantics, where a batch of
   communication completes only when every operation in it is matched by the peer (sends and
   receives between a pair of ranks match in FIFO order, as NCCL requires), and a compute
   action waits for its inputs. A schedule that passes runs under any weaker semantics too
   (the runtime's non-blocking sends);
4. (sharded schedules: any sharding action present) every compute action of a chunk runs while
   the chunk is unsharded (an ``UNSHARD`` before it and no ``RESHARD`` in between), every chunk
   ends the step resharded, and a chunk with backwards has exactly one ``REDUCE_GRAD``, after
   its last backward. Sharding actions are local to a rank and may repeat: the exactly-once
   rule of 1 is for compute and send/receive actions.
"""

from __future__ import annotations

import enum
import functools
import re
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class ScheduleError(ValueError):
    """A schedule is malformed or cannot run. The message is one line meant for the user."""


class Kind(enum.Enum):
    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_p2p(self) -> bool:
        """A send or receive between pipeline ranks."""
        return self in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)

    @property
    def is_sharding(self) -> bool:
        """A ZeRO-3 action on a chunk's parameters or gradients (data-parallel group)."""
        return self in (Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD)


COMPUTE = (Kind.F, Kind.B)
SHARDING = (Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD)
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")
_SHARDING_RE = re.compile(r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: `kind` applied to micro-batch `microbatch` of chunk `chunk`
    (sharding actions act on all of a chunk's micro-batches: `microbatch` is -1)."""

    chunk: int
    kind: Kind
    microbatch: int = -1

    def __hash__(self) -> int:
        # The kind's name, a plain str (an Enum member hashes in Python code): actions are
        # dictionary keys throughout the simulator, which the planner runs thousands of times.
        return hash((self.chunk, self.kind._name_, self.microbatch))

    def __str__(self) -> str:
        if self.kind.is_sharding:
            return f"{self.chunk}{self.kind.value}"
        return f"{self.chunk}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match:
            return cls(int(match[1]), Kind(match[2]), int(match[3]))
        match = _SHARDING_RE.match(text.strip())
        if match:
            return cls(int(match[1]), Kind(match[2]))
        raise ScheduleError(f"action {text!r}: expected {{chunk}}{{kind}}{{microbatch}} with kind "
                            f"in F, B, SEND_F, RECV_F, SEND_B, RECV_B (e.g. 1F0), or "
                            f"{{chunk}}{{kind}} with kind in UNSHARD, RESHARD, REDUCE_GRAD "
                            f"(e.g. 1UNSHARD)")


@functools.lru_cache(maxsize=1 << 16)
def F(chunk: int, mb: int) -> Action:
    """The forward of micro-batch `mb` on chunk `chunk` (actions are immutable, so the
    generators share one object per pair: the planner generates hundreds of thousands)."""
    return Action(chunk, Kind.F, mb)


@functools.lru_cache(maxsize=1 << 16)
def B(chunk: int, mb: int) -> Action:
    """The backward of micro-batch `mb` on chunk `chunk` (shared, as :func:`F`)."""
    return Action(chunk, Kind.B, mb)


@dataclass(eq=False)
class Schedule:
    """Per-rank ordered action lists for `n_microbatches` micro-batches over `n_chunks` chunks."""

    name: str
    actions: list[list[Action]]
    """actions[r]: what rank r does, in order."""
    n_chunks: int
    n_microbatches: int
    chunk_rank: tuple[int, ...] = field(default=())
    """chunk_rank[c]: the rank that runs chunk c (read off the compute actions if not given)."""

    def __post_init__(self) -> None:
        if not self.chunk_rank:
            self.chunk_rank = infer_chunk_rank(self.actions, self.n_chunks)
        self.chunk_rank = tuple(self.chunk_rank)

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    @property
    def virtual(self) -> int:
        """Chunks per rank (v)."""
        return max(1, self.n_chunks // max(1, self.n_ranks))

    @property
    def forward_only(self) -> bool:
        """No backward anywhere: an evaluation schedule."""
        return not any(a.kind is Kind.B for acts in self.actions for a in acts)

    @property
    def is_lowered(self) -> bool:
        """Has its sends and receives (``lower_comms``)."""
        return any(a.kind.is_p2p for acts in self.actions for a in acts)

    @property
    def is_sharded(self) -> bool:
        """Has ZeRO-3 sharding actions (``add_sharding_actions``)."""
        return any(a.kind.is_sharding for acts in self.actions for a in acts)

    def chunks_of(self, rank: int) -> list[int]:
        return [c for c, r in enumerate(self.chunk_rank) if r == rank]

    def compute_only(self) -> Schedule:
        """The F/B actions alone (no communication, no sharding actions)."""
        compute = [[a for a in acts if a.kind.is_compute] for acts in self.actions]
        return Schedule(self.name, compute, self.n_chunks, self.n_microbatches, self.chunk_rank)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Schedule) and self.actions == other.actions
                and self.n_chunks == other.n_chunks and self.n_microbatches == other.n_microbatches
                and self.chunk_rank == other.chunk_rank)

    # -- string form ------------------------------------------------------------------------
    def to_string(self) -> str:
        """One line per rank: ``rank R: 0F0 0F1 ...`` (the compact form :func:`parse` reads)."""
        header = (f"# schedule={self.name} ranks={self.n_ranks} chunks={self.n_chunks} "
                  f"microbatches={self.n_microbatches}")
        lines = [f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in
                 enumerate(self.actions)]
        return "\n".join([header, *lines])

    def __str__(self) -> str:
        return self.to_string()

    def grid(self, costs: object | None = None, cell: int | None = None) -> str:
        """Text grid, ranks × time: each compute action in the time slots the simulator gives
        it (unit forward and backward costs unless `costs` is given); '.' marks a bubble."""
        from tessera.pipeline.simulator import StageCosts, simulate

        costs = costs or StageCosts(forward=1.0, backward=1.0)
        result = simulate(self, costs)
        times = sorted({e.start for e in result.timeline} | {e.end for e in result.timeline})
        unit = min((b - a for a, b in zip(times, times[1:], strict=False) if b - a > 1e-12),
                   default=1.0)
        n_slots = round(result.makespan / unit)
        show_chunk = self.n_chunks > self.n_ranks
        cells: list[list[str]] = [["."] * n_slots for _ in range(self.n_ranks)]
        for e in result.timeline:
            if e.kind not in ("F", "B"):
                continue
            label = f"{e.chunk}{e.kind}{e.microbatch}" if show_chunk else f"{e.kind}{e.microbatch}"
            for slot in range(round(e.start / unit), round(e.end / unit)):
                cells[e.rank][slot] = label
        width = cell or max(len(c) for row in cells for c in row)
        rows = [f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip()
                for r, row in enumerate(cells)]
        return "\n".join(rows)


def infer_chunk_rank(actions: Sequence[Sequence[Action]], n_chunks: int) -> tuple[int, ...]:
    """The rank running each chunk, from where its compute actions are; one rank per chunk."""
    owner: dict[int, int] = {}
    for r, acts in enumerate(actions):
        for a in acts:
            if not a.kind.is_compute:
                continue
            if not 0 <= a.chunk < n_chunks:
                raise ScheduleError(f"rank {r}: action {a} names chunk {a.chunk}, but the "
                                    f"schedule has chunks 0..{n_chunks - 1}")
            if owner.setdefault(a.chunk, r) != r:
                raise ScheduleError(f"chunk {a.chunk} is computed on ranks {owner[a.chunk]} "
                                    f"and {r}: a chunk must live on one rank")
    missing = [c for c in range(n_chunks) if c not in owner]
    if missing:
        raise ScheduleError(f"chunk {missing[0]} has no compute action on any rank")
    return tuple(owner[c] for c in range(n_chunks))


_HEADER_RE = re.compile(r"(\w+)=(\S+)")


def parse(text: str, name: str | None = None) -> Schedule:
    """Read the string form back: ``rank R: a a a`` lines (``R:`` alone also works); chunk and
    micro-batch counts come from a ``# ...`` header line if present, else from the actions."""
    header: dict[str, str] = {}
    rows: dict[int, list[Action]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            header.update(_HEADER_RE.findall(line))
            continue
        label, sep, body = line.partition(":")
        label = label.strip().removeprefix("rank").strip()
        if not sep or not label.isdigit():
            raise ScheduleError(f"line {number}: {raw.strip()!r}: expected 'rank R: actions'")
        rank = int(label)
        if rank in rows:
            raise ScheduleError(f"line {number}: rank {rank} listed twice")
        rows[rank] = [Action.parse(tok) for tok in re.split(r"[\s,]+", body.strip()) if tok]
    if not rows:
        raise ScheduleError("schedule text has no 'rank R: ...' lines")
    if sorted(rows) != list(range(len(rows))):
        raise ScheduleError(f"ranks {sorted(rows)}: expected ranks 0..{len(rows) - 1}")
    actions = [rows[r] for r in range(len(rows))]
    every = [a for acts in actions for a in acts]
    n_chunks = int(header.get("chunks", max(a.chunk for a in every) + 1))
    n_mb = int(header.get("microbatches", max(a.microbatch for a in every) + 1))
    return Schedule(name or header.get("schedule", "custom"), actions, n_chunks, n_mb)


# ---------------------------------------------------------------------------------------------
# Dependencies and lowering


def inputs_of(a: Action, n_chunks: int) -> list[Action]:
    """Compute actions whose results `a` consumes (the loss sits in the last chunk's F)."""
    if not a.kind.is_compute:
        raise ValueError(a)
    return [F(c, mb) if forward else B(c, mb)
            for c, forward, mb in input_keys(a.chunk, a.kind is Kind.F, a.microbatch, n_chunks)]


def input_keys(chunk: int, forward: bool, mb: int,
               n_chunks: int) -> list[tuple[int, bool, int]]:
    """:func:`inputs_of` as (chunk, is forward, micro-batch) keys: F(c, m) needs F(c-1, m);
    B(c, m) needs F(c, m) and B(c+1, m). Plain tuples, for the simulator's hot loop."""
    if forward:
        return [(chunk - 1, True, mb)] if chunk > 0 else []
    return [(chunk, True, mb)] + ([(chunk + 1, False, mb)] if chunk < n_chunks - 1 else [])


def send_for(producer: Action, n_chunks: int) -> Action | None:
    """The send that carries `producer`'s result to the next chunk in its direction, if any."""
    if producer.kind is Kind.F and producer.chunk < n_chunks - 1:
        return Action(producer.chunk, Kind.SEND_F, producer.microbatch)
    if producer.kind is Kind.B and producer.chunk > 0:
        return Action(producer.chunk, Kind.SEND_B, producer.microbatch)
    return None


def recv_for(consumer: Action, n_chunks: int) -> Action | None:
    """The receive that brings `consumer` its input from the neighbouring chunk, if any."""
    if consumer.kind is Kind.F and consumer.chunk > 0:
        return Action(consumer.chunk, Kind.RECV_F, consumer.microbatch)
    if consumer.kind is Kind.B and consumer.chunk < n_chunks - 1:
        return Action(consumer.chunk, Kind.RECV_B, consumer.microbatch)
    return None


def peer_chunk(a: Action) -> int:
    """The chunk on the other end of communication action `a`."""
    return a.chunk + 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else a.chunk - 1


def matching(a: Action) -> Action:
    """The action on the peer that pairs with send/receive `a`."""
    pair = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F,
            Kind.SEND_B: Kind.RECV_B, Kind.RECV_B: Kind.SEND_B}[a.kind]
    return Action(peer_chunk(a), pair, a.microbatch)


def lower_comms(schedule: Schedule) -> Schedule:
    """Add sends and receives between compute actions on different ranks (see module doc).

    A send goes right after the compute that produces it. A receive goes right before the
    compute that consumes it, preceded by any receive from the same peer that the peer sends
    earlier and this rank has not yet received: sends and receives between two ranks must
    come in the same order (NCCL matches them in FIFO order). Receiving such a message early
    never waits longer than the consumer would anyway, since its peer sends it first.
    Schedules whose consumers already take messages in send order (every registered schedule
    at its default parameters) are unchanged by that rule; interleaved 1F1B with micro-batch
    groups of G != p needs it."""
    if schedule.is_lowered:
        return schedule
    owner, n = schedule.chunk_rank, schedule.n_chunks
    # Per (sender, receiver): the receives in the order the sender sends.
    arriving: dict[tuple[int, int], list[Action]] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            send = send_for(a, n)
            if send is not None and owner[peer_chunk(send)] != r:
                arriving.setdefault((r, owner[peer_chunk(send)]), []).append(matching(send))
    queues = {pair: deque(recvs) for pair, recvs in arriving.items()}
    lowered: list[list[Action]] = []
    for r, acts in enumerate(schedule.actions):
        out: list[Action] = []
        received: set[Action] = set()
        for a in acts:
            recv = recv_for(a, n)
            if recv is not None and owner[peer_chunk(recv)] != r and recv not in received:
                queue = queues[(owner[peer_chunk(recv)], r)]
                while True:  # every message the peer sends before this one, then this one
                    early = queue.popleft()
                    out.append(early)
                    received.add(early)
                    if early == recv:
                        break
            out.append(a)
            send = send_for(a, n)
            if send is not None and owner[peer_chunk(send)] != r:
                out.append(send)
        lowered.append(out)
    return Schedule(schedule.name, lowered, n, schedule.n_microbatches, owner)


def add_sharding_actions(schedule: Schedule, prefetch: int = 1) -> Schedule:
    """ZeRO-3's sharding actions for `schedule` (compute-only or lowered; returned in the same
    form).

    On each rank a *run* is a maximal sequence of consecutive compute actions on one chunk. A
    chunk is gathered for each of its runs and freed after it, with two refinements:

    - prefetch: the ``UNSHARD`` is issued `prefetch` compute actions before the run's first
      action, so the all-gather overlaps the compute in between (prefetch = 1 keeps at most
      the running chunk and the next one gathered);
    - two runs of a chunk whose gap is too short for that (the ``UNSHARD`` would come right
      after, or before, the ``RESHARD``) are joined: the chunk stays gathered across the gap.

    The ``REDUCE_GRAD`` of a chunk comes right after its last backward, before its ``RESHARD``.

    Breadth-first (``bfs``, v chunks c_1 < ... < c_v on a rank) runs F(c_1)×m, ..., F(c_v)×m
    B(c_v)×m, B(c_(v-1))×m, ..., B(c_1)×m: each chunk is gathered twice per step (its forwards,
    its backwards) except c_v, whose backwards follow its forwards (once): 2v - 1 gathers and v
    reductions per rank per step, whatever m. Depth-first schedules pay with m instead: their
    runs are single actions (1F1B alternates chunks, or F and B of other micro-batches come
    between), so a chunk is either regathered per micro-batch or, where the gaps are short,
    joined and kept gathered (1F1B with v = 1: the rank's one chunk, i.e. all its parameters,
    for the whole step).
    """
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch}: must be >= 0")
    if schedule.is_sharded:
        raise ScheduleError(f"schedule {schedule.name!r} already has sharding actions")
    base = schedule.compute_only()
    out_actions: list[list[Action]] = []
    for acts in base.actions:
        # Intervals [chunk, first action gathered for, last action]: one per (joined) run.
        intervals: list[list[int]] = []
        open_interval: dict[int, list[int]] = {}
        last_backward: dict[int, int] = {}
        i = 0
        while i < len(acts):
            c, first = acts[i].chunk, i
            while i + 1 < len(acts) and acts[i + 1].chunk == c:
                i += 1
            opens = max(first - prefetch, 0)
            prev = open_interval.get(c)
            if prev is not None and opens <= prev[2] + 1:
                prev[2] = i  # the gap is too short to free and regather: stay gathered
            else:
                open_interval[c] = [c, opens, i]
                intervals.append(open_interval[c])
            i += 1
        for j, a in enumerate(acts):
            if a.kind is Kind.B:
                last_backward[a.chunk] = j
        unshard_before: dict[int, list[int]] = defaultdict(list)
        reshard_after: dict[int, list[int]] = defaultdict(list)
        for c, opens, closes in intervals:
            unshard_before[opens].append(c)
            reshard_after[closes].append(c)
        out: list[Action] = []
        for j, a in enumerate(acts):
            out += [Action(c, Kind.UNSHARD) for c in unshard_before[j]]
            out.append(a)
            if last_backward.get(a.chunk) == j:
                out.append(Action(a.chunk, Kind.REDUCE_GRAD))
            out += [Action(c, Kind.RESHARD) for c in reshard_after[j]]
        out_actions.append(out)
    sharded = Schedule(schedule.name, out_actions, schedule.n_chunks, schedule.n_microbatches,
                       schedule.chunk_rank)
    return lower_comms(sharded) if schedule.is_lowered else sharded


def batches(actions: Sequence[Action]) -> list[list[Action]]:
    """Split a rank's list into steps: each compute or sharding action alone, each run of
    sends and receives together."""
    out: list[list[Action]] = []
    for a in actions:
        if not a.kind.is_p2p or not out or not out[-1][0].kind.is_p2p:
            out.append([a])
        else:
            out[-1].append(a)
    return out


# ---------------------------------------------------------------------------------------------
# Validation


def _check_structure(s: Schedule) -> None:
    if s.n_ranks < 1 or s.n_chunks < 1 or s.n_microbatches < 1:
        raise ScheduleError(f"schedule {s.name!r}: needs at least one rank, chunk and "
                            f"micro-batch (got {s.n_ranks}, {s.n_chunks}, {s.n_microbatches})")
    if len(s.chunk_rank) != s.n_chunks:
        raise ScheduleError(f"chunk placement lists {len(s.chunk_rank)} chunks, schedule has "
                            f"{s.n_chunks}")
    owner = infer_chunk_rank(s.actions, s.n_chunks)
    if owner != s.chunk_rank:
        raise ScheduleError(f"chunk placement {list(s.chunk_rank)} disagrees with where the "
                            f"compute actions are ({list(owner)})")
    seen: dict[Action, int] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind.is_sharding:
                if not 0 <= a.chunk < s.n_chunks or s.chunk_rank[a.chunk] != r:
                    raise ScheduleError(f"rank {r}: {a} acts on chunk {a.chunk}, which this "
                                        f"rank does not run")
                continue
            if not 0 <= a.microbatch < s.n_microbatches:
                raise ScheduleError(f"rank {r}: action {a} names micro-batch {a.microbatch}, "
                                    f"but the schedule has 0..{s.n_microbatches - 1}")
            if not 0 <= a.chunk < s.n_chunks:
                raise ScheduleError(f"rank {r}: action {a} names chunk {a.chunk}, but the "
                                    f"schedule has 0..{s.n_chunks - 1}")
            if a in seen:
                raise ScheduleError(f"action {a} appears twice (ranks {seen[a]} and {r})")
            seen[a] = r
            if not a.kind.is_compute:
                if not 0 <= peer_chunk(a) < s.n_chunks:
                    raise ScheduleError(f"rank {r}: {a} has no neighbouring chunk to talk to")
                if s.chunk_rank[a.chunk] != r:
                    raise ScheduleError(f"rank {r}: {a} is on rank {r} but chunk {a.chunk} "
                                        f"runs on rank {s.chunk_rank[a.chunk]}")
                if s.chunk_rank[peer_chunk(a)] == r:
                    raise ScheduleError(f"rank {r}: {a} talks to chunk {peer_chunk(a)} on the "
                                        f"same rank; local hand-offs need no communication")
    for kind in (Kind.F,) if s.forward_only else COMPUTE:
        for c in range(s.n_chunks):
            for m in range(s.n_microbatches):
                if Action(c, kind, m) not in seen:
                    raise ScheduleError(f"action {Action(c, kind, m)} (the {kind.name} of "
                                        f"micro-batch {m} on chunk {c}) is missing")
    for r, acts in enumerate(s.actions):
        position = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind is Kind.B and position[F(a.chunk, a.microbatch)] > position[a]:
                raise ScheduleError(f"rank {r}: backward {a} comes before its forward "
                                    f"{F(a.chunk, a.microbatch)}")


def _check_comms(s: Schedule) -> None:
    """In a lowered schedule every cross-rank hand-off has a send and a receive, in place."""
    n, owner = s.n_chunks, s.chunk_rank
    present = {a for acts in s.actions for a in acts}
    for r, acts in enumerate(s.actions):
        position = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind.is_sharding:
                continue
            if not a.kind.is_compute:
                if matching(a) not in present:
                    what = "receive" if a.kind.is_send else "send"
                    raise ScheduleError(f"rank {r}: {a} has no matching {what} "
                                        f"{matching(a)} on rank {owner[peer_chunk(a)]}")
                continue
            recv, send = recv_for(a, n), send_for(a, n)
            if recv is not None and owner[peer_chunk(recv)] != r:
                if recv not in position:
                    raise ScheduleError(f"rank {r}: {a} needs {recv} (its input from rank "
                                        f"{owner[peer_chunk(recv)]}), which is missing")
                if position[recv] > position[a]:
                    raise ScheduleError(f"rank {r}: {recv} comes after {a}, which needs it")
            if send is not None and owner[peer_chunk(send)] != r:
                if send not in position:
                    raise ScheduleError(f"rank {r}: result of {a} is never sent ({send} to "
                                        f"rank {owner[peer_chunk(send)]} is missing)")
                if position[send] < position[a]:
                    raise ScheduleError(f"rank {r}: {send} comes before {a}, which produces it")


def _simulate_blocking(s: Schedule) -> None:
    """Run the schedule symbolically; raise if some rank can never make progress."""
    n, owner = s.n_chunks, s.chunk_rank
    steps = [batches(acts) for acts in s.actions]
    lowered = s.is_lowered
    pc = [0] * s.n_ranks
    done: set[Action] = set()
    posted: dict[int, bool] = defaultdict(bool)  # rank -> its current batch is posted
    # FIFO channels: (src, dst) -> actions posted and not yet matched.
    sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    matched: set[Action] = set()

    def channel(rank: int, a: Action) -> tuple[int, int]:
        peer = owner[peer_chunk(a)]
        return (rank, peer) if a.kind.is_send else (peer, rank)

    progress = True
    while progress:
        progress = False
        for r in range(s.n_ranks):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if step[0].kind.is_sharding:
                    pass  # local to this rank (its dp-group collective never waits on pp peers)
                elif step[0].kind.is_compute:
                    a = step[0]
                    local = [d for d in inputs_of(a, n) if owner[d.chunk] == r]
                    remote_ok = (lowered or
                                 all(d in done for d in inputs_of(a, n) if owner[d.chunk] != r))
                    if not (all(d in done for d in local) and remote_ok):
                        break
                    done.add(a)
                else:
                    if not posted[r]:
                        posted[r] = True
                        for a in step:
                            queue = sends if a.kind.is_send else recvs
                            queue[channel(r, a)].append(a)
                        _match(sends, recvs, matched)
                    if not all(a in matched for a in step if not a.kind.is_send):
                        break
                    posted[r] = False
                    done.update(step)
                pc[r] += 1
                progress = True
    stuck = [r for r in range(s.n_ranks) if pc[r] < len(steps[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at {' '.join(map(str, steps[r][pc[r]]))}" for r in stuck)
        raise ScheduleError(f"schedule {s.name!r} deadlocks: {waits}")


def _match(sends: dict, recvs: dict, matched: set[Action]) -> None:
    for key in list(sends):
        q_send, q_recv = sends[key], recvs[key]
        while q_send and q_recv:
            a, b = q_send.pop(0), q_recv.pop(0)
            if matching(a) != b:
                raise ScheduleError(f"rank {key[0]} -> rank {key[1]}: send {a} would be "
                                    f"received by {b} (sends and receives between two ranks "
                                    f"must come in the same order)")
            matched.update((a, b))


def _check_sharding(s: Schedule) -> None:
    """Rule 4 of the module doc: compute only on unsharded chunks; REDUCE_GRAD once, after the
    chunk's last backward; every chunk resharded by the end."""
    for r, acts in enumerate(s.actions):
        unsharded: dict[int, bool] = {}
        last_backward: dict[int, Action] = {}
        reduced: dict[int, int] = {}  # chunk -> how many REDUCE_GRADs so far
        for a in acts:
            c = a.chunk
            if a.kind is Kind.UNSHARD:
                if unsharded.get(c):
                    raise ScheduleError(f"rank {r}: {a} while chunk {c} is already unsharded "
                                        f"(no {c}RESHARD since the last {c}UNSHARD)")
                unsharded[c] = True
            elif a.kind is Kind.RESHARD:
                if not unsharded.get(c):
                    raise ScheduleError(f"rank {r}: {a} but chunk {c} is not unsharded")
                unsharded[c] = False
            elif a.kind is Kind.REDUCE_GRAD:
                reduced[c] = reduced.get(c, 0) + 1
                if reduced[c] > 1:
                    raise ScheduleError(f"rank {r}: {a} appears twice (a chunk's gradient is "
                                        f"reduced once per step)")
            elif a.kind.is_compute:
                if not unsharded.get(c):
                    raise ScheduleError(f"rank {r}: {a} runs while chunk {c} is sharded (needs "
                                        f"{c}UNSHARD before it, with no {c}RESHARD in between)")
                if a.kind is Kind.B:
                    if reduced.get(c):
                        raise ScheduleError(f"rank {r}: {c}REDUCE_GRAD comes before {a}; it "
                                            f"must follow the chunk's last backward")
                    last_backward[c] = a
        still = [c for c, on in unsharded.items() if on]
        if still:
            raise ScheduleError(f"rank {r}: chunk {still[0]} is still unsharded at the end of "
                                f"the step (add {still[0]}RESHARD)")
        for c in s.chunks_of(r):
            if c in last_backward and not reduced.get(c):
                raise ScheduleError(f"rank {r}: chunk {c} has no {c}REDUCE_GRAD after its last "
                                    f"backward {last_backward[c]}")
            if c not in last_backward and reduced.get(c):
                raise ScheduleError(f"rank {r}: {c}REDUCE_GRAD but chunk {c} has no backward")


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` (see module doc); return it unchanged, or raise ScheduleError."""
    _check_structure(schedule)
    if schedule.is_sharded:
        _check_sharding(schedule)
    if schedule.is_lowered:
        _check_comms(schedule)
    _simulate_blocking(schedule)
    if not schedule.is_lowered:
        _simulate_blocking(lower_comms(schedule))
    return schedule


def forward_only(schedule: Schedule) -> Schedule:
    """The same schedule without backward work (and its communication): for evaluation.
    Sharding actions are dropped too (``add_sharding_actions`` gives the forward pass its own)."""
    keep = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    return Schedule(f"{schedule.name}-forward", [[a for a in acts if a.kind in keep]
                                                 for acts in schedule.actions],
                    schedule.n_chunks, schedule.n_microbatches, schedule.chunk_rank)


def from_orders(name: str, orders: Iterable[Iterable[Action]], n_chunks: int,
                n_microbatches: int) -> Schedule:
    """A compute-only schedule from per-rank orders of F/B actions."""
    return Schedule(name, [list(o) for o in orders], n_chunks, n_microbatches)
