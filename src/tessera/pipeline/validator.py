"""The schedule validator: a schedule is checked once, before anything runs it.

:func:`validate` checks a schedule of ``schedule.py``'s IR:

1. every forward and backward of every (chunk, micro-batch) appears exactly once, all of a
   chunk's actions on one rank, and each forward before its backward on that rank; a backward
   is either one B or an I and, after it, a W (split backward: I waits for the same F and
   for the next chunk's B or I, W for its own I; every W is in the step's lists, so it runs
   before the optimizer step);
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
   its last B or W (an I leaves the weight gradient unfinished). Sharding actions are local
   to a rank and may repeat: the exactly-once rule of 1 is for compute and send/receive
   actions.

A compute-only schedule is checked together with its lowered form (``lower_comms``), which is
what the runtime runs. The verdict depends on the schedule's content alone, so the schedules
that passed are remembered by content: ``build_schedule``, ``parallelize`` and the runtime
each ask, and the blocking simulations run once per schedule in a process.
"""

from __future__ import annotations

from collections import defaultdict

from tessera.pipeline.schedule import (
    Action,
    B,
    F,
    I,
    Kind,
    Schedule,
    ScheduleError,
    W,
    batches,
    infer_chunk_rank,
    inputs_of,
    lower_comms,
    matching,
    output_key,
    peer_chunk,
    recv_for,
    send_for,
)


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
    for c in range(s.n_chunks):
        for m in range(s.n_microbatches):
            _check_pair(s, seen, c, m)
    for r, acts in enumerate(s.actions):
        position = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind in (Kind.B, Kind.I) and position[F(a.chunk, a.microbatch)] > position[a]:
                raise ScheduleError(f"rank {r}: backward {a} comes before its forward "
                                    f"{F(a.chunk, a.microbatch)}")
            if a.kind is Kind.W and position[I(a.chunk, a.microbatch)] > position[a]:
                raise ScheduleError(f"rank {r}: weight gradient {a} comes before its input "
                                    f"gradient {I(a.chunk, a.microbatch)}")


def _check_pair(s: Schedule, seen: dict[Action, int], c: int, m: int) -> None:
    """(chunk c, micro-batch m) has its F and (unless forward-only) either a B, or an I and a
    W."""
    def missing(a: Action, what: str) -> ScheduleError:
        return ScheduleError(f"action {a} (the {what} of micro-batch {m} on chunk {c}) is "
                             f"missing")

    if F(c, m) not in seen:
        raise missing(F(c, m), "F")
    if s.forward_only:
        return
    has_b, has_i, has_w = B(c, m) in seen, I(c, m) in seen, W(c, m) in seen
    if has_b and (has_i or has_w):
        raise ScheduleError(f"micro-batch {m} on chunk {c} has {B(c, m)} and "
                            f"{I(c, m) if has_i else W(c, m)}: a backward is either B, or I "
                            f"then W")
    if has_i and not has_w:
        raise missing(W(c, m), "weight gradient (W) after I")
    if has_w and not has_i:
        raise missing(I(c, m), "input gradient (I) before W")
    if not (has_b or has_i):
        raise missing(B(c, m), "B")


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
    done: set = set()  # Actions (communication) and output_keys (compute)
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
                    local = [d for d in inputs_of(a, n) if owner[d[0]] == r]
                    remote_ok = (lowered or
                                 all(d in done for d in inputs_of(a, n) if owner[d[0]] != r))
                    if not (all(d in done for d in local) and remote_ok):
                        break
                    done.add(output_key(a))
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
                if a.kind.ends_weight_grad:
                    if reduced.get(c):
                        raise ScheduleError(f"rank {r}: {c}REDUCE_GRAD comes before {a}; it "
                                            f"must follow the chunk's last backward (B or W)")
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


_PASSED: dict[tuple[str, tuple[int, ...]], None] = {}
"""Content keys (string form, chunk placement) of the schedules that passed, oldest first."""
_PASSED_LIMIT = 512  # 256 compute-only schedules and their lowered forms


def _content(s: Schedule) -> tuple[str, tuple[int, ...]]:
    return s.to_string(), s.chunk_rank


def _check(s: Schedule) -> None:
    _check_structure(s)
    if s.is_sharded:
        _check_sharding(s)
    if s.is_lowered:
        _check_comms(s)
    _simulate_blocking(s)


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` (see module doc); return it unchanged, or raise ScheduleError. A
    compute-only schedule's lowered form is checked too, so validating that afterwards (the
    runtime does) finds it passed."""
    key = _content(schedule)
    if key in _PASSED:
        return schedule
    _check(schedule)
    passed = [key]
    if not schedule.is_lowered:
        lowered = lower_comms(schedule)
        _check(lowered)
        passed.append(_content(lowered))
    for k in passed:
        _PASSED[k] = None
    while len(_PASSED) > _PASSED_LIMIT:
        del _PASSED[next(iter(_PASSED))]
    return schedule
