"""Search: enumerate layouts, drop those over memory, rank the rest by simulated step time.

A layout is (dp, tp, pp, cp, v, micro-batch size, ZeRO stage, recomputation, schedule, sequence
parallelism) with dp·tp·pp·cp = GPUs, tp dividing the heads (and at most a node unless
allowed), pp·v dividing the layers and dp·b dividing the global batch.

Evaluation is two-stage. Every layout gets its costs and its peak memory (cheap: closed forms
and the schedule's in-flight counts); layouts over the device memory are dropped. The rest are
sorted by a lower bound on their step time (:func:`tessera.planner.pipeline.lower_bound`,
valid for any schedule), then simulated in that order; once the bound of the next layout
exceeds the k-th best simulated time, no later layout can enter the top k and the search stops.
The ranking is therefore the same as simulating everything, at a fraction of the cost.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tessera.errors import ConfigError
from tessera.pipeline.schedules import SCHEDULES
from tessera.pipeline.split import first_last_fewer
from tessera.planner.cost import LayoutCosts, zero3_by_actions
from tessera.planner.estimate import Estimate, PlanError, estimate, run_simulation, step_lower_bound
from tessera.planner.rules import check_layout
from tessera.planner.workload import GB, RECOMPUTE, Layout, Workload

SCHEDULE_CHOICES = ("1f1b", "interleaved", "interleaved-lean", "bfs", "gpipe", "naive", "zb-h1",
                    "zb-v", "dualpipev")
"""The schedules a search tries. The zero-bubble ones split each backward into I and W of half
the backward each (the simulator's default split: I ≈ W ≈ F for a transformer's matrix
multiplications without recomputation, the zero-bubble paper's assumption); zb-v and
dualpipev place a rank's two chunks in a V (``pipeline.rank_chunks``)."""


# ---------------------------------------------------------------------------------------------
# The space of layouts


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which values each degree may take (None: every value that divides)."""

    dp: Sequence[int] | None = None
    tp: Sequence[int] | None = None
    pp: Sequence[int] | None = None
    cp: Sequence[int] | None = (1,)
    """Context parallelism is off unless asked for (it pays only for long sequences)."""
    cp_method: Sequence[str] = ("ring",)
    """Context-parallel attention methods tried where cp > 1 (ring, allgather, ulysses,
    hybrid)."""
    cp_ulysses: Sequence[int] | None = None
    """Hybrid's Ulysses degrees (None: every divisor of cp); the layout rules keep those that
    run. The other methods keep Layout's default, which they do not read."""
    virtual_stages: Sequence[int] = (1, 2, 4, 8)
    micro_batch: Sequence[int] = (1, 2, 4, 8, 16)
    zero_stage: Sequence[int] = (0, 1, 2, 3)
    recompute: Sequence[str] = RECOMPUTE
    schedule: Sequence[str] = SCHEDULE_CHOICES
    sequence_parallel: Sequence[bool] = (False, True)
    dp_mode: Sequence[str] = ("allreduce",)
    """The parameter server ('ps', 'ps-async') is considered only when asked for."""
    tp_within_node: bool = True
    """Tensor parallelism only inside a node (Narayanan et al. 2021, takeaway #1)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(w: Workload, space: SearchSpace = SearchSpace(),
                      refusals: Counter[str] | None = None) -> Iterator[Layout]:
    """Every layout in `space` that `check_layout` accepts for `w`.

    Variants that change nothing are generated once: the schedule of a single chunk (pp = v = 1:
    always "1f1b") and sequence parallelism at tp = 1. For a tessera model nothing else is
    skipped before ``check_layout``, whose rules are tessera's; for other models the loops
    skip what the planner's own rules refuse anyway (tp not dividing the heads, pp the layers,
    ZeRO without data parallelism, schedules that :func:`_schedules` leaves out)."""
    n = w.gpus
    spec = w.model
    tessera = w.tessera_engine
    tps = [t for t in (space.tp or divisors(n)) if n % t == 0
           and (tessera or spec.heads % t == 0)
           and (not space.tp_within_node or t <= w.hardware.gpus_per_node)]
    for tp in tps:
        for cp in [c for c in (space.cp or divisors(n // tp)) if (n // tp) % c == 0]:
            rest = n // (tp * cp)
            for pp in [p for p in (space.pp or divisors(rest)) if rest % p == 0
                       and (tessera or _splits(spec.layers, p) is not False)]:
                dp = rest // pp
                if space.dp is not None and dp not in space.dp:
                    continue
                for b in space.micro_batch:
                    if w.global_batch % (dp * b):
                        continue
                    m = w.global_batch // (dp * b)
                    schedules = (_every_schedule(pp, space) if tessera
                                 else _schedules(pp, m, spec.layers, space))
                    for sched, v in schedules:
                        stages = None if tessera else _splits(spec.layers, pp * v)
                        for zero, rc, sp, mode, (method, u) in itertools.product(
                                space.zero_stage if tessera or dp * cp > 1 else (0,),
                                space.recompute,
                                space.sequence_parallel if tp > 1 else (False,),
                                space.dp_mode, _cp_methods(cp, space)):
                            L = Layout(dp=dp, tp=tp, pp=pp, cp=cp, virtual_stages=v, micro_batch=b,
                                       zero_stage=zero, recompute=rc, schedule=sched,
                                       sequence_parallel=sp, dp_mode=mode, cp_method=method,
                                       cp_ulysses=u, stage_layout=stages or None)
                            why = check_layout(w, L)
                            if why is None:
                                yield L
                            elif refusals is not None:
                                refusals[why] += 1


def _cp_methods(cp: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(cp_method, cp_ulysses) pairs to try: ring alone at cp = 1; hybrid with each Ulysses
    degree of the space, every other method with Layout's default degree."""
    if cp == 1:
        return [("ring", Layout.cp_ulysses)]
    return [(method, u) for method in space.cp_method
            for u in ((space.cp_ulysses or divisors(cp)) if method == "hybrid"
                      else (Layout.cp_ulysses,))]


def _every_schedule(pp: int, space: SearchSpace) -> Iterator[tuple[str, int]]:
    """Every (schedule, v) of the space; one chunk (pp = v = 1) runs under "1f1b" only."""
    for v in space.virtual_stages:
        for sched in space.schedule if pp > 1 or v > 1 else ("1f1b",):
            yield sched, v


def _splits(layers: int, n_chunks: int) -> tuple[int, ...] | None | bool:
    """How a non-tessera model's layers go on n_chunks chunks: None (evenly), Llama 3's first-
    and-last-one-fewer split where that is even (``first_last_fewer``), False if neither."""
    if layers % n_chunks == 0:
        return None
    try:
        return first_last_fewer(layers, n_chunks)
    except ConfigError:
        return False


def _schedules(pp: int, m: int, layers: int, space: SearchSpace) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    for sched in space.schedule:
        spec = SCHEDULES[sched]
        if spec.virtual:
            for v in space.virtual_stages:
                if (_splits(layers, pp * v) is False or v < spec.min_virtual
                        or (spec.grouped and m % pp)):
                    continue
                yield sched, v
        elif sched == "naive":
            if m == 1:
                yield sched, 1
        else:
            yield sched, 1


# ---------------------------------------------------------------------------------------------
# The search


@dataclass
class Plan:
    """The search's answer."""

    workload: Workload
    ranked: list[Estimate]
    """Simulated layouts, best first (the top of the whole space)."""
    considered: int
    """Layouts enumerated."""
    fitting: int
    """Layouts within memory."""
    simulated: int
    seconds: float
    smallest: Estimate | None = None
    """The layout with the least memory (reported when nothing fits)."""
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def search(w: Workload, space: SearchSpace = SearchSpace(), top: int = 10,
           layouts: Iterable[Layout] | None = None) -> Plan:
    """Rank the layouts of `space` (or the given `layouts`) that fit in memory; keep `top`.

    Python's cycle collector is paused meanwhile: the search makes millions of short-lived
    objects, none in cycles (reference counting frees them), and each collection it triggers
    would walk every object the process holds (in a test process, every earlier test's)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _search(w, space, top, layouts)
    finally:
        if enabled:
            gc.enable()


def _search(w: Workload, space: SearchSpace, top: int,
            layouts: Iterable[Layout] | None) -> Plan:
    t0 = time.perf_counter()
    refusals: Counter[str] = Counter()
    candidates = (list(layouts) if layouts is not None
                  else list(enumerate_layouts(w, space, refusals)))
    if not candidates:
        why = "; ".join(f"{reason} ({n} layouts)" for reason, n in refusals.most_common(2))
        raise PlanError(f"no layout of {w.gpus} GPUs can run {w.model.name} ({w.model.layers} "
                        f"layers, {w.model.heads} heads) at global batch {w.global_batch}"
                        + (f": most often {why}" if why else "")
                        + "; try another --gpus or --global-batch")
    capacity = w.hardware.memory_bytes - w.reserve_gb * GB
    fitting: list[Estimate] = []
    smallest: Estimate | None = None
    # Layouts that differ only in the schedule have the same chunk and rank costs (the schedule
    # orders them; only breadth-first ZeRO-3 is costed from its actions): computed once.
    shared: dict[Layout | tuple, LayoutCosts] = {}
    for L in candidates:
        key = L if zero3_by_actions(L) else L.key_without_schedule()
        est = estimate(w, L, simulate=False, check=layouts is not None, costs=shared.get(key),
                       bound=False)
        shared[key] = est.costs
        if smallest is None or est.memory.total < smallest.memory.total:
            smallest = est
        if est.memory.total <= capacity:  # only what fits is ranked, so only it is bounded
            est.lower_bound = step_lower_bound(w, L, est.costs, est.m)
            fitting.append(est)
    if not fitting:
        assert smallest is not None
        raise PlanError(
            f"{w.model.name} does not fit on {w.gpus} x {w.hardware.name} "
            f"({w.hardware.memory_gb:g} GB): the smallest memory any layout reaches is "
            f"{smallest.memory.total / GB:.1f} GB per GPU ({smallest.layout.describe()})")
    fitting.sort(key=lambda e: e.lower_bound)
    ranked: list[Estimate] = []
    simulated = 0
    for est in fitting:
        if len(ranked) >= top and est.lower_bound > ranked[top - 1].step_time:
            break
        run_simulation(est)
        simulated += 1
        ranked.append(est)
        ranked.sort(key=lambda e: (e.step_time, e.memory.total))
    return Plan(workload=w, ranked=ranked[:top], considered=len(candidates),
                fitting=len(fitting), simulated=simulated, seconds=time.perf_counter() - t0,
                smallest=smallest)
