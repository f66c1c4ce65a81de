"""Schedule generators and their registry: each returns the action IR of ``schedule.py``.

With p ranks, m micro-batches and v chunks per rank (chunk c on rank c mod p, "looping"
placement), and equal forward/backward costs F, B per micro-batch per *rank's worth* of layers:

- ``naive``: plain model parallelism. One micro-batch runs forward through every stage and back
  before the next starts: with m = 1 the whole batch at once; with m > 1 it is gradient
  accumulation without overlap. Bubble p-1, one activation set in flight.
- ``gpipe`` (Huang et al., 2019): all m forwards, then all m backwards. Bubble (p-1)/m; a rank
  holds all m micro-batches' activations at the turn.
- ``1f1b`` (PipeDream-Flush; Narayanan et al., 2021, "Memory-efficient pipeline-parallel DNN
  training"): rank r runs p-r-1 warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards. Same bubble (p-1)/m; at most p-r micro-batches in flight.
- ``interleaved`` (Narayanan et al., SC 2021, Megatron-LM's depth-first interleaved 1F1B): each
  rank holds v chunks; forwards walk the chunks in groups of G micro-batches (G = p by
  default), warm-up 2(p-r-1) + (v-1)·G steps, then 1F1B. Bubble (p-1)/(v·m) at G = p; needs m a
  multiple of G. The group size G ≥ p is Megatron-LM's ``microbatch_group_size_per_vp_stage``
  and Llama 3's N (Grattafiori et al. 2024, §3.3.2, Figure 6): G > p runs more micro-batches
  through a chunk before the next (towards breadth-first: more time to hide point-to-point
  transfers) and holds more at the warm-up's peak, rank r: 2(p-r-1) + (v-1)·G + 1 sets.
- ``interleaved-lean``: the same order with the shortest warm-up, (p-r-1) + (v-1)·G: 1F1B's
  warm-up plus the other chunks' first group. With free transfers it has the same bubble (the
  simulator shows it; the pipeline tests check the closed form); it holds p-r-1 fewer sets at
  its peak, (p-r-1) + (v-1)·G + 1 on rank r (p-1 sets fewer than Megatron's on rank 0), but a
  forward now waits on the transfer before it where Megatron's extra p-r-1 forwards hide it.
  It is the interleaved order that fits where Megatron's warm-up does not (tessera's planner
  puts Llama 3 405B's published v = 2 layout at 109 GB on rank 1 with Megatron's warm-up, 79 GB
  with this one); the planner prices the transfers it no longer hides.
- ``bfs`` (Lamy-Poirier, MLSys 2023, "Breadth-First Pipeline Parallelism"): each rank runs its
  first chunk for every micro-batch, then its next chunk, ...; backwards in the reverse chunk
  order. Bubble (p-1)/(v·m) once m >= p, activations of all v·m (chunk, micro-batch) pairs held,
  but a chunk's gradients are complete early, so its data-parallel reduction overlaps compute.

Zero-bubble schedules, which split backwards into I and W (``zero_bubble.py``): ``zb-h1``,
``zb-v`` and ``dualpipev``; the last two run two chunks per rank in a V (chunk c < p on rank c,
chunk c >= p on rank 2p-1-c).

A new schedule plugs in with :func:`register`: give a generator ``(pp, m, v) -> per-rank
orders of F/B actions`` and the rules it needs (and where known, its closed-form bubble and
in-flight counts, and when it reaches its steady state); the runtime, simulator, pictures,
CLI and planner pick it up by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from tessera.errors import ConfigError
from tessera.pipeline.schedule import Action, B, F, Schedule
from tessera.pipeline.validator import validate
from tessera.pipeline.zero_bubble import dualpipev_orders, v_placement, zb_h1_orders, zb_v_orders

Orders = list[list[Action]]


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """How to build one family of schedules, and what it promises."""

    name: str
    """Registry key (the --schedule value)."""
    generate: Callable[..., Orders]
    """(pp, microbatches, virtual) -> per-rank ordered compute actions, chunks placed by
    `placement`. A ``grouped`` schedule's generator also takes the micro-batch group size (0:
    default)."""
    description: str
    """One line for help texts."""
    virtual: bool = False
    """Whether v > 1 chunks per rank are supported."""
    min_virtual: int = 1
    """Fewest chunks per rank (interleaving with one chunk per rank is plain 1F1B)."""
    chunks_per_rank: int = 0
    """The one number of chunks per rank the schedule runs (2 for the V shapes); 0: any
    (``virtual``, ``min_virtual``)."""
    placement: Callable[[int, int], tuple[int, ...]] = lambda pp, n_chunks: tuple(
        c % pp for c in range(n_chunks))
    """(pp, n_chunks) -> the rank of each chunk; default looping, chunk c on rank c % pp."""
    split_backward: bool = False
    """Backwards split into I and W (zero-bubble): a rank's last action may be a W that no
    other rank waits for (the planner's lower bound then counts no drain after it)."""
    microbatch_rule: Callable[..., str | None] = lambda pp, m, v: None
    """(pp, m, v) -> why m is not allowed, or None (``grouped``: (pp, m, v, group))."""
    grouped: bool = False
    """Whether the micro-batch group size can be chosen: generate and microbatch_rule then
    take it as a fourth argument."""
    closed_form_bubble: Callable[[int, int, int], float | None] | None = None
    """(pp, m, v) -> bubble fraction with equal costs (F = B, or F = I = W for split
    backwards) and free communication; None where it has none for these arguments."""
    breadth_first: bool = False
    """Each chunk runs all its micro-batches' forwards in a row, and all its backwards in a
    row, so under ZeRO-3 the schedule itself gathers each chunk once per run and reduces its
    gradient once per step (``schedule.add_sharding_actions``; the executor runs those actions
    instead of ZeRO's per-micro-batch hooks)."""
    closed_form_inflight: Callable[[int, int, int, int], tuple[int, ...]] | None = None
    """(pp, m, v, group) -> per rank, the most (micro-batch, chunk) activation sets held at
    once (forward done, backward not yet); None: the planner generates the schedule and counts
    (``simulator.peak_inflight``). The pipeline tests check each closed form against that
    count over a grid."""
    steady_after_periods: int = 2
    """After how many periods (p micro-batches, or lcm(p, group)) the schedule's step time
    grows linearly in m: the planner simulates a long schedule at two m from there on and
    extrapolates. 1 where the warm-up fits in a period; breadth-first, whose loops stall until
    the first micro-batch comes back around, and a schedule registered without saying, wait a
    period longer."""

    split_backwards: Callable[[int, int, int], int] | None = None
    """(pp, m, v) -> how many backwards the schedule splits into I and W (at most, where it
    depends on m in no simple way); None: every one where ``split_backward``, else none.
    :meth:`compute_actions` counts with it."""

    def orders(self, pp: int, m: int, v: int, group: int = 0) -> Orders:
        return self.generate(pp, m, v, group) if self.grouped else self.generate(pp, m, v)

    def compute_actions(self, pp: int, m: int, v: int) -> int:
        """The schedule's compute actions (F, B, I, W): a forward and a backward per (chunk,
        micro-batch), a split backward one more (its I and W)."""
        n = pp * v * m
        split = self.split_backwards(pp, m, v) if self.split_backwards else (
            n if self.split_backward else 0)
        return 2 * n + split

    def refusal(self, pp: int, m: int, v: int, group: int = 0) -> str | None:
        """Why m micro-batches are not allowed (with groups of `group`), or None."""
        return (self.microbatch_rule(pp, m, v, group) if self.grouped
                else self.microbatch_rule(pp, m, v))


SCHEDULES: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a schedule family to the registry (its name must be new)."""
    if spec.name in SCHEDULES:
        raise ValueError(f"schedule {spec.name!r} is already registered")
    SCHEDULES[spec.name] = spec
    return spec


def check_schedule(name: str, pp: int, microbatches: int, virtual: int = 1,
                   group: int = 0) -> None:
    """Raise ConfigError ('field=value: rule') unless schedule `name` exists for pp ranks, m
    micro-batches, v chunks per rank and micro-batch groups of `group` (0: the schedule's
    default), without generating it. These are the schedule's *shape* rules, on its own
    arguments; ``tessera.layout.validate`` asks them of a config and names its fields (the
    layout check and the planner ask this of many layouts)."""
    if name not in SCHEDULES:
        raise ConfigError("schedule", name, f"must be one of {', '.join(SCHEDULES)}")
    spec = SCHEDULES[name]
    for field_name, value in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(field_name, value, "must be a positive integer")
    if spec.chunks_per_rank and virtual != spec.chunks_per_rank:
        raise ConfigError("virtual", virtual, f"{name} runs {spec.chunks_per_rank} chunks per "
                          f"rank (rank r holds chunks r and 2*pp-1-r); set it to "
                          f"{spec.chunks_per_rank}")
    if virtual > 1 and not spec.virtual:
        raise ConfigError("virtual", virtual, f"schedule {name!r} has one chunk per rank; "
                          f"use {' or '.join(n for n, s in SCHEDULES.items() if s.virtual)} "
                          "for virtual stages")
    if not isinstance(group, int) or group < 0:
        raise ConfigError("group", group, "must be a non-negative integer (0: the default)")
    if group and not spec.grouped:
        raise ConfigError("group", group, f"schedule {name!r} has no micro-batch groups; "
                          f"only {' and '.join(n for n, s in SCHEDULES.items() if s.grouped)} "
                          "take a group size")
    if 0 < group < pp:
        # A chunk's next micro-batches would wait for the ring: Megatron's warm-up then
        # deadlocks, and the shortest warm-up that does not holds more than the default
        # (searched at p = 4, 8 and 16), so a group below pp buys nothing. interleaved-lean's
        # warm-up runs with some such groups, but slowly: at p = 4, v = 2, G = 2, m = 8 rank 0
        # holds 6 sets (8 at G = p) with a bubble of 0.44 (0.19 at G = p; 1F1B's is 0.375),
        # and at p = 8, v = 2, G = 2, m = 8 it deadlocks.
        raise ConfigError("group", group, f"micro-batch groups must hold at least pp={pp} "
                          "micro-batches (a smaller group stalls the ring)")
    why = spec.refusal(pp, microbatches, virtual, group)
    if why:
        raise ConfigError("microbatches", microbatches, why)


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 1,
                   group: int = 0) -> Schedule:
    """The validated compute-only schedule `name` for pp ranks, m micro-batches, v chunks/rank
    (and micro-batch groups of `group` where the schedule takes one; 0: its default): a new
    object per call (``validator.validate`` remembers what passed, so asking again costs no
    simulation).

    Bad arguments raise ConfigError with a one-line 'field=value: rule' message."""
    check_schedule(name, pp, microbatches, virtual, group)
    spec = SCHEDULES[name]
    schedule = Schedule(spec.name, spec.orders(pp, microbatches, virtual, group), pp * virtual,
                        microbatches, spec.placement(pp, pp * virtual))
    return validate(schedule)


def default_virtual(name: str) -> int:
    """Chunks per rank when none are asked for: the schedule's fixed number, else 1."""
    return SCHEDULES[name].chunks_per_rank or 1 if name in SCHEDULES else 1


def is_breadth_first(name: str) -> bool:
    """Whether schedule `name` is registered as breadth-first (``ScheduleSpec.breadth_first``)."""
    return name in SCHEDULES and SCHEDULES[name].breadth_first


def closed_form_bubble(name: str, pp: int, microbatches: int, virtual: int = 1,
                       group: int = 0) -> float | None:
    """The bubble fraction with equal costs and free communication, where a closed form is
    known (not for a group size other than the default)."""
    spec = SCHEDULES[name]
    if spec.closed_form_bubble is None or group not in (0, pp):
        return None
    return spec.closed_form_bubble(pp, microbatches, virtual)


# ---------------------------------------------------------------------------------------------
# Generators


def naive_orders(pp: int, m: int, v: int) -> Orders:
    return [[a for mb in range(m) for a in (F(r, mb), B(r, mb))] for r in range(pp)]


def gpipe_orders(pp: int, m: int, v: int) -> Orders:
    return [[F(r, mb) for mb in range(m)] + [B(r, mb) for mb in range(m)] for r in range(pp)]


def one_f_one_b_orders(pp: int, m: int, v: int) -> Orders:
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [F(r, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [F(r, warmup + i), B(r, i)]
        order += [B(r, mb) for mb in range(m - warmup, m)]
        orders.append(order)
    return orders


def interleaved_orders(pp: int, m: int, v: int, group: int = 0, *,
                       lean: bool = False) -> Orders:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``) with
    micro-batch groups of `group` (0: pp, Megatron's default; m must be a multiple); `lean`:
    the warm-up (p-r-1) + (v-1)·G instead of Megatron's 2(p-r-1) + (v-1)·G."""
    g = group or pp
    total = m * v

    def step(r: int, k: int, backward: bool) -> Action:
        # Virtual step k walks micro-batches in groups of g, all chunks of a group in turn.
        index, within = divmod(k, g * v)
        local = within // g
        if backward:
            local = v - 1 - local
        mb = index * g + within % g
        return (B if backward else F)(local * pp + r, mb)

    orders = []
    for r in range(pp):
        if lean:
            warmup = min(pp - r - 1 + (v - 1) * g, total)
        elif m == pp:  # Megatron: with m == p every forward goes first
            warmup = total
        else:
            warmup = min((pp - r - 1) * 2 + (v - 1) * g, total)
        order = [step(r, k, False) for k in range(warmup)]
        for i in range(total - warmup):
            order += [step(r, warmup + i, False), step(r, i, True)]
        order += [step(r, k, True) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def bfs_orders(pp: int, m: int, v: int) -> Orders:
    """Breadth-first looping: every micro-batch through local chunk 0, then chunk 1, ..."""
    orders = []
    for r in range(pp):
        chunks = [local * pp + r for local in range(v)]
        order = [F(c, mb) for c in chunks for mb in range(m)]
        order += [B(c, mb) for c in reversed(chunks) for mb in range(m)]
        orders.append(order)
    return orders


def _interleaved_rule(pp: int, m: int, v: int, group: int) -> str | None:
    g = group or pp
    if m % g:
        return (f"interleaved 1F1B needs micro-batches a multiple of the group size {g}" if group
                else f"interleaved 1F1B needs micro-batches a multiple of pp={pp}")
    return None


def _all_forwards_first(pp: int, m: int, v: int, group: int) -> tuple[int, ...]:
    return (v * m,) * pp  # every forward of a rank before its first backward


def _one_f_one_b_inflight(pp: int, m: int, v: int, group: int) -> tuple[int, ...]:
    return tuple(min(m, pp - r) for r in range(pp))  # p-r-1 warm-up forwards, then one more


def _interleaved_inflight(pp: int, m: int, v: int, group: int, *,
                          lean: bool = False) -> tuple[int, ...]:
    # Warm-up k(p-r-1) + (v-1)G steps, then one more forward before the first backward:
    # Megatron's k = 2 (every forward first when m = p), lean's k = 1.
    if not lean and m == pp:
        return (v * m,) * pp
    k, g = (1 if lean else 2), group or pp
    return tuple(min(v * m, k * (pp - r - 1) + (v - 1) * g + 1) for r in range(pp))


def _bfs_bubble(pp: int, m: int, v: int) -> float:
    # Each loop over the p ranks takes max(m, p) forward slots on rank 0 (the first micro-batch
    # must come back around before the next chunk starts); backwards mirror the forwards.
    loop = max(m, pp)
    return ((v - 1) * loop + pp - 1 + m - v * m) / (v * m)


_V_STEADY = 8
"""The V shapes reach their steady state late: rank 0 holds the first and the last chunk, and
with a heavier last chunk or slow transfers the warm-up's slack runs out only after up to 7
periods (measured for p = 4 to 16, a 6% heavier head, latency up to 70% of a forward)."""


def _v_fill_bubble(pp: int, m: int, v: int) -> float | None:
    # F = I = W per chunk: only the fill, the p-1 chunk forwards before the last rank's first,
    # which no schedule avoids; a rank computes 2m chunk-micro-batches of 3 units.
    return (pp - 1) / (6 * m) if m >= 2 * pp else None


def _v_inflight(pp: int, m: int, v: int, group: int, *, paired: bool = False) -> tuple[int, ...]:
    # Rank r's forwards before its first backward: 2p-r-1 of the down chunk (r), r+1 of the up
    # chunk (2p-1-r), at most m each; DualPipeV's paired steady state (m >= 2p-r) then runs
    # one more forward before each full backward.
    return tuple(min(m, 2 * pp - r - 1) + min(m, r + 1) + (paired and m >= 2 * pp - r)
                 for r in range(pp))


def _dualpipev_split(pp: int, m: int, v: int) -> int:
    # Only the warm-up and cool-down split: on rank r the warm-up's p-r-1, the cool-down's
    # last r+1 of its 2(r+1) and the p-r-1 after them, 2p-r-1 in all; p(3p-1)/2 over the ranks
    # (from m >= 2p; fewer micro-batches split fewer, and never more than all 2pm).
    return min(2 * pp * m, pp * (3 * pp - 1) // 2)


register(ScheduleSpec(
    name="naive", generate=naive_orders,
    description="model parallel, one micro-batch at a time (no overlap)",
    closed_form_bubble=lambda pp, m, v: float(pp - 1),
    closed_form_inflight=lambda pp, m, v, group: (1,) * pp, steady_after_periods=1))
register(ScheduleSpec(
    name="gpipe", generate=gpipe_orders, description="all forwards, then all backwards",
    closed_form_bubble=lambda pp, m, v: (pp - 1) / m,
    closed_form_inflight=_all_forwards_first, steady_after_periods=1))
register(ScheduleSpec(
    name="1f1b", generate=one_f_one_b_orders,
    description="PipeDream-Flush one-forward-one-backward",
    closed_form_bubble=lambda pp, m, v: (pp - 1) / m,
    closed_form_inflight=_one_f_one_b_inflight, steady_after_periods=1))
_INTERLEAVED = register(ScheduleSpec(
    name="interleaved", generate=interleaved_orders, virtual=True, min_virtual=2,
    description="Megatron interleaved 1F1B over v chunks per rank (depth-first)",
    microbatch_rule=_interleaved_rule,
    grouped=True,
    closed_form_bubble=lambda pp, m, v: (pp - 1) / (v * m),
    closed_form_inflight=_interleaved_inflight, steady_after_periods=1))
register(replace(
    _INTERLEAVED, name="interleaved-lean",
    generate=functools.partial(interleaved_orders, lean=True),
    description="interleaved 1F1B with the shortest warm-up: p-r-1 fewer sets in flight",
    closed_form_inflight=functools.partial(_interleaved_inflight, lean=True)))
register(ScheduleSpec(
    name="bfs", generate=bfs_orders, virtual=True,
    description="breadth-first looping over v chunks per rank (Lamy-Poirier 2023)",
    closed_form_bubble=_bfs_bubble, breadth_first=True,
    closed_form_inflight=_all_forwards_first))
register(ScheduleSpec(
    name="zb-h1", generate=zb_h1_orders, split_backward=True,
    description="1F1B with split backwards, W deferred into the cool-down (Qi et al. 2023)",
    closed_form_bubble=lambda pp, m, v: (pp - 1) / (3 * m) if m >= pp else None,
    closed_form_inflight=lambda pp, m, v, group: (min(pp, m),) * pp))
register(ScheduleSpec(
    name="zb-v", generate=zb_v_orders, virtual=True, chunks_per_rank=2, placement=v_placement,
    split_backward=True,
    description="zero-bubble V: two chunks per rank, r and 2p-1-r (Qi et al. 2023)",
    closed_form_bubble=_v_fill_bubble, closed_form_inflight=_v_inflight,
    steady_after_periods=_V_STEADY))
register(ScheduleSpec(
    name="dualpipev", generate=dualpipev_orders, virtual=True, chunks_per_rank=2,
    placement=v_placement, split_backward=True, split_backwards=_dualpipev_split,
    description="DeepSeek-V3's DualPipeV: V shape, paired forward/backward of two micro-batches",
    closed_form_bubble=_v_fill_bubble,
    closed_form_inflight=functools.partial(_v_inflight, paired=True),
    steady_after_periods=_V_STEADY))
