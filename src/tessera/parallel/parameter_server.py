"""Parameter-server data parallelism: one rank holds the parameters and the optimizer.

Papers: Li et al., "Scaling Distributed Machine Learning with the Parameter Server" (OSDI 2014)
for the push/pull design; Ho et al., "More Effective Distributed ML via a Stale Synchronous
Parallel Parameter Server" (NIPS 2013) for bounded staleness; Zhang et al., "Staleness-aware
Async-SGD for Distributed Deep Learning" (IJCAI 2016) for dividing the learning rate by the
staleness.

Roles. The dp group's first rank is the server. It also computes a gradient on its own share of
the global batch, like every worker, so the batch is split N ways exactly as for all-reduce data
parallelism (the data loader is unchanged) and the synchronous mode equals one process on the
whole batch. Only the server holds optimizer state; the workers' optimizer steps change nothing
because their parameters arrive from the server. Every rank builds the same initial model from
the seed, so no initial broadcast is needed.

Messages (point-to-point, float32, on a process group made for the parameter server alone so
they never interleave with the dp group's collectives; S parameter elements, P parameters):

    push, worker -> server: [gradients (S) | used flags (P) | loss | version]
    pull, server -> worker: [parameters (S) | loss | grad norm | version]

Synchronous mode (``dp_mode='ps'``), one step: every worker pushes and blocks on its pull; the
server receives the N-1 pushes, averages them with its own gradient in rank order (a parameter
no rank used keeps ``grad=None``), the trainer clips and steps the server's AdamW, and the
server sends the new parameters, the mean loss and the gradient norm to every worker. Traffic
at the server per step: (N-1)·(S+P+2) elements in, (N-1)·(S+3) out, O(N·S); a rank of a ring
all-reduce moves 2·(N-1)/N·S each way, under 2S whatever N.

Asynchronous mode (``dp_mode='ps-async'``) with bounded staleness s = ``max_staleness``. The
server's version counts the updates it has applied. Each trainer step the server computes its
own gradient and applies it (staleness 0), then serves one push from each worker, in rank
order. A push computed on version v has staleness tau = version - v, the number of updates
applied since that worker's pull. Update rule:

    tau <= s: clip the gradient to train.grad_clip and apply it with learning rate lr / (1 + tau)
    tau >  s: drop it

and in both cases reply with the current parameters and version. Workers never wait for the
server's optimizer to see the others' gradients, only for the answer to their own push, which
comes in its turn: the k-th push of every worker is served in the server's k-th step, after
the pushes of the ranks before it. With N ranks of equal speed the staleness is N-1 (rank w's
push is answered after ranks w+1..N-1 of the last step, the server's own update and ranks
1..w-1 of this one), so s >= N-1 uses every gradient and a smaller s keeps only the fresher
ones; the bound's real job is to discard stragglers' gradients. Versions are sent as float32,
exact up to 2**24 updates. Receives name their source (group rank): NCCL has no
receive-from-any-source, so a server that took pushes in arrival order could not run there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ParallelConfig, TrainConfig
from tessera.optim import adamw, add_sums_of_squares, scale_all_
from tessera.topology import Topology

SERVER = 0
"""Group rank of the server."""


@dataclass
class Traffic:
    """Payload bytes this rank sent and received through the parameter server."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0

    @property
    def total(self) -> int:
        return self.bytes_sent + self.bytes_received


@dataclass
class StalenessLog:
    """What the asynchronous server did with each worker gradient."""

    applied: list[int] = field(default_factory=list)
    """The staleness of every applied worker gradient, in order."""
    dropped: int = 0
    """Worker gradients discarded for exceeding max_staleness."""


class ParameterServer:
    """The push/pull protocol over `group` for the parameters `params` (same on every rank)."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, *,
                 asynchronous: bool = False, max_staleness: int = 2):
        self.params = list(params)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.is_server = self.rank == SERVER
        self.asynchronous = asynchronous
        self.max_staleness = max_staleness
        self.version = 0
        self.traffic = Traffic()
        self.staleness = StalenessLog()
        self.numel = sum(p.numel() for p in self.params)
        S, P = self.numel, len(self.params)
        device = self.params[0].device
        self.push_buf = torch.zeros(S + P + 2, device=device)  # grads | used | loss | version
        self.pull_buf = torch.zeros(S + 3, device=device)  # params | loss | grad norm | version
        self._offsets = [0]
        for p in self.params:
            self._offsets.append(self._offsets[-1] + p.numel())
        if self.is_server:
            self.grad_flat = torch.zeros(S, dtype=self.params[0].dtype, device=device)
            self.grad_views = [self._slice(self.grad_flat, j) for j in range(P)]
            if not asynchronous:
                self.inboxes = torch.zeros(self.world - 1, S + P + 2, device=device)
        self.served_losses: list[float] = []

    def _slice(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        return flat[self._offsets[j]:self._offsets[j + 1]].view_as(self.params[j])

    # -- message packing --------------------------------------------------------------------
    @torch.no_grad()
    def _pack_push(self, loss: float) -> torch.Tensor:
        S, buf = self.numel, self.push_buf
        for j, p in enumerate(self.params):
            view = buf[self._offsets[j]:self._offsets[j + 1]]
            if p.grad is None:
                view.zero_()
                buf[S + j] = 0.0
            else:
                view.copy_(p.grad.reshape(-1))
                buf[S + j] = 1.0
        buf[-2], buf[-1] = loss, self.version
        return buf

    @torch.no_grad()
    def _unpack_gradients(self, grads: torch.Tensor, used: torch.Tensor) -> None:
        """Make every used parameter's grad a view of the server's gradient buffer."""
        self.grad_flat.copy_(grads)
        for j, (p, flag) in enumerate(zip(self.params, used.tolist(), strict=True)):
            p.grad = self.grad_views[j] if flag > 0 else None

    @torch.no_grad()
    def _pack_pull(self, loss: float, grad_norm: float) -> torch.Tensor:
        buf = self.pull_buf
        torch.cat([p.detach().reshape(-1).float() for p in self.params], out=buf[:self.numel])
        buf[-3], buf[-2], buf[-1] = loss, grad_norm, self.version
        return buf

    @torch.no_grad()
    def _unpack_pull(self) -> tuple[float, float]:
        buf = self.pull_buf
        for j, p in enumerate(self.params):
            p.copy_(self._slice(buf, j))
        loss, norm, version = buf[-3:].tolist()
        self.version = int(version)
        return loss, norm

    def _send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t, group=self.group, group_dst=dst)
        self.traffic.bytes_sent += t.numel() * t.element_size()
        self.traffic.messages += 1

    def _count_received(self, t: torch.Tensor) -> None:
        self.traffic.bytes_received += t.numel() * t.element_size()
        self.traffic.messages += 1

    # -- worker side ------------------------------------------------------------------------
    def push(self, loss: float) -> None:
        """Worker: send this rank's gradients (computed on self.version) and loss."""
        self._send(self._pack_push(loss), SERVER)

    def pull(self) -> tuple[float, float]:
        """Worker: receive the server's parameters; returns (loss, grad norm) it sent along."""
        dist.recv(self.pull_buf, group=self.group, group_src=SERVER)
        self._count_received(self.pull_buf)
        return self._unpack_pull()

    # -- server side, synchronous -----------------------------------------------------------
    @torch.no_grad()
    def gather_gradients(self, own_loss: float) -> float:
        """Server: average every rank's gradient into .grad; returns the mean loss."""
        S, P = self.numel, len(self.params)
        works = [dist.irecv(self.inboxes[w - 1], group=self.group, group_src=w)
                 for w in range(1, self.world)]
        total = self._pack_push(own_loss).clone()
        for work, inbox in zip(works, self.inboxes, strict=True):
            work.wait()
            self._count_received(inbox)
            total += inbox  # rank order: the same sum whatever order messages arrive in
        total[:S] /= self.world
        self._unpack_gradients(total[:S], total[S:S + P])
        return float(total[S + P]) / self.world

    def send_parameters(self, loss: float, grad_norm: float) -> None:
        """Server: after the optimizer step, send the new parameters to every worker."""
        self.version += 1
        buf = self._pack_pull(loss, grad_norm)
        works = [dist.isend(buf, group=self.group, group_dst=w) for w in range(1, self.world)]
        for work in works:
            work.wait()
        self.traffic.bytes_sent += len(works) * buf.numel() * buf.element_size()
        self.traffic.messages += len(works)

    # -- server side, asynchronous ----------------------------------------------------------
    def serve(self, apply: Callable[[float], None], grad_norm: float) -> None:
        """Server: handle one push from each worker, in rank order (module docstring), by the
        bounded-staleness rule. `apply(lr_scale)` clips and applies the gradients now in .grad.
        """
        S, P = self.numel, len(self.params)
        inbox = self.push_buf
        for src in range(1, self.world):
            dist.recv(inbox, group=self.group, group_src=src)
            self._count_received(inbox)
            loss, computed_on = inbox[S + P:].tolist()
            self.served_losses.append(loss)
            tau = self.version - int(computed_on)
            if tau > self.max_staleness:
                self.staleness.dropped += 1
            else:
                self._unpack_gradients(inbox[:S], inbox[S:S + P])
                apply(1.0 / (1 + tau))
                self.version += 1
                self.staleness.applied.append(tau)
            self._send(self._pack_pull(loss, grad_norm), src)

    # -- everyone ---------------------------------------------------------------------------
    def broadcast_parameters(self) -> None:
        """Every rank: take the server's parameters and version (a collective)."""
        if self.is_server:
            self._pack_pull(0.0, 0.0)
        dist.broadcast(self.pull_buf, group=self.group, group_src=SERVER)
        if not self.is_server:
            self._unpack_pull()


class PulledParameters(torch.optim.Optimizer):
    """A worker's optimizer: the server steps, and the new parameters arrive with the pull, so
    step() leaves them alone. It exists so the trainer's loop and LR schedule run unchanged."""

    def __init__(self, params: Sequence[nn.Parameter], lr: float):
        super().__init__(list(params), dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        return closure() if closure is not None else None


def parameter_server_group(topo: Topology) -> dist.ProcessGroup:
    """A fresh group over this rank's dp ranks, for push/pull traffic only (all ranks call)."""
    mine = None
    for ranks in topo.all_groups("dp"):
        group = dist.new_group(ranks)
        if topo.rank in ranks:
            mine = group
    return mine


class ServerSync:
    """The parameter server as the data-parallel step of ``tessera.step.Executor``: the chunks
    of this rank (pp = tp = 1: the whole model) replicated over the dp group, whose first rank
    is the server. The executor runs the schedule locally, then ``exchange`` replaces the
    all-reduce: push/pull (sync) or bounded-staleness serving (async)."""

    def __init__(self, chunks: dict[int, nn.Module], topo: Topology, cfg: ParallelConfig):
        self.params = [p for c in sorted(chunks) for p in chunks[c].parameters()]
        self.ps = ParameterServer(self.params, parameter_server_group(topo),
                                  asynchronous=cfg.dp_mode == "ps-async",
                                  max_staleness=cfg.max_staleness)
        self._loss = 0.0
        self._grad_norm = 0.0
        self._serving = False
        self._grad_clip = 0.0

    def optimizer(self, params: Sequence[nn.Parameter], cfg: TrainConfig
                  ) -> torch.optim.Optimizer:
        self._grad_clip = cfg.grad_clip
        if not self.ps.is_server:
            return PulledParameters(params, cfg.lr)
        opt = adamw(params, cfg)
        opt.register_step_post_hook(lambda o, args, kwargs: self._after_server_step(o))
        return opt

    def _local_grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        add_sums_of_squares(sq, [p.grad for p in self.params if p.grad is not None])
        return float(sq) ** 0.5

    def exchange(self, loss: float, model=None) -> float:
        """After the local backward. Sync: the mean loss over all ranks (workers return after
        pulling the new parameters). Async: a worker's own loss; the server's mean of its own
        loss and those it served in its previous step."""
        ps = self.ps
        if ps.is_server:
            if ps.asynchronous:
                losses = [loss, *ps.served_losses]
                ps.served_losses.clear()
                self._loss = sum(losses) / len(losses)
            else:
                self._loss = ps.gather_gradients(loss)
            return self._loss
        if ps.asynchronous:
            self._grad_norm = self._local_grad_norm()
            ps.push(loss)
            ps.pull()
            return loss
        ps.push(loss)
        self._loss, self._grad_norm = ps.pull()
        return self._loss

    @torch.no_grad()
    def clip_grad_norm_(self, executor, max_norm: float) -> float:
        """The server clips; a worker reports the norm the server sent (sync) or the norm of
        its own gradient, which the server clips on arrival (async)."""
        if not self.ps.is_server:
            return self._grad_norm
        self._grad_norm = self._clip(max_norm)
        return self._grad_norm

    @torch.no_grad()
    def _clip(self, max_norm: float) -> float:
        norm = self._local_grad_norm()
        if max_norm > 0 and norm > max_norm:
            scale_all_([p.grad for p in self.params if p.grad is not None],
                       max_norm / (norm + 1e-6))
        return norm

    def _after_server_step(self, opt: torch.optim.Optimizer) -> None:
        if self._serving:
            return
        ps = self.ps
        if not ps.asynchronous:
            ps.send_parameters(self._loss, self._grad_norm)
            return
        ps.version += 1  # the server's own gradient, just applied

        def apply(lr_scale: float) -> None:
            self._clip(self._grad_clip)
            saved = [group["lr"] for group in opt.param_groups]
            for group in opt.param_groups:
                group["lr"] = group["lr"] * lr_scale
            self._serving = True
            try:
                opt.step()
            finally:
                self._serving = False
                for group, lr in zip(opt.param_groups, saved, strict=True):
                    group["lr"] = lr

        ps.serve(apply, self._grad_norm)

    def sync_replicas(self) -> None:
        """Async: give every rank the server's parameters before a collective read of them."""
        if self.ps.asynchronous:
            self.ps.broadcast_parameters()


__all__ = ["ParameterServer", "ServerSync", "PulledParameters", "Traffic",
           "StalenessLog", "parameter_server_group"]
