"""Communication: collectives and point-to-point transfers priced per rank, and the waits
for the slowest rank. Notation as in :mod:`tessera.planner.workload`.

Communication, α–β (Hockney) model, per rank, ring algorithms (Thakur et al. 2005):
all-reduce of n bytes over N ranks ``2(N−1)·α + 2·(N−1)/N·n·β``; all-gather and reduce-scatter
half of that; a point-to-point send ``α + n·β``. Link: intra-node (NVLink) when the group fits
in a node under the (pp, dp, cp, tp) rank order, else inter-node (InfiniBand).

- tensor parallelism (Shoeybi et al. 2019; Narayanan et al. 2021 §3.3): two all-reduces of
  b·s·h in forward and two in backward per layer per micro-batch, 8·b·s·h·(t−1)/t elements
  per rank, plus two more when the forward is recomputed; with sequence parallelism each
  all-reduce becomes an all-gather plus a reduce-scatter of the same volume (Korthikanti et al.);
- pipeline: one send of b·s·h activations forward and of its gradient backward per
  micro-batch per stage boundary; with the scatter/gather optimization (Narayanan et al.
  §4.1) or sequence parallelism b·s·h/t per rank over the inter-node link, all-gathered on the
  intra-node link;
- context parallelism (``tessera.parallel.context_parallel``, the bytes of its
  ``bytes_per_layer``): ring attention (Liu et al. 2023) passes a K/V block of b·(s/c)·kv in
  each of c−1 steps forward, and K/V (c−1 steps) plus the dK/dV accumulators (c steps)
  backward, overlapped with the attention compute of the step; all-gather (Llama 3) and
  Ulysses' all-to-alls are priced by their volumes, not overlapped; the hybrid
  (``parallel.cp_ulysses`` = u) as Ulysses over u ranks (the link of t·u ranks) plus the ring
  over c/u ranks, whose hops overlap;
- stragglers: the wait for the slowest rank at each blocking collective, zero on GPUs
  (:func:`tessera.planner.local.terms.rank_skew`).
"""

from __future__ import annotations

from tessera.planner.hardware import Hardware, Link
from tessera.planner.local.terms import local_terms
from tessera.planner.workload import Layout, Workload


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2(n−1) steps of α plus 2(n−1)/n · bytes at the link bandwidth."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes * link.beta


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a `nbytes` result: half an all-reduce, at the
    link's gather efficiency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return ((n - 1) * link.alpha + (n - 1) / n * nbytes * link.beta) / link.gather_efficiency


def group_link(hw: Hardware, span: int, stride: int = 1) -> Link:
    """The link a collective uses over a group of ranks `stride` apart spanning `span` ranks.

    Intra-node when the span fits in a node. Across nodes NCCL runs one ring per network
    adapter, so a group with k members in each node drives k adapters in parallel: bandwidth
    min(intra-node, k · inter-node per GPU), k = node size / stride (at least 1)."""
    if span <= hw.gpus_per_node:
        return hw.link(intra_node=True)
    per_node = max(1, hw.gpus_per_node // stride)
    inter, intra = hw.link(intra_node=False), hw.link(intra_node=True)
    return Link(alpha=inter.alpha, bandwidth=min(intra.bandwidth, per_node * inter.bandwidth),
                gather_efficiency=inter.gather_efficiency)


def p2p_link(hw: Hardware, span: int) -> Link:
    """A point-to-point transfer between ranks of a group spanning `span` ranks: each GPU sends
    through its own adapter when the group leaves the node (calibrated CPU machines measure
    sends separately from collectives)."""
    link = hw.link(intra_node=span <= hw.gpus_per_node)
    terms = local_terms(hw)
    if terms.p2p_alpha_us is not None or terms.p2p_gbs is not None:
        link = Link(alpha=link.alpha if terms.p2p_alpha_us is None else terms.p2p_alpha_us * 1e-6,
                    bandwidth=link.bandwidth if terms.p2p_gbs is None else terms.p2p_gbs * 1e9)
    return link


def exposed_behind(comm: float, units: int, compute: float, depth: int,
                   lead: bool = False) -> float:
    """Seconds of `units` equal collectives of `comm` seconds each, run one after another on
    one channel, that `compute` seconds of work (spread evenly over the units) cannot hide.

    - a collective that needs its unit's compute to end first (a gradient bucket, a
      reduce-scatter; depth 0, lead False) starts when unit i's compute ends: the channel
      finishes at max over i of ((i+1)·c + (units − i)·comm), c = compute/units, so the
      exposed tail is max(comm, units·comm − (units − 1)·c);
    - a gather its unit's compute waits for (lead True) with `depth` units prefetched: the
      first gather is exposed whole; with depth ≥ 1 each later one hides behind the previous
      unit's compute, exposing max(0, comm − c) each; with depth 0 nothing is hidden.
    Never negative, and at most units·comm."""
    if units <= 0 or comm <= 0:
        return 0.0
    c = compute / units
    if lead:
        if depth == 0:
            return units * comm
        return comm + (units - 1) * max(0.0, comm - c)
    return max(comm, units * comm - (units - 1) * c)


CP_STEPS = {"ring": lambda n: (n - 1, 2 * n - 1), "allgather": lambda n: (n - 1, 2 * (n - 1)),
            "ulysses": lambda n: (4 * (n - 1), 4 * (n - 1))}
"""Message steps (forward, backward) of each pure context-parallel method over n ranks, one α
each: the ring's hops (backward: K/V n−1, dK/dV n), a ring all-gather (backward: and a
reduce-scatter), Ulysses' four all-to-alls of n−1 messages (q, k, v in, the output back)."""


def context_parallel_times(w: Workload, t: int, cp: int, b: int, method: str, link: Link,
                           ulysses: int = 2, ulysses_link: Link | None = None
                           ) -> tuple[float, float, float, float]:
    """(forward, backward seconds, and the ring's part of each) of one layer's
    context-parallel traffic: each phase of ``context_parallel.phase_bytes`` (heads per tp
    rank; bf16/fp32 activations, the ring's dK/dV in fp32) priced as its pure method over its
    group, one α per message step (CP_STEPS). Hybrid runs Ulysses over `ulysses` ranks (on
    `ulysses_link`, default `link`) and the ring over cp/ulysses ranks, as the runtime does.
    The ring's hops overlap the block products (the ring part); all-gathers and all-to-alls
    wait for their data."""
    if cp == 1:
        return 0.0, 0.0, 0.0, 0.0
    from tessera.parallel.context_parallel import phase_bytes

    spec, e = w.model, w.bytes[3]
    heads, kv = spec.heads // t, max(spec.kv_heads // t, 1)
    fwd = bwd = ring_fwd = ring_bwd = 0.0
    for pure, n, vol in phase_bytes(method, cp, b, heads, kv, w.seq_len // cp, spec.head_dim,
                                    e, ulysses):
        hybrid_a2a = method == "hybrid" and pure == "ulysses" and ulysses_link is not None
        on = ulysses_link if hybrid_a2a else link
        steps = CP_STEPS[pure](n)
        f = steps[0] * on.alpha + vol["forward"] * on.beta
        g = steps[1] * on.alpha + vol["backward"] * on.beta
        fwd, bwd = fwd + f, bwd + g
        if pure == "ring":
            ring_fwd, ring_bwd = ring_fwd + f, ring_bwd + g
    return fwd, bwd, ring_fwd, ring_bwd


OPS_PER_TENSOR_BUCKET = 3
"""Kernels per parameter tensor in tessera's DataParallel gradient hook (the copy into the
bucket, the gradient re-pointed at its slot, the used flag)."""


def ddp_bucket_time(hw: Hardware, grad_bytes: float, tensors: int) -> float:
    """Seconds tessera's DataParallel spends on its buckets besides the all-reduce: each
    freshly allocated gradient copied into its slot during backward by a per-tensor hook (the
    trainer zeroes gradients with set_to_none, as torch DDP's bucket views are also refilled
    by a copy: ``ddp_copy_passes`` over every gradient byte, 2 unless calibrate measured it,
    where it also holds the launch, the all-reduce in flight and the work after the wait)
    and the buckets divided by dp after the wait (a read and a write of every byte), plus the
    hook's fixed cost per tensor (``ddp_tensor_us`` where calibrate measured it, else
    OPS_PER_TENSOR_BUCKET kernels). Compute cannot hide it: it runs on the rank's own
    thread."""
    terms = local_terms(hw)
    per_tensor = (terms.ddp_tensor_us if terms.ddp_tensor_us > 0
                  else OPS_PER_TENSOR_BUCKET * hw.op_overhead_us) * 1e-6
    return (terms.ddp_copy_passes + 2) * grad_bytes / hw.memory_bw + tensors * per_tensor


def scalar_sync_times(w: Workload, L: Layout) -> tuple[float, float, float]:
    """Seconds of the scalar all-reduces every tessera step makes after its backward
    (``tessera.step.Executor``): the mean loss over pp, then over dp·cp; the squared gradient
    norm over dp·cp where ZeRO shards the gradients or the optimizer (``norm_groups``), over tp
    and over pp. 8 bytes each, so each costs its group's latency: 2(n−1)·α as a ring, which on
    a calibrated CPU is what gloo's small all-reduce takes. Returns (dp·cp, tp, pp) parts."""
    hw = w.hardware
    if L.dp_mode != "allreduce":  # a parameter server reduces the loss with its exchange
        return 0.0, 0.0, 0.0
    dpcp, t, p = L.dp * L.cp, L.tp, L.pp
    dp_link = group_link(hw, t * L.cp * L.dp, stride=t * L.cp)
    dp = allreduce_time(8, dpcp, dp_link) * (2 if L.zero_stage >= 1 else 1)
    tp = allreduce_time(8, t, group_link(hw, t))
    pp = 2 * allreduce_time(8, p, group_link(hw, t * L.cp * L.dp * p, stride=t * L.cp * L.dp))
    return dp, tp, pp
