"""Data parallelism: replicate the model, split the batch, all-reduce gradients in buckets.

Paper: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(VLDB 2020): gradients are grouped into buckets, and each bucket's all-reduce starts as soon as
backward has produced all of its gradients, so communication overlaps the rest of backward.

Collectives, over the dp group: forward none; backward one all-reduce (sum) per bucket, started
from a per-parameter post-accumulate-grad hook; ``finish_gradient_sync()`` waits for them and
divides by the group size.

Buckets are filled in reverse parameter order, the order in which backward produces gradients
(the LM head first, the embedding last). Each bucket is one flat buffer; after a parameter's
first gradient of a step arrives it is copied into its slot and ``p.grad`` becomes a view of the
slot, so later accumulation (``no_sync``) and the all-reduce work in place with no further copy.
A bucket's buffer ends with one "used" flag per parameter: the all-reduce sums them too, which
tells every rank, at no extra collective, which parameters no rank used.

Invariants:
- After ``finish_gradient_sync()`` every replica holds, for each parameter, the mean of the
  replicas' gradients, i.e. the gradient of the mean loss over the global batch, so identical
  optimizer steps keep replicas bit-identical.
- Buckets start in index order on every rank (bucket i only after buckets < i), so the
  collectives match across ranks even when gradients arrive in a different order or some
  parameters get none.
- A parameter used on no rank keeps ``grad=None`` (as in one process on the whole batch); one
  used on some ranks gets the average with zeros from the others.
- Within one synchronized window (from the last sync to ``finish_gradient_sync()``) a bucket's
  gradients may only change before it is launched: a second backward outside ``no_sync()``
  raises instead of racing the in-flight all-reduce.

All-reduce algorithm: ``"backend"`` uses ``torch.distributed.all_reduce(async_op=True)``, whose
work runs on the backend's own threads. Ours (``tessera.collectives.all_reduce`` with
``algorithm=...``) are blocking point-to-point programs, so each launched bucket is handed to one
background thread that runs them in launch order; backward keeps computing meanwhile.

On a GPU that thread must not read a bucket before the kernels that wrote it have run: work
is queued on CUDA streams, and the thread's current stream is not the one backward used. So
the hook records a CUDA event on the stream that produced the bucket's gradients, the thread
makes its own stream wait for it before sending (and does so on the bucket's device), and
``finish_gradient_sync`` makes the caller's stream wait for an event the thread recorded after
the all-reduce. On the CPU there are no streams: :func:`stream_event` is None and nothing waits.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ALLREDUCE_ALGORITHMS
from tessera.errors import ConfigError
from tessera.optim import add_sums_of_squares
from tessera.parallel.comm_timing import CommLog

MIB = 2**20


@dataclass(eq=False)
class Bucket:
    """Consecutive (in backward order) parameters whose gradients are reduced together."""

    index: int
    params: list[nn.Parameter]
    flat: torch.Tensor
    """(numel + len(params),): the gradients, then one used-flag per parameter."""
    views: list[torch.Tensor] = field(default_factory=list)
    """views[j]: params[j]'s slot of `flat`, shaped like params[j]."""
    numel: int = 0
    pending: int = 0
    """Parameters whose gradient has not arrived yet in this synchronized backward."""
    work: Any = None
    """The in-flight all-reduce: a torch Work or a Future; None when not launched."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()


def build_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Group parameters in reverse order into buckets of at most `bucket_bytes` (a parameter
    larger than that gets a bucket of its own). A bucket holds one dtype and device."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        current = groups[-1] if groups else None
        if (current is None or size + nbytes > bucket_bytes
                or (current[0].dtype, current[0].device) != (p.dtype, p.device)):
            groups.append([p])
            size = nbytes
        else:
            current.append(p)
            size += nbytes
    buckets = []
    for i, group in enumerate(groups):
        numel = sum(p.numel() for p in group)
        flat = torch.zeros(numel + len(group), dtype=group[0].dtype, device=group[0].device)
        bucket = Bucket(index=i, params=group, flat=flat, numel=numel)
        offset = 0
        for p in group:
            bucket.views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        buckets.append(bucket)
    return buckets


class SerialWorker:
    """One daemon thread that runs submitted calls in submission order.

    Our point-to-point all-reduce algorithms block their caller; running them here lets backward
    go on while a bucket is reduced, and keeps buckets in the same order on every rank.
    """

    def __init__(self, name: str = "tessera-ddp-comm"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _loop(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(e)


def stream_event(t: torch.Tensor) -> torch.cuda.Event | None:
    """On CUDA, an event recorded on this thread's current stream on `t`'s device (what another
    thread must wait for before it reads what that stream wrote); None on other devices."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


def wait_for(event: torch.cuda.Event | None, t: torch.Tensor) -> None:
    """Make this thread's current stream on `t`'s device wait for `event` (no-op for None)."""
    if event is not None:
        torch.cuda.current_stream(t.device).wait_event(event)


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """`t`'s CUDA device as this thread's current device (a side thread starts on cuda:0)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


class DataParallel(nn.Module):
    """Wrap `module` so its gradients are averaged over `group` in overlapped buckets.

    bucket_mb: bucket capacity in MiB (torch DDP's default is 25).
    algorithm: "backend" (torch.distributed) or one of tessera.collectives' all-reduce
    algorithms ("auto", "naive", "parallel", "ring", "rabenseifner").
    params: reduce (and broadcast at start) only these of the module's parameters (default:
    all); `buffers`: whether the module's buffers are broadcast at start too. Expert
    parallelism wraps a chunk's dense and expert parameters separately, over different groups.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None,
                 bucket_mb: float = 25.0, algorithm: str = "backend",
                 params: list[nn.Parameter] | None = None, buffers: bool = True):
        super().__init__()
        if not bucket_mb > 0:
            raise ConfigError("parallel.bucket_mb", bucket_mb, "must be > 0")
        if algorithm not in ALLREDUCE_ALGORITHMS:
            raise ConfigError("parallel.allreduce_algorithm", algorithm,
                              f"must be one of {', '.join(ALLREDUCE_ALGORITHMS)}")
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.algorithm = algorithm
        self.bucket_mb = bucket_mb
        self.comm_stats: Any = None
        """This rank's bytes and rounds (a tessera.collectives.CommStats) with our algorithms."""
        if algorithm != "backend":
            from tessera.collectives import CommStats

            self.comm_stats = CommStats()
        self.comm_log = CommLog()
        """Bucket launches, the end of backward and the waits on the all-reduces, timestamped
        (tessera.parallel.comm_timing): the measured exposed communication of the step."""
        self.hook_seconds = 0.0
        """Wall seconds this rank has spent in the gradient hooks (each gradient's copy into
        its bucket slot, the bookkeeping, the launches), summed until the caller sets it back
        to 0. It misses what autograd's dispatch of each hook and the copy's effect on the
        backward around it cost, so ``plan calibrate`` prices the hooks from the backward's
        whole CPU time instead; the local-truth bench reports it beside that."""
        self.pre_reduce_sq: torch.Tensor | None = None
        """With ``measure_pre_reduction``: Σ g² (fp64) of the counted parameters' gradients as
        each bucket's all-reduce reads them (the local gradient; the gradient noise scale)."""
        self._pre_reduce_counted: set[nn.Parameter] = set()
        self._sync = True
        self._params = [p for p in (module.parameters() if params is None else params)
                        if p.requires_grad]
        self._broadcast = (list(module.parameters()) if params is None else list(params)) \
            + (list(module.buffers()) if buffers else [])
        self.buckets = build_buckets(self._params, int(bucket_mb * MIB))
        self._slot: dict[nn.Parameter, tuple[Bucket, int]] = {
            p: (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        self._used = {p: False for p in self._params}
        self._ready = {p: False for p in self._params}
        self._next_launch = 0
        self._worker: SerialWorker | None = None
        self._broadcast_parameters()
        self._reset_window()
        if self.world > 1:
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Start from one set of weights: the dp group's first rank's."""
        if self.world == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        for t in self._broadcast:
            dist.broadcast(t, src=src, group=self.group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def measure_pre_reduction(self, counted: set[nn.Parameter] | None = None) -> None:
        """From now on add Σ g² of `counted` parameters (default: all) to ``pre_reduce_sq``
        just before each bucket's all-reduce (the caller zeroes it)."""
        self._pre_reduce_counted = set(self._params) if counted is None else set(counted)
        self.pre_reduce_sq = torch.zeros((), dtype=torch.float64, device=self._params[0].device)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synchronized backward reduces them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- backward side ----------------------------------------------------------------------
    def _reset_window(self) -> None:
        for p in self._params:
            self._used[p] = self._ready[p] = False
        for b in self.buckets:
            b.pending, b.work = len(b.params), None
        self._next_launch = 0

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move the gradient into its bucket slot; maybe launch."""
        start = time.perf_counter()
        try:
            self._move_to_slot(p)
        finally:
            self.hook_seconds += time.perf_counter() - start

    def _move_to_slot(self, p: nn.Parameter) -> None:
        bucket, j = self._slot[p]
        if bucket.work is not None:  # its buffer is being reduced: changing it would race
            raise RuntimeError(
                f"DataParallel: a parameter of bucket {bucket.index} received a gradient after the "
                "bucket's all-reduce started; wrap every backward but the step's last in "
                "no_sync()")
        view = bucket.views[j]
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self._used[p] = True
        if not self._sync:
            return
        if not self._ready[p]:
            self._ready[p] = True
            bucket.pending -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        used = [self._used[p] for p in bucket.params]
        bucket.flat[bucket.numel:].copy_(torch.tensor(used, dtype=bucket.flat.dtype,
                                                      device=bucket.flat.device))
        for view, was_used in zip(bucket.views, used, strict=True):
            if not was_used:
                view.zero_()  # a stale slot must not leak into the sum
        if self.pre_reduce_sq is not None:
            add_sums_of_squares(self.pre_reduce_sq, [
                v for v, p in zip(bucket.views, bucket.params, strict=True)
                if p in self._pre_reduce_counted])
        self.comm_log.mark("launch", f"bucket{bucket.index}")
        if self.algorithm == "backend":
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        else:
            if self._worker is None:
                self._worker = SerialWorker()
            bucket.work = self._worker.submit(self._our_all_reduce, bucket.flat,
                                              stream_event(bucket.flat))

    def _our_all_reduce(self, flat: torch.Tensor, written: torch.cuda.Event | None
                        ) -> torch.cuda.Event | None:
        """On the side thread: wait for the stream that wrote `flat`, all-reduce it, and return
        the event the caller's stream waits for before it reads the result."""
        from tessera import collectives

        with on_device_of(flat):
            wait_for(written, flat)
            collectives.all_reduce(flat, group=self.group, op="sum", algorithm=self.algorithm,
                                   stats=self.comm_stats)
            return stream_event(flat)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Average every gradient over the dp group (call after the step's last backward)."""
        if self.world == 1 or not self._sync:
            return
        self.comm_log.mark("backward_end")
        for bucket in self.buckets[self._next_launch:]:
            bucket.pending = 0  # unused parameters: their slots go in as zeros
        self._launch_ready_buckets()
        for bucket in self.buckets:
            with self.comm_log.wait(f"bucket{bucket.index}"):
                if isinstance(bucket.work, Future):
                    wait_for(bucket.work.result(), bucket.flat)
                else:
                    bucket.work.wait()
            bucket.flat[:bucket.numel].div_(self.world)
            flags = bucket.flat[bucket.numel:].tolist()
            for j, p in enumerate(bucket.params):
                if flags[j] > 0:
                    if p.grad is None or p.grad.data_ptr() != bucket.views[j].data_ptr():
                        p.grad = bucket.views[j]
                else:
                    p.grad = None
        self._reset_window()
