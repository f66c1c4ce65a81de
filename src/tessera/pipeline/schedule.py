"""The pipeline schedule as data: per-rank ordered action lists, a string form, lowering passes.

One representation drives everything else in ``tessera.pipeline``: the generators in
``schedules.py`` produce it, ``validator.py`` checks it, ``simulator.py`` times it,
``runtime.py`` executes it over torch.distributed, ``timeline.py`` draws it (text grid, PNG,
trace), and the planner reads the simulator's numbers.

An :class:`Action` is one of

- ``F``/``B``: forward/backward of micro-batch ``m`` on model chunk ``c`` (compute actions);
- ``I``/``W`` (split backward, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the
  backward in two, the gradient w.r.t. the chunk's input (what the previous chunk waits for)
  and, later, the gradient w.r.t. its weights (which nobody waits for). Each (chunk,
  micro-batch) has either one ``B`` or one ``I`` followed later by its ``W``;
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

``validator.validate`` checks a schedule before anything runs (no missing or repeated action,
every send received, no deadlock, sharding actions in place).
"""

from __future__ import annotations

import enum
import functools
import re
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera.errors import UserError


class ScheduleError(UserError):
    """A schedule is malformed or cannot run. The message is one line meant for the user."""


class Kind(enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the paper's name: input gradient)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)

    @property
    def is_backward(self) -> bool:
        """B, or one of its halves I and W."""
        return self in (Kind.B, Kind.I, Kind.W)

    @property
    def ends_weight_grad(self) -> bool:
        """Completes a (chunk, micro-batch)'s weight gradient: B or W (not I). A chunk's
        gradient reduction may start after the last of these."""
        return self in (Kind.B, Kind.W)

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


_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
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
                            f"in F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B (e.g. 1F0), or "
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


@functools.lru_cache(maxsize=1 << 16)
def I(chunk: int, mb: int) -> Action:  # noqa: E743 (the paper's name)
    """The input-gradient half of the backward of micro-batch `mb` on chunk `chunk`."""
    return Action(chunk, Kind.I, mb)


@functools.lru_cache(maxsize=1 << 16)
def W(chunk: int, mb: int) -> Action:
    """The weight-gradient half of the backward of micro-batch `mb` on chunk `chunk`."""
    return Action(chunk, Kind.W, mb)


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
        """No backward (B, I or W) anywhere: an evaluation schedule."""
        return not any(a.kind.is_backward for acts in self.actions for a in acts)

    @property
    def split_backward(self) -> bool:
        """Some backward is split into I and W."""
        return any(a.kind is Kind.I for acts in self.actions for a in acts)

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
        """The compute actions alone (no communication, no sharding actions)."""
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


Key = tuple[int, str, int]
"""What a compute action makes ready, as (chunk, what, micro-batch): ``what`` is ``"F"``, the
chunk's output (activation) for the micro-batch; ``"I"``, the gradient w.r.t. the chunk's input
(made by B or by I, whichever the schedule uses for that pair); ``"W"``, its weight gradient
(made by W; B makes it too, but nothing waits for it). Plain tuples, for the simulator's hot
loop."""

_MAKES = {"F": "F", "B": "I", "I": "I", "W": "W"}
"""Kind name -> what it makes ready (by name: an Enum member hashes in Python code)."""


def output_key(a: Action) -> Key:
    """The :data:`Key` compute action `a` makes ready."""
    return (a.chunk, _MAKES[a.kind._name_], a.microbatch)


def input_keys(chunk: int, kind: Kind, mb: int, n_chunks: int) -> list[Key]:
    """What compute action (`chunk`, `kind`, `mb`) waits for, as :data:`Key`s: F(c, m) needs the
    output of chunk c-1; B(c, m) and I(c, m) need F(c, m) and the input gradient of chunk c+1
    (B(c+1, m) or I(c+1, m); the last chunk starts from the loss, computed in its F); W(c, m)
    needs I(c, m)."""
    if kind is Kind.F:
        return [(chunk - 1, "F", mb)] if chunk > 0 else []
    if kind is Kind.W:
        return [(chunk, "I", mb)]
    return [(chunk, "F", mb)] + ([(chunk + 1, "I", mb)] if chunk < n_chunks - 1 else [])


def inputs_of(a: Action, n_chunks: int) -> list[Key]:
    """:func:`input_keys` of compute action `a`."""
    if not a.kind.is_compute:
        raise ValueError(a)
    return input_keys(a.chunk, a.kind, a.microbatch, n_chunks)


def send_for(producer: Action, n_chunks: int) -> Action | None:
    """The send that carries `producer`'s result to the next chunk in its direction, if any
    (B and I send the input gradient; W sends nothing)."""
    if producer.kind is Kind.F and producer.chunk < n_chunks - 1:
        return Action(producer.chunk, Kind.SEND_F, producer.microbatch)
    if producer.kind in (Kind.B, Kind.I) and producer.chunk > 0:
        return Action(producer.chunk, Kind.SEND_B, producer.microbatch)
    return None


def recv_for(consumer: Action, n_chunks: int) -> Action | None:
    """The receive that brings `consumer` its input from the neighbouring chunk, if any (B and
    I receive the output gradient; W receives nothing)."""
    if consumer.kind is Kind.F and consumer.chunk > 0:
        return Action(consumer.chunk, Kind.RECV_F, consumer.microbatch)
    if consumer.kind in (Kind.B, Kind.I) and consumer.chunk < n_chunks - 1:
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

    The ``REDUCE_GRAD`` of a chunk comes right after its last backward (B or W: an I leaves
    the weight gradient to its W), before its ``RESHARD``.

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
            if a.kind.ends_weight_grad:
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


def forward_only(schedule: Schedule) -> Schedule:
    """The same schedule without backward work (B, I, W and their communication): for evaluation.
    Sharding actions are dropped too (``add_sharding_actions`` gives the forward pass its own)."""
    keep = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    return Schedule(f"{schedule.name}-forward", [[a for a in acts if a.kind in keep]
                                                 for acts in schedule.actions],
                    schedule.n_chunks, schedule.n_microbatches, schedule.chunk_rank)
