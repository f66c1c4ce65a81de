"""What data parallelism costs a step, measured with its control inside the same run.

    flock /tmp/tessera-bench.lock python benchmarks/dp_cost.py --dp 2 --zero-stage 3 \
        --micro-batch 2 [--blocks 20] [--block 4] [--rebuilds 2]
        [--same [--aa {built,shared-params,one-model}] | --hooks-only | --grads-in-place]

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
The two models are built ``rebuilds`` times (default 2; bench_planner_local.py builds them
again every 2 measured blocks), in turn DP first and control first, each build running its
share of the blocks. A build's pairs ran in the same ten-odd seconds of the run and share the
host's speed in them: on this shared VM a step's time jumps by tens of percent for seconds at a
time, which cancels only in part between a DP block and the control block ~2 s away. So a
build's pairs are not independent, and the estimate needs many builds. (The first reading was
that where a build's tensors land moved its steps; an A/A run with one model in both places
spreads by build as much: the twenty-second run, `git show 9c9bd19:docs/planner.md`.)
``--same`` runs the method A/A (a second one-rank model in place of the DP model): its "cost"
is the method's own bias. ``--aa`` says what that second model is: ``built`` (default) a model
built beside the control, ``shared-params`` one whose parameters are the control's own tensors,
``one-model`` the control's model itself, run in both places (so nothing differs between the
two steps of a pair but when they ran). ``--hooks-only`` (DDP) runs the DP model's
forward_backward inside ``no_sync()``: the gradient hooks without the all-reduce.
``--grads-in-place`` (DDP) keeps the DP model's gradients as views of their buckets and
zeroes the buckets in place before each step (torch DDP's ``gradient_as_bucket_view`` with
``zero_grad(set_to_none=False)``): autograd then adds each new gradient into its slot and the
hooks copy nothing. The control keeps the trainer's ``set_to_none``.

Beside it, from the same run: the DP step's waits on collective handles
(``Executor.last_comm_wait_s``: the runtime's timestamps) and how much longer its compute
actions took than the control's (collectives' threads taking the cores, DDP's gradient
hooks), and of that the seconds in DDP's hooks (``DataParallel.hook_seconds``); the skew of
the control steps (slowest rank minus the mean: what a collective right after a step waits
for); and after each block, gloo's all-reduce of the whole model's
gradients and the all-gather and reduce-scatter of one block's parameters, each right after a
matmul as ``plan calibrate`` times them, so that the planner can be given the link rates of
this run (``bench_planner_local.inrun_hardware``); and how much of the DP step's excess is
in its ``forward_backward`` call and how much in the rest of the step, and how much more
thread CPU time that call took (a wait or a preemption adds none; more work, or the same work
in seconds when the host runs this VM's threads slower, does).

The interval printed beside a median is a 95% interval of the median: with several builds, a
bootstrap that resamples whole builds (their pairs share the build's seconds); with one, the
distribution-free interval of independent samples (order statistics n/2 ± 0.98·√n).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from tessera.planner.local.calibrate import rank_batch
from tessera.planner.local.links import timed_collective
from tessera.planner.local.machine import machine_shape

FIELDS = ("dp_s", "control_s", "waits_s", "dp_compute_s", "control_compute_s", "hooks_s",
          "skew_s", "allreduce_s", "allgather_s", "reduce_scatter_s", "build", "dp_fb_s",
          "control_fb_s", "dp_fb_cpu_s", "control_fb_cpu_s")
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
    hooks_s: list[float] = field(default_factory=list)
    """Per pair: the DP step's seconds in DDP's gradient hooks (``DataParallel.hook_seconds``:
    each fresh gradient's copy into its bucket slot and the bucket's launch), part of its
    compute; 0 for ZeRO, empty in results saved before the field."""
    skew_s: list[float] = field(default_factory=list)
    """Per pair: the slowest rank's control step minus the ranks' mean (what a collective
    after the step would wait for the slowest rank: the planner's straggler term)."""
    allreduce_s: list[float] = field(default_factory=list)
    allgather_s: list[float] = field(default_factory=list)
    reduce_scatter_s: list[float] = field(default_factory=list)
    build: list[int] = field(default_factory=list)
    """Per pair: which build of the two models it ran in (0 .. rebuilds-1); empty in results
    saved before the field."""
    dp_fb_s: list[float] = field(default_factory=list)
    control_fb_s: list[float] = field(default_factory=list)
    """Per pair: each step's forward_backward call (its actions, the waits, the loss's
    all-reduce); the rest of its step is zeroing, the norm and clipping, and AdamW. Empty in
    results saved before the fields."""
    dp_fb_cpu_s: list[float] = field(default_factory=list)
    control_fb_cpu_s: list[float] = field(default_factory=list)
    """Per pair: the same calls in the rank's thread CPU time, which a wait on a handle or
    another thread on the core does not add to: whether a slower step did more work. Empty in
    results saved before the fields."""
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

    @property
    def fb_excess_s(self) -> list[float]:
        """How much longer the DP step's forward_backward call took than the control's."""
        return [a - b for a, b in zip(self.dp_fb_s, self.control_fb_s, strict=True)]

    @property
    def rest_excess_s(self) -> list[float]:
        """How much longer the rest of the DP step (zeroing, norm and clipping, AdamW) took."""
        return [(a - fa) - (b - fb) for a, fa, b, fb in
                zip(self.dp_s, self.dp_fb_s, self.control_s, self.control_fb_s, strict=True)
                ] if self.dp_fb_s else []

    @property
    def fb_cpu_excess_s(self) -> list[float]:
        """How much more CPU time the DP step's forward_backward call took than the control's."""
        return [a - b for a, b in zip(self.dp_fb_cpu_s, self.control_fb_cpu_s, strict=True)]

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in (*FIELDS, "bucket_bytes", "unit_bytes")}


def median_interval(values: list[float],
                    build: list[int] | None = None) -> tuple[float, float, float]:
    """(median, low, high): a 95% interval of the median.

    Without `build` (or with one build): the distribution-free interval of independent
    samples (the binomial order statistics n/2 ± 0.98·√n, i.e. ±1.96 standard deviations of
    Binomial(n, 1/2)). With the build each pair ran in: pairs of one build ran in the same
    few seconds and share the host's speed in them (module docstring), so they are not
    independent; the interval is then the 2.5th-97.5th percentile of
    the median over a bootstrap that resamples whole builds (CLUSTER_RESAMPLES, fixed seed)."""
    if build and len(set(build)) > 1:
        return statistics.median(values), *cluster_bootstrap(values, build)
    xs = sorted(values)
    n = len(xs)
    half = 0.98 * math.sqrt(n)
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(xs), xs[lo], xs[hi]


CLUSTER_RESAMPLES = 2000


def by_build(values: list[float], build: list[int]) -> dict[int, list[float]]:
    """`values` grouped by the build each pair ran in."""
    groups: dict[int, list[float]] = {}
    for v, k in zip(values, build, strict=True):
        groups.setdefault(k, []).append(v)
    return groups


def bootstrap_medians(values: list[float], build: list[int] | None = None) -> list[float]:
    """The median of `values` over CLUSTER_RESAMPLES resamples (with replacement, fixed seed)
    of whole builds, sorted; without `build` (or with a single build), of single pairs."""
    clusters = (list(by_build(values, build).values()) if build and len(set(build)) > 1
                else [[v] for v in values])
    rng = random.Random(0)
    return sorted(statistics.median([v for c in rng.choices(clusters, k=len(clusters))
                                     for v in c]) for _ in range(CLUSTER_RESAMPLES))


def cluster_bootstrap(values: list[float], build: list[int]) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median of `values` over resamples (with
    replacement) of whole builds."""
    medians = bootstrap_medians(values, build)
    return (medians[int(0.025 * CLUSTER_RESAMPLES)],
            medians[int(0.975 * CLUSTER_RESAMPLES) - 1])


def repeat_chance(values: list[float], build: list[int] | None, target: float) -> float:
    """How often a prediction equal to the median of `values` would come within ±`target`
    of the median a repeat of the run measures (predicted / measured − 1): the share of
    bootstrap medians m (``bootstrap_medians``, the stand-in for a repeat's) with
    |median / m − 1| ≤ target. Optimistic as a right model's chance of passing the row: it
    leaves out the noise of the prediction's own inputs (the run's link rates), and a
    bootstrap over a few dozen builds understates the spread of their medians."""
    centre = statistics.median(values)
    medians = bootstrap_medians(values, build)
    return sum(m > 0 and abs(centre / m - 1) <= target for m in medians) / len(medians)


class StepTimes(NamedTuple):
    """One timed step, in seconds."""

    step: float
    waits: float
    """waited on DP collective handles"""
    busy: float
    """in compute actions (StepRecord.busy)"""
    fb: float
    """in the forward_backward call"""
    fb_cpu: float
    """the forward_backward call in this thread's CPU time"""


COLLECTIVE_REPEATS = 8
"""Calls of each collective timed per measured block (after 3 warm-up calls), whose median is
the block's sample: the in-run link rates of bench_planner_local.py come from the median over
the blocks. Was 2: at 24 blocks a row the median of a unit's all-gather had a 95% interval of
-25%/+35% (bootstrap over runs 37-39's blocks: 2.3 ms [1.8, 3.1] at dp 2, micro-batch 16), and
that noise alone moved a ZeRO-3 row's in-run price by up to 16% between runs of the same code
and files (dp 2 ZeRO-3 at micro-batch 2: 32.9, 32.5, then 37.8 ms as its gather read 1.88 ms
against 1.39-1.46) while its measured cost stayed at 30.6-31.6. With eight calls the whole
overlap bench took 34 minutes (runs 40 and 41) against 32 before (runs 37-39)."""


AA_MODES = ("built", "shared-params", "one-model")
"""What an A/A run's second one-rank model is (``paired_rank``'s `aa`)."""


def share_parameters(dst, src) -> None:
    """Make `dst`'s parameters views of `src`'s tensors (same storage, same values), so two
    models of the same shape step the same weights from the same memory. Each keeps its own
    optimizer state and its own gradients."""
    for p_dst, p_src in zip(dst.parameters(), src.parameters(), strict=True):
        p_dst.data = p_src.data


def timed_step(executor, optimizer, batch, clip: float,
               no_sync: tuple = (), in_place: tuple = ()) -> StepTimes:
    """One training step as the trainer runs it (zero, forward + backward with the DP
    reduction, norm and clipping, AdamW). `no_sync`: DataParallel wrappers whose
    ``no_sync()`` the forward_backward runs inside (the hooks copy, no bucket is reduced).
    `in_place`: DataParallel wrappers whose buckets are zeroed in place and whose parameters'
    gradients are set back to their bucket views after the zeroing (no copy in the hooks)."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    for wrapper in in_place:
        for bucket in wrapper.buckets:
            bucket.flat.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = view
    with contextlib.ExitStack() as stack:
        for wrapper in no_sync:
            stack.enter_context(wrapper.no_sync())
        t1, c1 = time.perf_counter(), time.thread_time()
        executor.forward_backward([batch])
        t2, c2 = time.perf_counter(), time.thread_time()
    executor.clip_grad_norm_(clip)
    optimizer.step()
    return StepTimes(time.perf_counter() - t0, executor.last_comm_wait_s,
                     executor.last_record.busy if executor.last_record else 0.0, t2 - t1,
                     c2 - c1)


def paired_rank(zero_stage: int, micro_batch: int, blocks: int, block: int,
                warmup: int, rebuilds: int = 2, same: bool = False,
                hooks_only: bool = False, grads_in_place: bool = False,
                aa: str = "built") -> dict:
    """On each rank: build both models, alternate their steps, return this rank's times.

    The models are built `rebuilds` times, in turn DP first and control first, and each build
    runs its share of the blocks (after `warmup` unrecorded blocks). Two identical one-rank
    models in the DP model's and the control's places, built in that order, measured a "cost"
    of -2 to +33 ms per rank (mean +18 ms of a ~470 ms step, three A/A runs of 24 pairs at
    micro-batch 16), and -15 to +14 (mean +2) built in the other order: about what DDP costs
    that step, so a fixed build order may add it to the DP cost; alternating it cancels the
    part that is build order. `same`: the "DP" model is a second one-rank model (no
    collectives): an A/A run, whose cost measures the method's own bias. `hooks_only`: the DP
    model's forward_backward runs inside its DDP wrappers' ``no_sync()``: the gradient hooks
    copy every gradient into its bucket, no bucket is all-reduced (the loss's scalar
    all-reduce still syncs the ranks): what the hooks cost the step without the collective.
    `grads_in_place`: the DP model's DDP gradients stay bucket views, zeroed in place.
    `aa` (with `same`): AA_MODES, what the second one-rank model is."""
    import gc

    from tessera.config_io import make_config
    from tessera.layout import validate
    from tessera.parallelize import parallelize
    from tessera.step import Executor
    from tessera.topology import Topology

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cpu")
    dp_world = 1 if same else world

    def config(dp: int):
        cfg = make_config("demo", parallel=dict(dp=dp, zero_stage=zero_stage if dp > 1 else 0),
                          train=dict(micro_batch_size=micro_batch, grad_accum=1,
                                     precision="fp32"))
        validate(cfg, dp)
        return cfg

    cfg = config(dp_world)
    solo = Topology.solo()
    topo = Topology.build(cfg.parallel, "cpu") if dp_world > 1 else solo

    def build(dp: int):
        c = config(dp)
        torch.manual_seed(c.train.seed)
        model = parallelize(c, topo if dp > 1 else solo, device)
        return Executor(model), model.optimizer(c.train), list(model.wrappers.values())

    def hook_seconds(wrappers: list) -> float:
        return sum(getattr(w, "hook_seconds", 0.0) for w in wrappers)

    # The collectives, in this window: the whole model's fp32 gradients and one block's.
    x = torch.randn(micro_batch * cfg.data.seq_len, cfg.model.d_model)
    w = torch.randn(cfg.model.ffn_hidden, cfg.model.d_model)
    batch = rank_batch(cfg.model.vocab_size, micro_batch, cfg.data.seq_len, rank)
    clip = cfg.train.grad_clip
    cores = machine_shape("cpu")[0]  # the ranks share this machine's cores
    out = PairedResult()
    share = [blocks // rebuilds + (k < blocks % rebuilds) for k in range(rebuilds)]
    bucket = unit = 0
    for k in range(rebuilds):
        models: dict = {}
        gc.collect()  # the previous build's tensors go back before this one allocates
        for which in (("dp", "control") if k % 2 == 0 else ("control", "dp")):
            models[which] = build(dp_world if which == "dp" else 1)
        if same and aa == "one-model":
            models["dp"] = models["control"]
        elif same and aa == "shared-params":
            share_parameters(models["dp"][0], models["control"][0])
        bucket = 4 * sum(p.numel() for p in models["control"][0].parameters())
        unit = bucket // cfg.model.n_layers
        for i in range(warmup + share[k]):
            times: dict[str, list[tuple[StepTimes, float]]] = {"dp": [], "control": []}
            for which in (("dp", "control") if i % 2 == 0 else ("control", "dp")):
                ex, opt, wrappers = models[which]
                for _ in range(block):
                    dist.barrier()  # every rank starts the step together, as control runs would
                    hooks = hook_seconds(wrappers)
                    dp = which == "dp"
                    step = timed_step(ex, opt, batch, clip,
                                      tuple(wrappers) if hooks_only and dp else (),
                                      tuple(wrappers) if grads_in_place and dp else ())
                    times[which].append((step, hook_seconds(wrappers) - hooks))
            timed = {name: timed_collective(op, size, COLLECTIVE_REPEATS, lambda: x @ w.t(),
                                            cores)
                     for name, op, size in (("allreduce_s", "all_reduce", bucket),
                                            ("allgather_s", "all_gather", unit),
                                            ("reduce_scatter_s", "reduce_scatter", unit))}
            if i >= warmup:  # a block's first step finds the other model's data in the caches
                for name, seconds in timed.items():
                    getattr(out, name).append(seconds)
                for (dp_t, hooks), (ctl_t, _) in zip(times["dp"][1:], times["control"][1:],
                                                     strict=True):
                    out.dp_s.append(dp_t.step)
                    out.control_s.append(ctl_t.step)
                    out.waits_s.append(dp_t.waits)
                    out.dp_compute_s.append(dp_t.busy)
                    out.control_compute_s.append(ctl_t.busy)
                    out.hooks_s.append(hooks)
                    out.dp_fb_s.append(dp_t.fb)
                    out.control_fb_s.append(ctl_t.fb)
                    out.dp_fb_cpu_s.append(dp_t.fb_cpu)
                    out.control_fb_cpu_s.append(ctl_t.fb_cpu)
                    out.build.append(k)
        del models
    out.bucket_bytes, out.unit_bytes = bucket, unit
    return out.to_dict()


PAIR_GUARD_S, BUILD_GUARD_S = 12.0, 30.0
"""measure_paired's time limit per pair of steps and per build. Was 4 s a pair and nothing per
build: on 2026-11-29 the slow host (3x the quiet one's step times) ran 4 ranks of ZeRO-3 at
micro-batch 16 at ~3.4 s a pair plus its builds, and the limit (696 s) killed the row with
its measurement; 12 s a pair is 3.5x that pace."""


def measure_paired(dp: int, zero_stage: int, micro_batch: int, blocks: int = 20,
                   block: int = 4, warmup: int = 1, rebuilds: int = 2,
                   same: bool = False, hooks_only: bool = False,
                   grads_in_place: bool = False, aa: str = "built") -> PairedResult:
    """Run `paired_rank` on `dp` ranks (one thread each); average each pair over the ranks.

    The ranks' time limit guards against a deadlock, not a budget: PAIR_GUARD_S per pair of
    steps (each model's step) and BUILD_GUARD_S per build of the two models."""
    from tessera.testing import run_ranks

    pairs = (blocks + rebuilds * warmup) * block
    per_rank = run_ranks(paired_rank, dp,
                         args=(zero_stage, micro_batch, blocks, block, warmup, rebuilds, same,
                               hooks_only, grads_in_place, aa),
                         timeout=120 + PAIR_GUARD_S * pairs + BUILD_GUARD_S * rebuilds,
                         start_method="spawn", collective_timeout=120)
    res = PairedResult(bucket_bytes=per_rank[0]["bucket_bytes"],
                       unit_bytes=per_rank[0]["unit_bytes"])
    for key in FIELDS:
        if key in ("skew_s", "build"):
            continue
        columns = zip(*(r[key] for r in per_rank), strict=True)
        getattr(res, key).extend(statistics.fmean(c) for c in columns)
    res.build = list(per_rank[0]["build"])
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
    ap.add_argument("--rebuilds", type=int, default=2,
                    help="builds of the two models, alternating which is built first")
    ap.add_argument("--same", action="store_true",
                    help="A/A: the 'DP' model is a second one-rank model (the method's bias)")
    ap.add_argument("--aa", choices=AA_MODES, default="built",
                    help="with --same: the second model is built beside the control (built), "
                         "shares its parameter tensors (shared-params), or is the control's "
                         "model itself (one-model)")
    ap.add_argument("--hooks-only", action="store_true",
                    help="DDP's hooks without its all-reduce: the DP model's forward_backward "
                         "inside no_sync() (zero stage 0 only)")
    ap.add_argument("--grads-in-place", action="store_true",
                    help="the DP model's DDP gradients stay bucket views, zeroed in place "
                         "each step, so the hooks copy nothing (zero stage 0 only)")
    ap.add_argument("--json", help="also write every pair to this file (PairedResult fields)")
    args = ap.parse_args()
    for flag, on in (("--hooks-only", args.hooks_only), ("--grads-in-place", args.grads_in_place)):
        if on and (args.zero_stage != 0 or args.same):
            ap.error(f"{flag} needs DDP (--zero-stage 0, not --same); got --zero-stage "
                     f"{args.zero_stage}{' --same' if args.same else ''}")
    if args.aa != "built" and not args.same:
        ap.error(f"--aa {args.aa} needs --same (an A/A run)")
    r = measure_paired(args.dp, args.zero_stage, args.micro_batch, args.blocks,
                       args.block, rebuilds=args.rebuilds, same=args.same,
                       hooks_only=args.hooks_only, grads_in_place=args.grads_in_place,
                       aa=args.aa)
    print("\n".join(summary(r)))
    if args.json:
        Path(args.json).write_text(json.dumps(r.to_dict()))


def summary(r: PairedResult) -> list[str]:
    """One line per quantity: median and its 95% interval, in ms."""
    out = []
    pairs = [("DP step", r.dp_s), ("control step", r.control_s), ("DP cost", r.cost_s),
             ("waits", r.waits_s), ("slowed compute", r.slowed_compute_s),
             ("DDP hooks", r.hooks_s), ("skew", r.skew_s), ("fb excess", r.fb_excess_s),
             ("rest excess", r.rest_excess_s), ("fb CPU excess", r.fb_cpu_excess_s)]
    blocks = [("all-reduce", r.allreduce_s), ("all-gather", r.allgather_s),
              ("reduce-scatter", r.reduce_scatter_s)]  # timed once a block, not per pair
    for per_pair, (name, values) in [(True, p) for p in pairs] + [(False, b) for b in blocks]:
        if not values:  # a field that results saved before it lack
            continue
        per_pair = per_pair and bool(r.build)
        m, lo, hi = median_interval(values, r.build if per_pair else None)
        out.append(f"{name:<15} {1e3 * m:8.2f} ms  (95% interval of the median {1e3 * lo:.2f}"
                   f"-{1e3 * hi:.2f}, {len(values)} samples"
                   f"{f' in {len(set(r.build))} builds' if per_pair else ''})")
    if len(set(r.build)) > 1:
        per_build = build_medians(r.cost_s, r.build)
        out.append("DP cost by build (median of each build's pairs, ms): "
                   + " ".join(f"{1e3 * v:.1f}" for v in per_build))
    return out


def build_medians(values: list[float], build: list[int]) -> list[float]:
    """The median of `values` within each build of the two models, in build order."""
    groups = by_build(values, build)
    return [statistics.median(groups[k]) for k in sorted(groups)]


if __name__ == "__main__":
    main()
