"""The one layout check: which parallel layouts tessera can build, and why not the others.

``validate(cfg, world_size)`` holds every rule that ties two fields together: those inside the
parallel section (``ep`` must divide ``dp``), and those between the parallel layout, the model,
the data and the training recipe (``tp`` must divide ``n_heads``, the layout must multiply to
the world size). The preflight (``tessera.preflight.check_run``) calls it once on every rank
and in the launching command, before any collective runs; the planner asks it of every layout
it proposes, so that it proposes only what ``tessera train`` runs. The config's dataclasses
check each field alone (ranges, types, names in a registry). Each failure is a
:class:`~tessera.errors.ConfigError` naming the field, the value and the rule.

Pipeline rules come in two kinds. *Shape* rules concern one schedule or one split alone and
live with it, checking that function's own arguments: ``pipeline.schedules.check_schedule``
(which pp, micro-batches m, chunks per rank v and group sizes a schedule family can be
generated for, e.g. interleaved 1F1B's m a multiple of its group) and
``pipeline.split.check_split`` (pp*virtual_stages chunks of at least one block each, adding up
to model.n_layers). This module asks them of the config and reports them under its field
names. *Layout* rules tie config fields together and live here. Three schedule rules a config
most often breaks are stated here first, in the config's terms, so the message names what to
change: virtual stages and micro-batch groups need a schedule that has them, and micro-batches
(train.grad_accum) a multiple of the group.
"""

from __future__ import annotations

from tessera.config import Config
from tessera.errors import ConfigError, require
from tessera.pipeline.schedules import SCHEDULES, check_schedule
from tessera.pipeline.split import check_split, parse_stage_layout

MAX_PIPELINE_PAIRS = 2**16
"""Most (micro-batch, chunk) pairs, grad_accum*pp*virtual_stages, a step may run. Each is a
forward and a backward action that every rank's schedule generates, validates and keeps:
building 2^17 pairs takes 8-11 s and ~200 MB in one process (1f1b at pp 2, interleaved at pp
8, v 4), 2^16 about half, and ten million never finishes. A run wanting more micro-batches of
the same global batch gets the same step with fewer, larger ones."""


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise ConfigError if `cfg`'s layout cannot be built (on `world_size` ranks, if given);
    return `cfg` (see the module doc)."""
    _check_parallel(cfg)
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    require(d.seq_len <= m.max_seq_len, "data.seq_len", d.seq_len,
            f"must be <= model.max_seq_len={m.max_seq_len}")
    # Before the pipeline rules: the schedule's size alone, without generating it.
    pairs = t.grad_accum * p.pp * p.virtual_stages
    require(pairs <= MAX_PIPELINE_PAIRS, "train.grad_accum", t.grad_accum,
            f"grad_accum*pp*virtual_stages={pairs:,} (micro-batch, chunk) pairs exceed "
            f"{MAX_PIPELINE_PAIRS:,}: each rank's schedule would hold and check a forward "
            "and a backward action for each, every step; use a larger "
            "train.micro_batch_size instead")
    _check_model_split(cfg)
    _check_moe(cfg)
    _check_parameter_server(cfg)
    _check_pipeline(cfg)
    require(not (p.dp_mode == "ps-async" and (t.checkpoint_interval or t.resume)),
            "parallel.dp_mode", p.dp_mode, "cannot checkpoint or resume: gradients in "
            "flight to the asynchronous parameter server are not saved")
    # Last: a layout that cannot split the model is the more useful message.
    if world_size is not None:
        require(p.world_size == world_size, "parallel", f"dp={p.dp} tp={p.tp} pp={p.pp} "
                f"cp={p.cp}", f"dp*tp*pp*cp={p.world_size} must equal the world size "
                f"{world_size}")
    return cfg


def _check_parallel(cfg: Config) -> None:
    """The rules between the parallel section's own fields."""
    p = cfg.parallel
    require(p.dp % p.ep == 0, "parallel.ep", p.ep, f"must divide parallel.dp={p.dp}")
    require(not (p.zero_stage > 0 and p.dp_mode != "allreduce"), "parallel.zero_stage",
            p.zero_stage, f"needs parallel.dp_mode='allreduce', not {p.dp_mode!r}")
    require(p.dp_mode == "allreduce" or p.dp >= 2, "parallel.dp_mode", p.dp_mode,
            f"a parameter server needs parallel.dp >= 2 (server and workers), got {p.dp}")
    spec = SCHEDULES[p.schedule]
    require(p.virtual_stages == 1 or spec.virtual, "parallel.virtual_stages", p.virtual_stages,
            f"needs schedule {', '.join(n for n, s in SCHEDULES.items() if s.virtual)}, "
            f"not {p.schedule!r}")
    require(p.microbatch_group == 0 or spec.grouped, "parallel.microbatch_group",
            p.microbatch_group,
            f"needs schedule {' or '.join(n for n, s in SCHEDULES.items() if s.grouped)}, "
            f"not {p.schedule!r}")


def _check_model_split(cfg: Config) -> None:
    """Tensor, sequence and context parallelism: how heads, columns and tokens split."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    # Tensor and sequence parallelism (Megatron): heads, kv heads and MLP columns split by tp.
    require(m.n_heads % p.tp == 0, "parallel.tp", p.tp,
            f"must divide model.n_heads={m.n_heads}")
    require(m.n_kv_heads % p.tp == 0 or p.tp % m.n_kv_heads == 0, "parallel.tp", p.tp,
            f"must divide model.n_kv_heads={m.n_kv_heads} or be a multiple of it")
    require(m.ffn_hidden % p.tp == 0, "parallel.tp", p.tp,
            f"must divide model.ffn_hidden={m.ffn_hidden}")
    require(not p.sequence_parallel or d.seq_len % p.tp == 0, "data.seq_len", d.seq_len,
            f"must be divisible by parallel.tp={p.tp} with sequence parallelism")
    if p.cp == 1:
        return
    # Context parallelism: the sequence is cut into 2·cp zig-zag chunks; lengths that do not
    # divide are refused (padding would change every rank's loss normalization).
    require(d.seq_len % (2 * p.cp) == 0, "data.seq_len", d.seq_len,
            f"must split into 2*parallel.cp zig-zag chunks (parallel.cp={p.cp}: a "
            f"multiple of {2 * p.cp})")
    heads, kv = m.n_heads // p.tp, max(m.n_kv_heads // p.tp, 1)
    if p.cp_method in ("ulysses", "hybrid"):
        u = p.cp if p.cp_method == "ulysses" else p.cp_ulysses
        if p.cp_method == "hybrid":
            require(u >= 2 and p.cp % u == 0, "parallel.cp_ulysses", u,
                    f"must be >= 2 and divide parallel.cp={p.cp}")
        require(heads % u == 0, "parallel.cp", p.cp,
                f"{p.cp_method}: query heads per tp rank (model.n_heads/tp={heads}) must "
                f"be divisible by the Ulysses degree {u}")
        require(kv % u == 0 or u % kv == 0, "parallel.cp", p.cp,
                f"{p.cp_method}: kv heads per tp rank ({kv}) must divide or be a "
                f"multiple of the Ulysses degree {u}")
    require(not p.sequence_parallel or (d.seq_len // p.cp) % p.tp == 0, "data.seq_len",
            d.seq_len, f"/ parallel.cp={p.cp} must be divisible by parallel.tp={p.tp} "
            "with sequence parallelism (each cp rank's tokens split over tp)")
    require(p.dp_mode == "allreduce", "parallel.dp_mode", p.dp_mode,
            "context parallelism reduces gradients over dp×cp with 'allreduce' only")


def _check_moe(cfg: Config) -> None:
    """Mixture of experts and expert parallelism (``tessera.moe``,
    ``tessera.parallel.expert_parallel``; ep dividing dp is a parallel-section rule)."""
    m, p = cfg.model, cfg.parallel
    if p.ep > 1:
        require(m.moe_experts > 0, "parallel.ep", p.ep,
                "expert parallelism needs a mixture-of-experts model (model.moe_experts > 0)")
        require(m.moe_experts % p.ep == 0, "parallel.ep", p.ep,
                f"must divide model.moe_experts={m.moe_experts} (each ep rank holds "
                "moe_experts/ep experts)")
        require(p.dp_mode == "allreduce", "parallel.dp_mode", p.dp_mode,
                "expert parallelism reduces expert gradients over their own replicas with "
                "'allreduce' only")
        require(cfg.train.precision == "fp32", "train.precision", cfg.train.precision,
                "expert parallelism is built and tested in fp32 only (bf16 not yet)")
    if m.moe_experts:
        require(p.cp == 1, "parallel.cp", p.cp,
                "mixture-of-experts layers route per whole sequence (capacity and the "
                "balance loss are per sequence), which context parallelism splits; use cp=1")
        require(not p.sequence_parallel, "parallel.sequence_parallel", True,
                "mixture-of-experts layers need each sequence whole on a rank (per-sequence "
                "capacity), which sequence parallelism splits over tp")


def _check_parameter_server(cfg: Config) -> None:
    """The parameter server holds one whole fp32 model replica per server rank."""
    p = cfg.parallel
    if p.dp_mode == "allreduce":
        return
    for name, value in (("tp", p.tp), ("pp", p.pp)):
        require(value == 1, f"parallel.{name}", value,
                f"dp_mode={p.dp_mode!r} composes only with data parallelism (must be 1): "
                "the server holds whole parameters and clips alone, with no model-parallel "
                "peers to agree the gradient norm with; use dp_mode='allreduce'")
    require(cfg.train.precision == "fp32", "train.precision", cfg.train.precision,
            f"dp_mode={p.dp_mode!r} trains in fp32 (the server keeps one copy of the "
            "weights, no fp32 master); use dp_mode='allreduce' for bf16")


SCHEDULE_FIELDS = {"microbatches": "train.grad_accum", "virtual": "parallel.virtual_stages",
                   "schedule": "parallel.schedule", "pp": "parallel.pp",
                   "group": "parallel.microbatch_group"}
"""``check_schedule``'s argument names, as the config's fields."""


def _check_pipeline(cfg: Config) -> None:
    """Enough blocks for the chunks, a stage layout that fits, a schedule that exists for this
    many micro-batches (module doc: its shape rules are ``check_schedule``'s)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    n_chunks = p.pp * p.virtual_stages
    check_split(m.n_layers, n_chunks, parse_stage_layout(p.stage_layout) if p.stage_layout
                else None, field="parallel.stage_layout", value=p.stage_layout, pp=p.pp)
    if p.pp > 1 or p.virtual_stages > 1:
        spec = SCHEDULES[p.schedule]
        require(p.virtual_stages >= spec.min_virtual, "parallel.virtual_stages",
                p.virtual_stages, f"{p.schedule} needs virtual_stages >= {spec.min_virtual} "
                "(with one chunk per rank it is plain 1f1b)")
        group = p.microbatch_group or p.pp
        require(not spec.grouped or t.grad_accum % group == 0, "train.grad_accum",
                t.grad_accum, f"{p.schedule} needs micro-batches a multiple of "
                + (f"parallel.microbatch_group={group}" if p.microbatch_group
                   else f"parallel.pp={p.pp}"))
        try:
            check_schedule(p.schedule, p.pp, t.grad_accum, p.virtual_stages, p.microbatch_group)
        except ConfigError as e:
            raise ConfigError(SCHEDULE_FIELDS.get(e.field_name, e.field_name), e.value,
                              e.rule) from None
    # ZeRO-3 gathers a unit when its module runs; a head reading another chunk's embedding on
    # the same rank would read a weight that is not gathered.
    if p.zero_stage == 3 and m.tie_embeddings and n_chunks > 1 and p.pp == 1:
        raise ConfigError("parallel.zero_stage", p.zero_stage,
                          "ZeRO-3 with tied embeddings needs the first and last chunks on "
                          f"different ranks or in one chunk (pp=1 with virtual_stages="
                          f"{p.virtual_stages} puts both on one rank)")
    if p.pp > 1 or p.virtual_stages > 1:
        check_split_backward(p.zero_stage, p.schedule, SCHEDULES[p.schedule].split_backward)
    # The chunked loss reads the head's weight outside the chunk's forward, where ZeRO-3 has
    # already released it.
    require(not (t.loss_chunk_tokens and p.zero_stage == 3), "train.loss_chunk_tokens",
            t.loss_chunk_tokens, "needs parallel.zero_stage < 3 (ZeRO-3 gathers the head's "
            "weight only while the head module runs)")


def check_split_backward(zero_stage: int, schedule: str, splits: bool) -> None:
    """ZeRO-3 (per-unit gathers driven by hooks) is refused with a schedule that splits its
    backwards into I and W (`splits`): a unit is freed when its weight gradients arrive, which
    W defers, so every unit of a chunk would stay gathered from I to W, across other
    micro-batches' work. Asked by ``validate`` and, for a custom schedule, by ``parallelize``."""
    require(not (zero_stage == 3 and splits), "parallel.zero_stage", zero_stage,
            f"schedule {schedule} splits each backward into I and W (weight gradients later); "
            "ZeRO-3 would hold every unit gathered from a chunk's I to its W: use "
            "zero_stage <= 2")


