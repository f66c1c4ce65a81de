"""Mixture-of-experts terms of the planner: expert memory, all-to-all traffic, layouts with ep.

The dense planner (``cost``, ``search``) prices a model by its shape. A mixture of experts is
priced here in two parts:

1. **the active model**: what one token computes and stores is a dense model whose MoE layers'
   SwiGLU is k·f_e (+ the shared expert's f) wide (``active_spec``); the dense estimate of that
   model on the layout gives compute, activations, tp/pp/dp traffic and the dense state.
   tessera keeps MoE layers whole on every tp rank (``tessera.parallel.expert_parallel``), so
   for its engine (``Workload.tessera_engine``) the active model's MoE MLPs are tp× as wide
   (the dense estimate's 1/tp split then leaves each rank the whole k·f_e + f: tp× the expert
   FLOPs, parameters and saved activations of a split) and its MoE blocks carry attention's
   tensor-parallel collectives only; other engines' MoE is priced split over tp like a dense
   MLP, with its collectives (:func:`moe_tp`). The active model knows which blocks are MoE
   (``ModelSpec.moe``): each chunk counts its own MoE blocks' router GEMM (2·E·h FLOPs per
   token forward, twice that backward, on every tp rank), collectives and eager kernels
   (``compute.block_costs``; the launch floor's ``kernels.eager_moe_block`` counts E/ep
   experts on a rank, so :func:`rank_ep_layouts` estimates each ep apart); its model FLOPs
   (MFU) are the model's own, router included, as ``tessera.model.flops_per_token`` counts
   them;
2. **MoE terms** (:func:`moe_terms`), added on top:

   - expert memory: each rank holds E/ep experts of its stage's MoE layers whole, 3·h·f_e
     parameters each, at the workload's bytes of model state per parameter, which ZeRO shards
     over the expert-data group (dp/ep · cp ranks) as tessera does; the k experts the active
     model already counted (whole, or 1/tp of them split) are taken out (a rank with fewer than
     k experts holds less than the active model counted: the term is then negative); plus the
     router's E·h parameters per MoE layer, replicated over tp and ZeRO-sharded over dp·cp
     like the dense ones (its gradient's share of the dense all-reduce is left out:
     E/(3·k·f_e) of the layer's);
   - all-to-all: per MoE layer and micro-batch, four all-to-alls (dispatch and combine, forward
     and backward), each sending b·s·k·h activation bytes of which (ep−1)/ep leave the rank
     (balanced routing; dropless, or ≤ C·k with capacity C). Pairwise exchange: (ep−1)·α +
     bytes·β. The link is intra-node when the ep group (ep ranks tp·cp apart) fits in a node,
     else the inter-node link (``comm.group_link``). Not overlapped with compute.
   - expert gradient sync: the experts beyond the active model's are reduced over their
     expert-data group (dp/ep·cp ranks, ep·tp·cp apart): one all-reduce of their gradient per
     step, and under ZeRO-3 an all-gather of their parameters per micro-batch forward and
     backward. Counted without overlap (the dense estimate overlaps only its own reduction).

Layouts with ep are ranked by :func:`rank_ep_layouts`: every dense layout of the search times
every ep dividing dp and E, fitting layouts first, then by step time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.config import Config, ModelConfig
from tessera.planner.comm import allgather_time, allreduce_time, group_link
from tessera.planner.models import ModelSpec, MoEBlocks
from tessera.planner.workload import Layout, Workload

if TYPE_CHECKING:
    from tessera.planner.search import SearchSpace


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The mixture-of-experts part of a model's shape."""

    experts: int
    top_k: int
    every: int = 1
    """Every this-many-th layer is MoE."""
    expert_hidden: int
    """Each expert's SwiGLU inner size f_e."""
    shared_hidden: int = 0
    """The shared expert's inner size (0: none)."""
    capacity_factor: float = 0.0
    """0: dropless (each token sent k times); C: at most C·k copies per token on average."""
    aux_losses: bool = True
    """A load-balancing or z-loss coefficient > 0: the losses enter the backward."""
    router_bias: bool = False
    """DeepSeek-V3's balancing bias (a router bias rate > 0)."""

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> MoESpec | None:
        if not cfg.moe_experts:
            return None
        return cls(experts=cfg.moe_experts, top_k=cfg.moe_top_k, every=cfg.moe_every,
                   expert_hidden=cfg.moe_hidden,
                   shared_hidden=cfg.ffn_hidden if cfg.moe_shared_expert else 0,
                   capacity_factor=cfg.moe_capacity_factor,
                   aux_losses=cfg.moe_aux_loss_coef > 0 or cfg.moe_z_loss_coef > 0,
                   router_bias=cfg.moe_router_bias_rate > 0)

    def moe_layers(self, layers: int) -> int:
        return layers // self.every

    @property
    def copies_per_token(self) -> float:
        """Rows each token sends to experts: k, or at most C·k kept under capacity C < 1."""
        k = self.top_k
        return k if self.capacity_factor <= 0 else min(k, self.capacity_factor * k)


def moe_tp(w: Workload, tp: int) -> int:
    """On how many of `tp` tensor-parallel ranks each MoE layer is held whole: all `tp` for
    tessera's engine, which replicates router, experts and shared expert over tp
    (``tessera.parallel.expert_parallel``); 1 for other engines (kernels 'fused', precisions
    tessera does not run), priced with experts split over tp like a dense MLP."""
    return tp if w.tessera_engine else 1


def active_spec(spec: ModelSpec, moe: MoESpec, tp: int = 1, ep: int = 1) -> ModelSpec:
    """The dense model that computes, per tensor-parallel rank, what one token of the MoE model
    computes: MoE layers' MLPs k·f_e (+ shared) wide on each of `tp` ranks (``moe_tp``: held
    whole on each; 1: split over tp like the dense MLPs), averaged over the layers with the
    dense ones (the planner's blocks are uniform). Its ffn_hidden is tp × the rank's width, a
    multiple of tp, so that the dense estimate's 1/tp split leaves each rank that width. Its
    ``moe`` (:class:`~tessera.planner.models.MoEBlocks`) says which blocks are MoE, for what
    differs by block: their router GEMM, tensor-parallel collectives and eager kernels (with
    E/`ep` experts on a rank: ``compute``), and the model FLOPs (the model's own, not this
    per-rank width)."""
    moe_ffn = moe.top_k * moe.expert_hidden + moe.shared_hidden
    moe_layers = moe.moe_layers(spec.layers)
    per_rank = ((spec.layers - moe_layers) * spec.ffn_hidden / tp + moe_layers * moe_ffn
                ) / spec.layers
    blocks = MoEBlocks(every=moe.every, experts=moe.experts, dense_ffn=spec.ffn_hidden,
                       moe_ffn=moe_ffn, whole_tp=tp, top_k=moe.top_k,
                       shared=moe.shared_hidden > 0, capacity=moe.capacity_factor > 0,
                       aux_losses=moe.aux_losses, router_bias=moe.router_bias, ep=ep)
    return dataclasses.replace(spec, name=f"{spec.name} (active)", ffn_hidden=tp * round(per_rank),
                               moe=blocks)


@dataclass(frozen=True)
class MoETerms:
    """What the MoE part adds to a layout's estimate (per rank, per optimizer step)."""

    expert_bytes: float
    """Model-state bytes of the experts and routers minus what the active model counted."""
    alltoall_bytes: float
    """Bytes this rank sends in token all-to-alls."""
    alltoall_time: float
    expert_sync_time: float
    """Reduction (and ZeRO-3 gathers) of the expert parameters the active model leaves out."""
    intra_node: bool
    """The ep group fits in one node."""


def moe_terms(w: Workload, L: Layout, spec: ModelSpec, moe: MoESpec, ep: int) -> MoETerms:
    """Expert memory and all-to-all cost of MoE `moe` on layout `L` with expert degree `ep`
    (module doc for the formulas)."""
    h, f_e = spec.hidden, moe.expert_hidden
    p_bytes, g_bytes, o_bytes, a_bytes = w.bytes
    layers_here = moe.moe_layers(spec.layers) / L.pp  # MoE layers on the fullest stage

    def state(n: int) -> float:  # model-state bytes per parameter, ZeRO sharding over n ranks
        z = L.zero_stage
        return (p_bytes / (n if z >= 3 else 1) + g_bytes / (n if z >= 2 else 1)
                + o_bytes / (n if z >= 1 else 1))

    held = moe.experts / ep * 3 * h * f_e
    counted = moe.top_k * 3 * h * f_e * moe_tp(w, L.tp) / L.tp  # in the active model's estimate
    expert_bytes = layers_here * ((held - counted) * state(L.dp // ep * L.cp)  # expert-data
                                  + moe.experts * h * state(L.dp * L.cp))  # router: dense units
    m = L.microbatches(w.global_batch)
    rows = L.micro_batch * w.seq_len / L.cp * moe.copies_per_token
    per_exchange = rows * h * a_bytes * (ep - 1) / ep
    exchanges = 4 * layers_here * m
    stride = L.tp * L.cp
    link = group_link(w.hardware, ep * stride, stride)
    one = (ep - 1) * link.alpha + per_exchange * link.beta if ep > 1 else 0.0
    extra = layers_here * max(held - counted, 0.0)  # expert parameters beyond the active
    edp = L.dp // ep * L.cp
    edp_link = group_link(w.hardware, L.dp * stride, ep * stride)
    sync = allreduce_time(extra * g_bytes, edp, edp_link)
    if L.zero_stage == 3:
        sync += 2 * m * allgather_time(extra * p_bytes, edp, edp_link)
    return MoETerms(expert_bytes=expert_bytes, alltoall_bytes=exchanges * per_exchange,
                    alltoall_time=exchanges * one, expert_sync_time=sync,
                    intra_node=ep * stride <= w.hardware.gpus_per_node)


def active_workload(w: Workload, L: Layout, cfg: Config) -> tuple[Workload, MoETerms | None]:
    """How the planner prices a tessera run of `cfg` on layout `L`: the workload the dense
    estimate takes and the MoE terms added to it. `w` is the run's workload with the model's
    dense shape (``Workload.from_config``). A mixture of experts becomes its active model
    (:func:`active_spec`: top-k experts and the shared expert, on every moe_every-th block)
    with the terms of ``parallel.ep`` (:func:`moe_terms`); a dense model is `w` itself, with
    no terms. The one place the run summary (``report.planner_prediction``) and the preflight's
    memory (``preflight.memory_per_rank``) read the MoE part from."""
    moe = MoESpec.from_model_config(cfg.model)
    if moe is None:
        return w, None
    ep = cfg.parallel.ep
    terms = moe_terms(w, L, w.model, moe, ep)
    return dataclasses.replace(w, model=active_spec(w.model, moe, moe_tp(w, L.tp), ep)), terms


@dataclass(frozen=True)
class EPPlan:
    """One ranked layout: the dense layout, ep, and the MoE-adjusted prediction."""

    layout: Layout
    ep: int
    step_time: float
    memory_bytes: float
    terms: MoETerms
    fits: bool

    def describe(self) -> str:
        where = "intra-node" if self.terms.intra_node else "inter-node"
        return (f"{self.layout.describe()} ep={self.ep}: step {self.step_time * 1e3:.1f} ms "
                f"(all-to-all {self.terms.alltoall_time * 1e3:.1f} ms, {where}; expert sync "
                f"{self.terms.expert_sync_time * 1e3:.1f} ms), "
                f"{self.memory_bytes / 2**30:.1f} GiB/rank"
                + ("" if self.fits else " (does not fit)"))


def active_layouts(w: Workload, moe: MoESpec, space: SearchSpace, top: int) -> list[Layout]:
    """The layouts to rank with ep: for each tp degree of `space` (every divisor of the GPUs if
    none), the `top` best of the search over the active model at that degree (``moe_tp``'s
    width differs by tp). Raises the search's PlanError when no degree has a fitting layout."""
    from tessera.planner.estimate import PlanError
    from tessera.planner.search import divisors, search

    layouts: list[Layout] = []
    refused: PlanError | None = None
    for t in space.tp or divisors(w.gpus):
        active = dataclasses.replace(w, model=active_spec(w.model, moe, moe_tp(w, t)))
        try:
            plan = search(active, dataclasses.replace(space, tp=(t,)), top=top)
        except PlanError as e:
            refused = e
            continue
        layouts += [e.layout for e in plan.ranked]
    if not layouts and refused is not None:
        raise refused
    return layouts


def ep_degrees(dp: int, experts: int) -> list[int]:
    """The expert-parallel degrees a layout allows: divisors of dp that divide E."""
    return [e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0]


def rank_ep_layouts(w: Workload, moe: MoESpec, layouts: Iterable[Layout]) -> list[EPPlan]:
    """Every (layout, ep) with ep dividing dp and E, priced as the active model's estimate
    (its MoE blocks' kernels with E/ep experts on a rank) plus the MoE terms; fitting layouts
    first, then by predicted step time. Layouts the estimate refuses (PlanError, ConfigError)
    and those tessera's rules refuse for a mixture of experts (:func:`refusal`) are skipped."""
    from tessera.errors import ConfigError
    from tessera.planner.estimate import PlanError, estimate

    plans = []
    capacity = w.hardware.memory_bytes
    for L in layouts:
        for ep in ep_degrees(L.dp, moe.experts):
            active = dataclasses.replace(w, model=active_spec(w.model, moe, moe_tp(w, L.tp), ep))
            try:
                est = estimate(active, L)
            except (PlanError, ConfigError):
                continue
            if refusal(w, active, L, moe, ep) is not None:
                continue
            t = moe_terms(w, L, w.model, moe, ep)
            memory = est.memory.total + t.expert_bytes
            time = est.step_time + t.alltoall_time + t.expert_sync_time
            plans.append(EPPlan(L, ep, time, memory, t, fits=memory <= capacity))
    return sorted(plans, key=lambda p: (not p.fits, p.step_time))


def refusal(w: Workload, active: Workload, L: Layout, moe: MoESpec, ep: int) -> str | None:
    """Why tessera would refuse layout `L` with expert parallelism `ep` for the mixture of
    experts `moe` (``tessera.layout.validate`` on the run's config: the active model's with
    the experts and ep set; its MoE rules refuse sequence parallelism, cp > 1, and ep > 1 but
    in fp32 with 'allreduce'), or None; None for other engines' models."""
    from tessera.errors import ConfigError
    from tessera.layout import validate
    from tessera.planner.engine import to_config

    if not w.tessera_engine:
        return None
    try:
        cfg = to_config(active, L)
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, moe_experts=moe.experts,
                                           moe_top_k=moe.top_k),
            parallel=dataclasses.replace(cfg.parallel, ep=ep))
        validate(cfg, w.gpus)
    except ConfigError as e:
        return str(e)
    return None


def moe_for_model(name: str | None) -> MoESpec | None:
    """The MoE part of a tessera preset named `name` (``tessera plan --model moe-demo``), or
    None for a dense or unknown model."""
    from tessera.config_io import make_config
    from tessera.presets import PRESETS

    key = (name or "").lower()
    if key not in PRESETS:
        return None
    return MoESpec.from_model_config(make_config(key).model)


def ep_table(w: Workload, moe: MoESpec, layouts: Iterable[Layout], top: int) -> str:
    """The `top` (layout, ep) plans of `layouts`, one line each, best first."""
    plans = rank_ep_layouts(w, moe, layouts)
    head = (f"mixture of experts: E={moe.experts} top-{moe.top_k}, every {moe.every} layer(s); "
            f"layouts of the active model with every ep dividing dp and E, priced with expert "
            f"memory and all-to-all time (tessera.planner.moe)")
    return "\n".join([head, *(f"{i + 1:3d}. {p.describe()}" for i, p in
                              enumerate(plans[:top]))])
