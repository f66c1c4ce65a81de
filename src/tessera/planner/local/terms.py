"""The local-machine terms of the cost model: what ranks on one CPU machine add to a step that
one accelerator per rank does not (the catalog's GPUs hold no :class:`LocalTerms`, and every
function here gives their value there: 0, or the GPU form).

- the figures ``tessera plan calibrate`` measures on the machine (:class:`LocalTerms`, held by
  :class:`~tessera.planner.hardware.Hardware` as its ``local`` field; a hardware file holds
  them as flat keys beside the others);
- time-sharing: with more ranks on a machine than cores, ranks take turns on the cores
  (:func:`time_shared`), and a step cannot end before the cores have done all the ranks'
  work (:func:`shared_cpu_bound`);
- stragglers: ranks reach a collective after a stretch of compute whose time varies, and the
  collective waits for the slowest; for N ranks with independent normal noise the wait beyond
  a typical rank is the expected maximum of N standard normals (Blom's approximation,
  ``Φ⁻¹((N − 0.375)/(N + 0.25))``) times σ, with σ = a + jitter·√T + r·T for T seconds of
  compute (a fixed part, noise adding up, and ranks running at different speeds for the whole
  stretch; zero on GPUs). Counted at every blocking tensor-parallel collective and at each
  data-parallel reduction (:func:`rank_skew`);
- tessera's own data-parallel work on the rank's thread, as calibrate measured it
  (:func:`zero_unit_work`, :func:`ddp_copy_passes`, :func:`ddp_tensor_us`,
  :func:`optimizer_tensor_us`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError

if TYPE_CHECKING:
    from tessera.planner.compute import ChunkCosts
    from tessera.planner.hardware import Hardware
    from tessera.planner.workload import Layout, Workload


@dataclass(frozen=True, kw_only=True)
class LocalTerms:
    """The figures of a machine whose ranks compute on CPU cores, which calibrate measures; the
    defaults are the catalog GPUs' values (a Hardware with none holds ``local=None``)."""

    p2p_alpha_us: float | None = None
    """Latency of a point-to-point send when it differs from the collectives' α (gloo on a
    CPU); None: the link's."""
    p2p_gbs: float | None = None
    """Bandwidth of a point-to-point send when it differs from the link's; None: the link's."""
    gather_efficiency: float = 1.0
    """Speed of an all-gather or a reduce-scatter relative to the ring algorithm on the link
    that all-reduce achieves: 1 where both run the ring (NCCL); calibrate measures it for gloo,
    whose all-gather and reduce-scatter are slower than half its all-reduce."""
    optimizer_tensor_us: float = 0.0
    """Fixed cost per parameter tensor of a step's gradient norm and optimizer update beyond
    their memory traffic: what tessera's per-parameter loops cost on a CPU, their launches
    included. 0: OPS_PER_TENSOR_ADAMW kernels at op_overhead_us each, and no less than the
    step's kernel launches (``state.optimizer_step_time``)."""
    zero_unit_us: float = 0.0
    """tessera's ZeRO-3 work per unit per micro-batch besides its collectives, the part that
    does not grow with the unit (hooks, views, bookkeeping); 0 on GPUs, where it is too short
    to matter."""
    zero_unit_passes: float = 0.0
    """The part that grows with the unit, as passes over its parameter bytes at the memory
    bandwidth (fresh buffers for the gathered parameters and the flattened gradient, the copy
    into it, and on a CPU what gloo's thread takes from the rank's core while the prefetched
    gathers and the reduce-scatters are in flight), from whole forward + backward passes on
    several ranks less their waits (``calibrate.zero_step_passes``); 0 on GPUs."""
    ddp_tensor_us: float = 0.0
    """tessera's DataParallel gradient hook per parameter tensor beyond its copy's traffic
    (the slot lookup, the re-pointed gradient, the used flag). 0: OPS_PER_TENSOR_BUCKET
    kernels at op_overhead_us each."""
    ddp_copy_passes: float = 2.0
    """Passes over the gradient bytes, at the memory bandwidth, of the rest of what
    DataParallel adds to a step besides its waits and the division by dp (each fresh
    gradient's copy into its bucket slot and what that copy slows the backward around it,
    the launch, the all-reduce in flight, the work after the wait): 2 (a read and a write)
    for a plain copy; on a CPU what DataParallel adds to whole training steps at the user's
    micro-batch, less the waits (``calibrate.ddp_copy_passes``): the copy of a gradient just
    written by backward runs slower than a streaming copy, and slower the larger the
    micro-batch."""
    cores: int = 0
    """CPU cores that the ranks of one machine share (0: one device per rank, as on GPUs).
    With more ranks on a machine than cores, ranks time-share the cores."""
    jitter: float = 0.0
    """Noise of compute that adds up independently, in s^½: a stretch of T seconds of kernels
    takes T ± σ with σ = jitter·√T (plus the two terms below). Ranks reach a collective that
    far apart, so each collective waits for the slowest (:func:`straggler_time`); a file that
    gives neither of the two terms below holds its whole σ here."""
    jitter_fixed_us: float = 0.0
    """σ's part that does not grow with the stretch (µs): how far apart ranks released
    together start, and a collective's own wake-up."""
    jitter_rate: float = 0.0
    """σ's part that grows with the stretch, per second of it: ranks that run at different
    speeds for a whole stretch (a shared host's cores) finish it a fraction of T apart, so
    σ = jitter_fixed_us + jitter·√T + jitter_rate·T."""
    dp_overlap: float = 1.0
    """Seconds of a data-parallel collective (a ZeRO gather or reduce-scatter, a DDP bucket)
    that one second of compute beside it hides: 1 on GPUs, where NCCL runs on its own stream;
    on CPU ranks with a core each, the share ``calibrate.in_step_overlap`` reads off
    calibrate's ZeRO-3 steps, at most what ``machine.collective_overlap`` gives for the
    machine's shape beside plain compute; 0 where ranks time-share fewer cores."""
    calibrated_micro_batch: int = 0
    """The micro-batch `tessera plan calibrate` measured at (matmul shapes, the DDP hooks'
    copy, the jitter's stretches all depend on it); 0: not known."""

    def __post_init__(self) -> None:
        if not (isinstance(self.gather_efficiency, int | float) and self.gather_efficiency > 0):
            raise ConfigError("hardware.gather_efficiency", self.gather_efficiency,
                              "must be a positive number")
        for f in ("cores", "calibrated_micro_batch"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 0):
                raise ConfigError(f"hardware.{f}", getattr(self, f), "must be an integer >= 0")
        if not 0.0 <= self.dp_overlap <= 1.0:
            raise ConfigError("hardware.dp_overlap", self.dp_overlap, "must be in [0, 1]")
        for f in ("optimizer_tensor_us", "zero_unit_us", "zero_unit_passes", "ddp_tensor_us",
                  "ddp_copy_passes", "jitter", "jitter_fixed_us", "jitter_rate"):
            if getattr(self, f) < 0:
                raise ConfigError(f"hardware.{f}", getattr(self, f), "must be >= 0")


GPU_TERMS = LocalTerms()
"""The terms of hardware without local ones: one accelerator per rank."""
LOCAL_KEYS = tuple(f.name for f in fields(LocalTerms))
"""The flat hardware-file keys that make up :class:`LocalTerms`."""


def terms_from_flat(raw: dict[str, Any]) -> tuple[dict[str, Any], LocalTerms | None]:
    """(`raw` less the LocalTerms keys, the LocalTerms they give; None where they give none or
    only the GPU values)."""
    mine = {k: v for k, v in raw.items() if k in LOCAL_KEYS}
    rest = {k: v for k, v in raw.items() if k not in LOCAL_KEYS}
    terms = LocalTerms(**mine) if mine else None
    return rest, None if terms == GPU_TERMS else terms


def local_terms(hw: Hardware) -> LocalTerms:
    """`hw`'s local terms, the GPU values where it has none."""
    return hw.local or GPU_TERMS


def cpu_ranks(hw: Hardware) -> bool:
    """Ranks compute on CPU cores (a calibrated CPU machine: ``cores`` > 0), not one
    accelerator each."""
    return local_terms(hw).cores > 0


def ranks_time_share(cores: int, ranks: int) -> bool:
    """Whether `ranks` ranks on one machine with `cores` CPU cores take turns on them: more
    ranks than cores. Never for devices (``cores`` 0: a GPU each)."""
    return 0 < cores < ranks


def time_shared(w: Workload) -> bool:
    """More ranks on a machine than CPU cores (``cores``): they take turns on them."""
    return ranks_time_share(local_terms(w.hardware).cores, min(w.gpus, w.hardware.gpus_per_node))


def rank_skew(w: Workload, n: int, busy: float) -> float:
    """The wait for the slowest of `n` ranks at a collective (:func:`straggler_time`), except
    where ranks time-share cores: there a rank that arrives early leaves its core to the late
    ones, so the skew costs nothing beyond :func:`shared_cpu_bound`'s count of all the work and
    the cores it leaves idle, which a calibration at that rank count holds in its collectives'
    times (``links.timed_collective``)."""
    return 0.0 if time_shared(w) else straggler_time(w.hardware, n, busy)


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals], Blom's approximation Φ⁻¹((n − 0.375)/(n +
    0.25)) (0.59 for 2, 1.03 for 4; the exact values are 0.56 and 1.03)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def straggler_time(hw: Hardware, n: int, busy: float) -> float:
    """Expected wait at a collective of `n` ranks after `busy` seconds of compute on each:
    σ·E[max of n standard normals] with σ = jitter_fixed + jitter·√busy + jitter_rate·busy
    (module docstring)."""
    if n <= 1 or busy <= 0:
        return 0.0
    return jitter_sigma(hw, busy) * expected_max_normal(n)


def jitter_sigma(hw: Hardware, busy: float) -> float:
    """σ of `busy` seconds of compute on one rank (``LocalTerms.jitter`` and the two terms
    beside it)."""
    t = local_terms(hw)
    return t.jitter_fixed_us * 1e-6 + t.jitter * busy ** 0.5 + t.jitter_rate * busy


def zero_unit_work(hw: Hardware, units: int, weight_bytes: float) -> float:
    """Seconds of tessera's ZeRO-3 work around `units` units' collectives per micro-batch
    besides the collectives (a fixed part per unit and passes over the `weight_bytes` gathered
    parameter bytes): 0 where calibrate measured none."""
    t = local_terms(hw)
    return t.zero_unit_us * 1e-6 * units + t.zero_unit_passes * weight_bytes / hw.memory_bw


def shared_cpu_bound(w: Workload, L: Layout, chunks: list[ChunkCosts],
                     optimizer_time: float, exposed_dp: float = 0.0,
                     sync_time: float = 0.0) -> float:
    """Ranks that share CPU cores (``cores``) cannot finish a step before the cores have done
    all their work: ranks per machine · (a pipeline's work / p) / cores. A rank waiting in a
    bubble or on a message leaves its core to another rank, so this bound, not a uniform
    slow-down, is what oversubscription adds (0 on GPUs).

    Data-parallel collectives are the exception: every rank of the group waits on the same
    one (ZeRO's per-unit gathers and reductions, DDP's buckets after the last backward, the
    step's scalar reductions), so while it blocks them there is no other rank's compute to
    fill the cores: their exposed time (`exposed_dp` from the schedule's simulation, the
    chunks' ZeRO exposures, `sync_time`) is added once, not stretched by ranks / cores.

    Except the work in it that every rank does on its own thread at the same time as the
    others (``ChunkCosts.dp_cpu``: DDP's gradient hooks, which run inside the backward while
    every rank computes, and its division of the buckets right after the all-reduce that
    releases them all; ZeRO-3's work around each unit's collectives, which every rank does
    once the unit's gather or reduce-scatter releases them all): that is stretched like
    compute, by ranks / cores. ZeRO-3's share of it (calibrated as the ranks' mean thread CPU
    in whole steps, ``calibrate.zero_step_passes``) is stretched in full."""
    hw = w.hardware
    if not time_shared(w):
        return 0.0
    cores = local_terms(hw).cores
    ranks = min(w.gpus, hw.gpus_per_node)
    m = L.microbatches(w.global_batch)
    zero = m * sum(c.zero_forward + c.zero_backward for c in chunks)
    pipeline_work = m * sum(c.forward + c.backward for c in chunks) - zero + \
        L.pp * optimizer_time
    own = sum(c.dp_cpu for c in chunks) / L.pp  # already in exposed_dp / zero once
    return (ranks * pipeline_work / L.pp / cores + zero / L.pp + exposed_dp + sync_time
            + (ranks / cores - 1) * own)
