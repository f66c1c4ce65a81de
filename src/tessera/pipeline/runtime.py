"""Execute any valid schedule for real: this rank's actions, in order, over torch.distributed.

The runtime walks the lowered schedule (``schedule.lower_comms``) of its pipeline rank:

- a run of send/receive actions is posted as one ``batch_isend_irecv``, together with the
  receives of the next run (posted ahead, so their transfers overlap the compute in between);
  the run's receives are waited for at once (the next compute needs them), the sends only at
  the end of the step, so a rank never blocks on a send: exactly the semantics
  ``validator.validate`` proves deadlock-free (posting a receive early never blocks);
- ``F(c, m)``: the chunk's input is the micro-batch's tokens (chunk 0), the received
  activation, or the output of chunk c-1 when it lives on this rank; the input is detached and
  marked as requiring grad, so each chunk's backward is its own autograd graph. The last chunk
  computes the loss, scaled by the caller (1/m for training, so the m micro-batches' gradients
  accumulate to the gradient of the full batch's mean loss);
- ``B(c, m)``: backward from the loss (last chunk) or from the received / local gradient of the
  chunk's output; the gradient of its input is what ``SEND_B`` carries (or chunk c-1 on this
  rank consumes). Activations are freed as soon as their backward is done;
- ``I(c, m)`` / ``W(c, m)``: the backward in two parts (``split_backward``): I computes only
  the gradient of the chunk's input (what ``SEND_B`` carries) and keeps what the weight
  gradients need; W accumulates the weight gradients later, and the chunk's gradient hooks
  (data parallelism, ZeRO) fire there. The forward of a (chunk, micro-batch) whose backward is
  split packs its saved tensors so that I can drop those W does not read;
- sharding actions (ZeRO-3, ``schedule.add_sharding_actions``) call the chunk's wrapper:
  ``UNSHARD`` → ``unshard()`` (starts the all-gather), and the chunk's next compute action first
  calls ``wait_unsharded()``; ``RESHARD`` → ``reshard()``; ``REDUCE_GRAD`` → ``reduce_grad()``
  (starts the reduce-scatter), then ``wait_reduced()`` of the chunk reduced before it (started
  a whole run of backwards earlier, so normally done; this frees its full gradient, so at most
  two chunks' full gradients exist at once); the last ones are waited for at the step's end;
- scatter/gather (``scatter_gather.StageBoundary``): a send carries the boundary's slice of the
  tensor, a receive is a slice that is all-gathered over tp right after its wait, before the
  compute that uses it (the identity where the boundary has one part).

Collectives: point-to-point, activations (B, T, h) forward and their gradients backward,
between the ranks of the pp group (with scatter/gather, 1/t of each per tp rank, then an
all-gather over tp); every message has a tag naming (chunk, micro-batch, direction), and sends
and receives between two ranks also come in the same order.

Measurement: every compute action and every wait is time-stamped (``time.perf_counter``, one
clock for all processes of a machine), giving a measured timeline and bubble fraction with the
simulator's definitions; an 'unshard' ('reduce') event runs from the UNSHARD (REDUCE_GRAD) to
the end of the wait for it: an upper bound on when the collective finished; with
``measure_memory`` the bytes of tensors autograd saves for backward are counted per (chunk,
micro-batch) (distinct storages; parameters, buffers and input tokens excluded), and the peak
held over the step is reported (between I and W, what W still holds). Every step also counts
the (chunk, micro-batch) pairs in flight: forwarded and not yet through their B or W.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.pipeline.scatter_gather import StageBoundary
from tessera.pipeline.schedule import Action, Kind, Schedule, batches, lower_comms
from tessera.pipeline.simulator import TimelineEvent
from tessera.pipeline.split_backward import SavedActivations, backward_input, backward_weight
from tessera.pipeline.validator import validate

MicroBatch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
COMPUTE_EVENTS = ("F", "B", "I", "W")


@dataclass
class StepRecord:
    """What one rank measured in one run of a schedule."""

    loss: torch.Tensor
    """Sum of the scaled losses of the micro-batches (non-zero on the last chunk's rank only)."""
    events: list[TimelineEvent] = field(default_factory=list)
    """Compute actions ('F', 'B', 'I', 'W'), receive waits ('wait', with scatter/gather's
    all-gather) and ZeRO-3 collectives
    ('unshard', 'reduce') with perf_counter times."""
    peak_activation_bytes: int = 0
    """Most bytes saved for backward held at once (with measure_memory); after a split
    backward's I, what W still holds of them and what splitting nodes made in I for W."""
    peak_in_flight: int = 0
    """Most (chunk, micro-batch) pairs held at once: forwarded, their B or W not yet run."""
    sent_bytes: list[int] = field(default_factory=list)
    """Bytes of each point-to-point send this rank posted, in order."""
    start: float = 0.0
    end: float = 0.0

    @property
    def busy(self) -> float:
        return sum(e.end - e.start for e in self.events if e.kind in COMPUTE_EVENTS)


def measured_bubble(records: Sequence[StepRecord]) -> float:
    """(makespan - largest per-rank busy time) / that busy time, over one step of all ranks."""
    start = min(r.start for r in records)
    end = max(r.end for r in records)
    busy = max(r.busy for r in records)
    return (end - start - busy) / busy if busy > 0 else 0.0


def _tag(a: Action, n_microbatches: int) -> int:
    """One tag per message, the same on both ends: (sending chunk, micro-batch, direction)."""
    sender = a.chunk if a.kind.is_send else (a.chunk - 1 if a.kind is Kind.RECV_F else
                                             a.chunk + 1)
    backward = a.kind in (Kind.SEND_B, Kind.RECV_B)
    return (sender * n_microbatches + a.microbatch) * 2 + int(backward)


class _SavedBytes:
    """Counts the bytes of distinct storages autograd saves, except `exclude`'s (parameters,
    buffers and the input tokens: state and data the step holds anyway).

    Whether a storage is excluded is decided when a tensor is saved, not when the counter is
    made: ZeRO-3 gathers a unit's parameters into newly allocated storage inside the chunk's
    forward, so their addresses are known only then."""

    def __init__(self, exclude: Sequence[torch.Tensor]):
        self.exclude = list(exclude)
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.storages and all(e.untyped_storage().data_ptr() != ptr
                                            for e in self.exclude):
            self.storages[ptr] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def bytes_of(self, tensors: Sequence[torch.Tensor]) -> int:
        """Bytes of the distinct storages among `tensors` that this counter counted."""
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        return sum(n for ptr, n in self.storages.items() if ptr in ptrs)


def _distinct_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages among `tensors`."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


class PipelineRuntime:
    """Runs schedules on one pipeline rank holding `stages` (chunk index -> module)."""

    def __init__(self, stages: dict[int, nn.Module], pp_rank: int, pp_ranks: Sequence[int],
                 group: dist.ProcessGroup | None, device: torch.device, d_model: int,
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 measure_memory: bool = False, activation_dtype: torch.dtype = torch.float32,
                 seq_divisor: int = 1, boundary: StageBoundary | None = None):
        """`stages`: chunk index -> the module to call (a chunk, or its data-parallel wrapper).
        `activation_dtype`: what activations and their gradients travel in between ranks.
        `seq_divisor`: activations hold T/seq_divisor tokens per sequence (sequence
        parallelism splits the residual stream over the tp group). `boundary`: how they
        travel (scatter/gather over tp, or whole)."""
        self.stages, self.pp_rank, self.pp_ranks = stages, pp_rank, list(pp_ranks)
        self.group, self.device, self.d_model = group, device, d_model
        self.autocast = autocast or contextlib.nullcontext
        self.measure_memory = measure_memory
        self.activation_dtype, self.seq_divisor = activation_dtype, seq_divisor
        self.boundary = boundary or StageBoundary()
        self._lowered: dict[tuple, Schedule] = {}
        # gloo returns one request per operation, so receives can be posted ahead and waited
        # for later; a coalescing backend (NCCL) returns one request for the whole batch.
        self.post_ahead = dist.is_initialized() and dist.get_backend(group) == "gloo"

    def lowered(self, schedule: Schedule) -> Schedule:
        """The validated lowered form, cached by content (the same schedule every step)."""
        key = (schedule.to_string(), schedule.chunk_rank)
        if key not in self._lowered:
            if len(self._lowered) >= 16:
                self._lowered.clear()
            self._lowered[key] = validate(lower_comms(schedule))
        return self._lowered[key]

    def run(self, schedule: Schedule, micro_batches: Sequence[MicroBatch], loss_fn: LossFn,
            *, scale: float = 1.0,
            around: Callable[[Action], contextlib.AbstractContextManager] | None = None
            ) -> StepRecord:
        """Execute this rank's part of `schedule`; forward-only if it has no backward actions.
        `around(action)` gives a context each compute action runs in (the executor's hook for
        when data parallelism reduces: e.g. outside ``no_sync`` only for a chunk's last
        backward)."""
        around = around or (lambda a: contextlib.nullcontext())
        s = self.lowered(schedule)
        if len(micro_batches) != s.n_microbatches:
            raise ValueError(f"schedule {s.name!r} is for {s.n_microbatches} micro-batches, got "
                             f"{len(micro_batches)}")
        owner, n_chunks, me = s.chunk_rank, s.n_chunks, self.pp_rank
        last = n_chunks - 1
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        received: dict[Action, torch.Tensor] = {}
        grads_in: dict[tuple[int, int], torch.Tensor] = {}  # grad w.r.t. chunk input
        saved: dict[tuple[int, int], int] = {}
        held = peak = 0
        split = {(a.chunk, a.microbatch) for a in s.actions[me] if a.kind is Kind.I}
        packed: dict[tuple[int, int], SavedActivations] = {}  # forwards of split backwards
        pending: dict[tuple[int, int], object] = {}  # between I and W: what W needs
        in_flight = peak_in_flight = 0
        counters: dict[tuple[int, int], _SavedBytes] = {}
        send_works: list = []
        sent_bytes: list[int] = []
        loss_sum = torch.zeros((), device=self.device)
        events: list[TimelineEvent] = []
        training = torch.is_grad_enabled() and not s.forward_only
        start = time.perf_counter()

        def activation_shape(mb: int) -> tuple[int, ...]:
            tokens = micro_batches[mb][0]
            return (tokens.shape[0], tokens.shape[1] // self.seq_divisor, self.d_model)  # (B, T, h)

        steps = batches(s.actions[me])
        comm_steps = [i for i, step in enumerate(steps) if step[0].kind.is_p2p]
        next_comm = dict(zip(comm_steps, comm_steps[1:], strict=False))
        posted: dict[Action, object] = {}  # receives posted ahead: action -> request
        gathering: dict[int, float] = {}  # chunk -> when its UNSHARD started (not waited yet)
        reducing: dict[int, float] = {}  # chunk -> when its REDUCE_GRAD started (not waited yet)

        def sharding_action(a: Action) -> None:
            stage, t0 = self.stages[a.chunk], time.perf_counter()
            if a.kind is Kind.UNSHARD:
                stage.unshard()
                gathering[a.chunk] = t0
                return
            if a.kind is Kind.RESHARD:
                if a.chunk in gathering:  # gathered and never used: close its event
                    events.append(TimelineEvent(me, "unshard", -1, a.chunk,
                                                gathering.pop(a.chunk), t0))
                stage.reshard()
                return
            stage.reduce_grad()
            earlier = list(reducing)
            reducing[a.chunk] = t0
            for c in earlier:
                wait_reduced(c)

        def wait_reduced(c: int) -> None:
            self.stages[c].wait_reduced()
            events.append(TimelineEvent(me, "reduce", -1, c, reducing.pop(c), time.perf_counter()))

        def wait_gathered(c: int) -> None:
            if c in gathering:
                self.stages[c].wait_unsharded()
                events.append(TimelineEvent(me, "unshard", -1, c, gathering.pop(c),
                                            time.perf_counter()))

        def op_for(c: Action) -> dist.P2POp:
            peer = self.pp_ranks[owner[c.chunk + 1 if c.kind in (Kind.SEND_F, Kind.RECV_B)
                                       else c.chunk - 1]]
            if c.kind is Kind.SEND_F:  # activations travel in activation_dtype
                key = (c.chunk, c.microbatch)
                tensor = (outputs[key] if training else outputs.pop(key)).detach()
                tensor = self.boundary.scatter(tensor.to(self.activation_dtype).contiguous())
            elif c.kind is Kind.SEND_B:
                tensor = self.boundary.scatter(
                    grads_in.pop((c.chunk, c.microbatch)).to(self.activation_dtype))
            else:
                tensor = torch.empty(self.boundary.wire_shape(activation_shape(c.microbatch)),
                                     device=self.device, dtype=self.activation_dtype)
                received[c] = tensor
            if c.kind.is_send:
                sent_bytes.append(tensor.numel() * tensor.element_size())
            op = dist.isend if c.kind.is_send else dist.irecv
            return dist.P2POp(op, tensor, peer, self.group, _tag(c, s.n_microbatches))

        for index, step in enumerate(steps):
            a = step[0]
            if a.kind.is_sharding:
                sharding_action(a)
                continue
            if not a.kind.is_compute:
                # This batch's sends and not-yet-posted receives, plus the next batch's
                # receives, posted ahead so their transfers overlap the compute in between.
                # Posting a receive early never blocks, and the waits stay where the validated
                # schedule has them.
                ahead = [c for c in steps[next_comm[index]] if not c.kind.is_send] \
                    if index in next_comm and self.post_ahead else []
                todo = [c for c in step if c not in posted] + ahead
                ops = [op_for(c) for c in todo]
                t0 = time.perf_counter()
                works = dist.batch_isend_irecv(ops) if ops else []
                if len(works) == len(ops):  # one request per op (gloo)
                    for c, w in zip(todo, works, strict=True):
                        if c.kind.is_send:
                            send_works.append(w)
                        else:
                            posted[c] = w
                else:  # coalesced backends return one request for the batch: wait for it now
                    for w in works:
                        w.wait()
                    posted.update(dict.fromkeys((c for c in todo if not c.kind.is_send), None))
                waited = False
                for c in step:
                    if not c.kind.is_send:
                        work = posted.pop(c)
                        if work is not None:
                            work.wait()
                        received[c] = self.boundary.gather(
                            received[c], activation_shape(c.microbatch),
                            "backward" if c.kind is Kind.RECV_B else "forward")
                        waited = True
                if waited:
                    events.append(TimelineEvent(me, "wait", -1, a.chunk, t0, time.perf_counter()))
                continue

            c, mb = a.chunk, a.microbatch
            stage = self.stages[c]
            wait_gathered(c)
            t0 = time.perf_counter()
            if a.kind is Kind.F:
                if c == 0:
                    x = micro_batches[mb][0].to(self.device)
                elif owner[c - 1] != me:
                    x = received.pop(Action(c, Kind.RECV_F, mb))
                else:
                    prev = outputs[(c - 1, mb)] if training else outputs.pop((c - 1, mb))
                    x = prev.detach().to(self.activation_dtype)
                if training and c > 0:
                    x.requires_grad_()
                counter = None
                if self.measure_memory:
                    tokens = [x] if c == 0 else []
                    counter = _SavedBytes([*stage.parameters(), *stage.buffers(), *tokens])
                if training and (c, mb) in split:
                    hooks = packed[(c, mb)] = SavedActivations(counter and counter.pack)
                elif counter:
                    hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
                else:
                    hooks = contextlib.nullcontext()
                with hooks, self.autocast(), around(a):
                    out = stage(x)
                    if c == last:
                        out = loss_fn(out, micro_batches[mb][1].to(self.device)) * scale
                if c == last:
                    loss_sum += out.detach()
                if training:
                    inputs[(c, mb)], outputs[(c, mb)] = x, out
                    in_flight += 1
                    peak_in_flight = max(peak_in_flight, in_flight)
                elif c != last:
                    outputs[(c, mb)] = out
                if counter is not None:
                    counters[(c, mb)] = counter
                    saved[(c, mb)] = counter.total
                    held += counter.total
                    peak = max(peak, held)
            elif a.kind is Kind.W:
                with around(a):
                    backward_weight(pending.pop((c, mb)))
                held -= saved.pop((c, mb), 0)
                in_flight -= 1
            else:
                out = outputs.pop((c, mb))
                grad = None
                if c != last:
                    grad = received.pop(Action(c, Kind.RECV_B, mb)) \
                        if owner[c + 1] != me else grads_in.pop((c + 1, mb))
                    grad = grad.to(out.dtype)
                x = inputs.pop((c, mb))
                with around(a):
                    if a.kind is Kind.B:
                        torch.autograd.backward(out, grad)
                        dx = x.grad
                    else:  # I
                        dx, pending[(c, mb)] = backward_input(
                            out, grad, x if c > 0 else None, packed.pop((c, mb)))
                        del out, grad
                if c > 0:
                    grads_in[(c, mb)] = dx
                held -= saved.pop((c, mb), 0)
                counter = counters.pop((c, mb), None)
                if a.kind is Kind.I and counter is not None:  # what W still holds
                    kept = pending[(c, mb)]
                    saved[(c, mb)] = counter.bytes_of(kept.kept) + _distinct_bytes(kept.made)
                    held += saved[(c, mb)]
                if a.kind is Kind.B:
                    in_flight -= 1
            events.append(TimelineEvent(me, a.kind.value, mb, c, t0, time.perf_counter()))

        for w in send_works:
            w.wait()
        for c in list(reducing):
            wait_reduced(c)
        return StepRecord(loss=loss_sum, events=events, peak_activation_bytes=peak,
                          peak_in_flight=peak_in_flight, start=start,
                          end=time.perf_counter(), sent_bytes=sent_bytes)
