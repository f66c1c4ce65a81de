"""What data parallelism costs a step, measured with its control inside the same run.

    flock /tmp/tessera-bench.lock python benchmarks/dp_cost.py --dp 2 --zero-stage 3 \
        --micro-batch 2 [--blocks 20] [--block 4]

The question is the step time a DP layout pays for its collectives (DDP's bucket all-reduce,
ZeRO-3's per-unit gathers and reduce-scatters, the scalar all-reduces of the loss and the norm)
over N ranks that each did the same work alone. Timing the DP run and a control run (N
single-rank runs started together) one after the other does not answer it here: on a shared
2-core machine a run's median step moves by 8-26% between runs, while what DP costs is 3-20%
of a step.

So the N ranks of one launch hold two models of the demo preset (fp32, micro-batch b, one
micro-batch per step): the layout under test over all N ranks (dp = N), and a *control*, a
one-rank model on each rank whose groups hold only that rank (``Topology.solo``), so its
steps run no collective at all, as N independent runs would. They run in blocks of 4 steps,
DP then control, then control then DP, each step after a barrier so every rank starts it
together; the cores are shared the same way in both (each rank and gloo's threads of the DP
model, or each rank alone). A block's first step is dropped: it finds the other model's
weights in the caches (alternating every step made both 40% slower). The cost is the median
over pairs (the i-th step of a DP block and of the control block beside it) of (DP step -
control step), averaged over the ranks: the machine's drift is common to the two and cancels.

Beside it, from the same run: the DP step's waits on collective handles
(``Executor.last_comm_wait_s``: the runtime's timestamps) and how much longer its compute
actions took than the control's (collectives' threads taking the cores, DDP's gradient
hooks); the skew of the control steps (slowest rank minus the mean: what a collective right
after a step waits for); and after each block, gloo's all-reduce of the whole model's
gradients and the all-gather and reduce-scatter of one block's parameters, each right after a
matmul as ``plan calibrate`` times them, so that the planner can be given the link rates of
this run (``bench_planner_local.inrun_hardware``).

The interval printed beside a median is the distribution-free 95% interval of a median
(order statistics n/2 ± 0.98·√n of the sorted differences).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tessera.planner.calibrate import timed_collective

FIELDS = ("dp_s", "control_s", "waits_s", "dp_compute_s", "control_compute_s", "skew_s",
          "allreduce_s", "allgather_s", "reduce_scatter_s")
COLLECTIVES = ("allreduce_s", "allgather_s", "reduce_scatter_s")
"""Per block, timed as ``plan calibrate`` times them (each call right after a matmul at the
model's shapes), on the DP group: gloo's all-reduce of the whole model's gradients (DDP's one
bucket here) and the all-gather and reduce-scatter of one block's parameters (a ZeRO unit)."""


@dataclass
class PairedResult:
    """Per pair, averaged over the ranks: the DP step and the control step (seconds), the DP
    step's waits on collective handles, and each step's compute actions (the runtime's
    forward and backward time, ``StepRecord.busy``)."""

    dp_s: list[float] = field(default_factory=list)
    control_s: list[float] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)
    dp_compute_s: list[float] = field(default_factory=list)
    control_compute_s: list[float] = field(default_factory=list)
    skew_s: list[float] = field(default_factory=list)
    """Per pair: the slowest rank's control step minus the ranks' mean (what a collective
    after the step would wait for the slowest rank: the planner's straggler term)."""
    allreduce_s: list[float] = field(default_factory=list)
    allgather_s: list[float] = field(default_factory=list)
    reduce_scatter_s: list[float] = field(default_factory=list)
    bucket_bytes: int = 0
    unit_bytes: int = 0

    @property
    def cost_s(self) -> list[float]:
        """DP step minus control step: everything data parallelism costs the step."""
        return [a - b for a, b in zip(self.dp_s, self.control_s, strict=True)]

    @property
    def cost_vs_slowest_s(self) -> list[float]:
        """DP step minus the slowest rank's control step: what DP costs beyond the time N
        independent runs at once take to finish. Where ranks time-share cores this is the
        control the planner predicts (all the work over the cores: the last rank to finish;
        a rank that finishes early hands its core to the others), so the skew of the
        independent runs is not a cost of DP there."""
        return [a - (b + k) for a, b, k in zip(self.dp_s, self.control_s, self.skew_s,
                                                strict=True)]

    @property
    def slowed_compute_s(self) -> list[float]:
        """How much longer the DP step's forward and backward took than the control's: the
        collectives' threads taking the cores from compute, and DDP's gradient hooks."""
        return [a - b for a, b in zip(self.dp_compute_s, self.control_compute_s, strict=True)]

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in (*FIELDS, "bucket_bytes", "unit_bytes")}


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """(median, low, high): the 95% distribution-free interval of the median (the binomial
    order statistics n/2 ± 0.98·√n, i.e. ±1.96 standard deviations of Binomial(n, 1/2))."""
    xs = sorted(values)
    n = len(xs)
    half = 0.98 * math.sqrt(n)
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(xs), xs[lo], xs[hi]


def timed_step(executor, optimizer, batch, clip: float) -> tuple[float, float, float]:
    """One training step as the trainer runs it (zero, forward + backward with the DP
    reduction, norm and clipping, AdamW); returns (seconds, seconds waited on DP handles,
    seconds of compute actions)."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    executor.forward_backward([batch])
    executor.clip_grad_norm_(clip)
    optimizer.step()
    return (time.perf_counter() - t0, executor.last_comm_wait_s,
            executor.last_record.busy if executor.last_record else 0.0)


def paired_rank(zero_stage: int, micro_batch: int, blocks: int, block: int,
                warmup: int) -> dict:
    """On each rank: build both models, alternate their steps, return this rank's times."""
    from tessera.config import make_config
    from tessera.parallelize import parallelize
    from tessera.step import Executor
    from tessera.topology import Topology

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cpu")

    def build(dp: int, topo_of):
        cfg = make_config("demo", parallel=dict(dp=dp, zero_stage=zero_stage if dp > 1 else 0),
                          train=dict(micro_batch_size=micro_batch, grad_accum=1,
                                     precision="fp32"))
        cfg.validate(dp)
        torch.manual_seed(cfg.train.seed)
        model = parallelize(cfg, topo_of(cfg), device)
        return cfg, Executor(model), model.optimizer(cfg.train)

    cfg, dp_exec, dp_opt = build(world, lambda c: Topology.build(c.parallel, "cpu"))
    _, ctl_exec, ctl_opt = build(1, lambda c: Topology.solo())
    # The collectives, in this window: the whole model's fp32 gradients and one block's.
    bucket = 4 * sum(p.numel() for p in ctl_exec.parameters())
    unit = bucket // cfg.model.n_layers
    x = torch.randn(micro_batch * cfg.data.seq_len, cfg.model.d_model)
    w = torch.randn(cfg.model.ffn_hidden, cfg.model.d_model)
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.data.seq_len + 1),
                           generator=gen)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    clip = cfg.train.grad_clip
    out = PairedResult()
    for i in range(warmup + blocks):
        times: dict[str, list[tuple[float, float, float]]] = {"dp": [], "control": []}
        order = ("dp", "control") if i % 2 == 0 else ("control", "dp")
        for which in order:
            ex, opt = (dp_exec, dp_opt) if which == "dp" else (ctl_exec, ctl_opt)
            for _ in range(block):
                dist.barrier()  # every rank starts the step together, as control runs would
                times[which].append(timed_step(ex, opt, batch, clip))
        timed = {name: timed_collective(op, size, 2, lambda: x @ w.t())
                 for name, op, size in (("allreduce_s", "all_reduce", bucket),
                                        ("allgather_s", "all_gather", unit),
                                        ("reduce_scatter_s", "reduce_scatter", unit))}
        if i >= warmup:  # a block's first step finds the other model's data in the caches
            for name, seconds in timed.items():
                getattr(out, name).append(seconds)
            for dp_t, ctl_t in zip(times["dp"][1:], times["control"][1:], strict=True):
                out.dp_s.append(dp_t[0])
                out.control_s.append(ctl_t[0])
                out.waits_s.append(dp_t[1])
                out.dp_compute_s.append(dp_t[2])
                out.control_compute_s.append(ctl_t[2])
    out.bucket_bytes, out.unit_bytes = bucket, unit
    return out.to_dict()


def measure_paired(dp: int, zero_stage: int, micro_batch: int, blocks: int = 20,
                   block: int = 4, warmup: int = 1) -> PairedResult:
    """Run `paired_rank` on `dp` ranks (one thread each); average each pair over the ranks."""
    from tessera.testing import run_ranks

    per_rank = run_ranks(paired_rank, dp,
                         args=(zero_stage, micro_batch, blocks, block, warmup),
                         timeout=120 + 4 * blocks * block, start_method="spawn",
                         collective_timeout=120)
    res = PairedResult(bucket_bytes=per_rank[0]["bucket_bytes"],
                       unit_bytes=per_rank[0]["unit_bytes"])
    for key in FIELDS:
        if key == "skew_s":
            continue
        columns = zip(*(r[key] for r in per_rank), strict=True)
        getattr(res, key).extend(statistics.fmean(c) for c in columns)
    res.skew_s = [max(c) - statistics.fmean(c)
                  for c in zip(*(r["control_s"] for r in per_rank), strict=True)]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--block", type=int, default=4)
    args = ap.parse_args()
    r = measure_paired(args.dp, args.zero_stage, args.micro_batch, args.blocks,
                       args.block)
    print("\n".join(summary(r)))


def summary(r: PairedResult) -> list[str]:
    """One line per quantity: median and its 95% interval, in ms."""
    out = []
    for name, values in (("DP step", r.dp_s), ("control step", r.control_s),
                         ("DP cost", r.cost_s), ("waits", r.waits_s),
                         ("slowed compute", r.slowed_compute_s), ("skew", r.skew_s),
                         ("all-reduce", r.allreduce_s), ("all-gather", r.allgather_s),
                         ("reduce-scatter", r.reduce_scatter_s)):
        m, lo, hi = median_interval(values)
        out.append(f"{name:<15} {1e3 * m:8.2f} ms  (95% interval of the median {1e3 * lo:.2f}"
                   f"-{1e3 * hi:.2f}, {len(values)} samples)")
    return out


if __name__ == "__main__":
    main()
