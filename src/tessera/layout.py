"""The one layout check: which parallel layouts tessera can build, and why not the others.

``check_layout(cfg)`` holds every rule that ties the parallel layout to the model, the data and
the other mechanisms. ``Config.validate`` calls it (so every rank runs it before any collective,
and the command line before any process starts), ``tessera.parallelize`` calls it before
building, and the planner asks it of every layout it proposes, so that the planner proposes
only what ``tessera train`` runs. Each failure is a :class:`ConfigError` naming the field, the
value and the rule.
"""

from __future__ import annotations

from tessera.config import Config, ConfigError


def _require(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ConfigError(field, value, rule)


def check_layout(cfg: Config) -> None:
    """Raise ConfigError if `cfg`'s layout cannot be built (see the module doc)."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    # Tensor and sequence parallelism (Megatron): heads, kv heads and MLP columns split by tp.
    _require(m.n_heads % p.tp == 0, "parallel.tp", p.tp,
             f"must divide model.n_heads={m.n_heads}")
    _require(m.n_kv_heads % p.tp == 0 or p.tp % m.n_kv_heads == 0, "parallel.tp", p.tp,
             f"must divide model.n_kv_heads={m.n_kv_heads} or be a multiple of it")
    _require(m.ffn_hidden % p.tp == 0, "parallel.tp", p.tp,
             f"must divide model.ffn_hidden={m.ffn_hidden}")
    _require(not p.sequence_parallel or d.seq_len % p.tp == 0, "data.seq_len", d.seq_len,
             f"must be divisible by parallel.tp={p.tp} with sequence parallelism")
    # Context parallelism: the sequence is cut into 2·cp zig-zag chunks; lengths that do not
    # divide are refused (padding would change every rank's loss normalization).
    if p.cp > 1:
        _require(d.seq_len % (2 * p.cp) == 0, "data.seq_len", d.seq_len,
                 f"must split into 2*parallel.cp zig-zag chunks (parallel.cp={p.cp}: a "
                 f"multiple of {2 * p.cp})")
        heads, kv = m.n_heads // p.tp, max(m.n_kv_heads // p.tp, 1)
        if p.cp_method in ("ulysses", "hybrid"):
            u = p.cp if p.cp_method == "ulysses" else p.cp_ulysses
            if p.cp_method == "hybrid":
                _require(u >= 2 and p.cp % u == 0, "parallel.cp_ulysses", u,
                         f"must be >= 2 and divide parallel.cp={p.cp}")
            _require(heads % u == 0, "parallel.cp", p.cp,
                     f"{p.cp_method}: query heads per tp rank (model.n_heads/tp={heads}) must "
                     f"be divisible by the Ulysses degree {u}")
            _require(kv % u == 0 or u % kv == 0, "parallel.cp", p.cp,
                     f"{p.cp_method}: kv heads per tp rank ({kv}) must divide or be a "
                     f"multiple of the Ulysses degree {u}")
        _require(not p.sequence_parallel or (d.seq_len // p.cp) % p.tp == 0, "data.seq_len",
                 d.seq_len, f"/ parallel.cp={p.cp} must be divisible by parallel.tp={p.tp} "
                 "with sequence parallelism (each cp rank's tokens split over tp)")
        _require(p.dp_mode == "allreduce", "parallel.dp_mode", p.dp_mode,
                 "context parallelism reduces gradients over dp×cp with 'allreduce' only")
    _check_moe(cfg)
    # The parameter server holds one model replica per server rank.
    if p.dp_mode != "allreduce":
        for name, value in (("tp", p.tp), ("pp", p.pp)):
            _require(value == 1, f"parallel.{name}", value,
                     f"dp_mode={p.dp_mode!r} composes only with data parallelism (must be 1): "
                     "the server holds whole parameters and clips alone, with no model-parallel "
                     "peers to agree the gradient norm with; use dp_mode='allreduce'")
        _require(t.precision == "fp32", "train.precision", t.precision,
                 f"dp_mode={p.dp_mode!r} trains in fp32 (the server keeps one copy of the "
                 "weights, no fp32 master); use dp_mode='allreduce' for bf16")
    # Pipeline: enough layers for the chunks, a schedule that exists for this many
    # micro-batches.
    n_chunks = p.pp * p.virtual_stages
    _require(n_chunks <= m.n_layers, "parallel.pp", p.pp,
             f"pp*virtual_stages={n_chunks} stages exceed model.n_layers={m.n_layers} "
             "(each stage needs a block)")
    if p.stage_layout:
        from tessera.pipeline.split import parse_stage_layout

        sizes = parse_stage_layout(p.stage_layout)
        _require(len(sizes) == n_chunks, "parallel.stage_layout", p.stage_layout,
                 f"gives {len(sizes)} chunks; needs one per chunk, pp*virtual_stages="
                 f"{n_chunks}")
        _require(sum(sizes) == m.n_layers, "parallel.stage_layout", p.stage_layout,
                 f"holds {sum(sizes)} blocks; must add up to model.n_layers={m.n_layers}")
    from tessera.pipeline.schedules import SCHEDULES, check_schedule

    if p.pp > 1 or p.virtual_stages > 1:
        spec = SCHEDULES[p.schedule]
        _require(p.virtual_stages == 1 or spec.virtual, "parallel.virtual_stages",
                 p.virtual_stages, f"needs a schedule with virtual stages ("
                 f"{', '.join(n for n, sp in SCHEDULES.items() if sp.virtual)}), not "
                 f"{p.schedule!r}")
        _require(p.virtual_stages >= spec.min_virtual, "parallel.virtual_stages",
                 p.virtual_stages, f"{p.schedule} needs virtual_stages >= {spec.min_virtual} "
                 "(with one chunk per rank it is plain 1f1b)")
        group = p.microbatch_group or p.pp
        _require(not spec.grouped or t.grad_accum % group == 0, "train.grad_accum",
                 t.grad_accum, f"{p.schedule} needs micro-batches a multiple of "
                 + (f"parallel.microbatch_group={group}" if p.microbatch_group
                    else f"parallel.pp={p.pp}"))
        try:
            check_schedule(p.schedule, p.pp, t.grad_accum, p.virtual_stages, p.microbatch_group)
        except ConfigError as e:
            field = {"microbatches": "train.grad_accum", "virtual": "parallel.virtual_stages",
                     "schedule": "parallel.schedule", "pp": "parallel.pp",
                     "group": "parallel.microbatch_group"}.get(e.field_name, e.field_name)
            raise ConfigError(field, e.value, e.rule) from None
    # ZeRO-3 gathers a unit when its module runs; a head reading another chunk's embedding on
    # the same rank would read a weight that is not gathered.
    if p.zero_stage == 3 and m.tie_embeddings and n_chunks > 1 and p.pp == 1:
        raise ConfigError("parallel.zero_stage", p.zero_stage,
                          "ZeRO-3 with tied embeddings needs the first and last chunks on "
                          f"different ranks or in one chunk (pp=1 with virtual_stages="
                          f"{p.virtual_stages} puts both on one rank)")


def _check_moe(cfg: Config) -> None:
    """Mixture of experts and expert parallelism (``tessera.moe``,
    ``tessera.parallel.expert_parallel``)."""
    m, p = cfg.model, cfg.parallel
    if p.ep > 1:
        _require(m.moe_experts > 0, "parallel.ep", p.ep,
                 "expert parallelism needs a mixture-of-experts model (model.moe_experts > 0)")
        _require(m.moe_experts % p.ep == 0, "parallel.ep", p.ep,
                 f"must divide model.moe_experts={m.moe_experts} (each ep rank holds "
                 "moe_experts/ep experts)")
        _require(p.dp % p.ep == 0, "parallel.ep", p.ep,
                 f"must divide parallel.dp={p.dp} (ep groups are blocks of the dp ranks)")
        _require(p.dp_mode == "allreduce", "parallel.dp_mode", p.dp_mode,
                 "expert parallelism reduces expert gradients over their own replicas with "
                 "'allreduce' only")
        _require(cfg.train.precision == "fp32", "train.precision", cfg.train.precision,
                 "expert parallelism is built and tested in fp32 only (bf16 not yet)")
    if m.moe_experts:
        _require(p.cp == 1, "parallel.cp", p.cp,
                 "mixture-of-experts layers route per whole sequence (capacity and the "
                 "balance loss are per sequence), which context parallelism splits; use cp=1")
        _require(not p.sequence_parallel, "parallel.sequence_parallel", True,
                 "mixture-of-experts layers need each sequence whole on a rank (per-sequence "
                 "capacity), which sequence parallelism splits over tp")
