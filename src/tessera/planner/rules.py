"""Which layouts can run a workload, and how a layout splits the layers into chunks.

For a model tessera's transformer expresses the rules are tessera's own
(``tessera.layout.check_layout`` through :func:`tessera.planner.engine.refusal`); for the other
catalog models the rules of Megatron-LM-style engines below.
"""

from __future__ import annotations

from tessera.config import DP_MODES
from tessera.errors import ConfigError
from tessera.planner import engine
from tessera.planner.workload import RECOMPUTE, Layout, Workload, stage_layout_text


def chunk_sizes(w: Workload, L: Layout) -> tuple[int, ...]:
    """Blocks per chunk: the layout's own stage layout, tessera's split, or l/(p·v) each."""
    if L.stage_layout:
        return L.stage_layout
    n = L.pp * L.virtual_stages
    if w.tessera_engine:  # tessera's split, with or without context parallelism
        return engine.blocks_per_chunk(w.model, n, w.seq_len)
    return (w.model.layers // n,) * n


def check_layout(w: Workload, L: Layout) -> str | None:
    """Why `L` cannot run `w` (one line), or None if it can.

    Whole micro-batches on every rank first; then, for a model tessera's transformer expresses,
    tessera's own rules (``tessera.layout.check_layout``, via ``engine.refusal``); for other
    catalog models the rules below, which describe Megatron-LM-style engines."""
    spec = w.model
    if L.gpus != w.gpus:
        return f"dp*tp*pp*cp={L.gpus} must equal the {w.gpus} GPUs"
    if w.global_batch % (L.dp * L.micro_batch):
        return f"dp*micro_batch={L.dp * L.micro_batch} must divide the global batch " \
               f"{w.global_batch}"
    n_chunks = L.pp * L.virtual_stages
    if L.stage_layout is not None:
        sizes = L.stage_layout
        if len(sizes) != n_chunks or min(sizes) < 1 or sum(sizes) != spec.layers:
            return (f"stage_layout={stage_layout_text(sizes)} must give pp*virtual={n_chunks} "
                    f"chunks of at least one block adding up to layers={spec.layers} (it "
                    f"gives {len(sizes)} chunks, {sum(sizes)} blocks)")
    if w.tessera_engine:
        return engine.refusal(w, L)
    if L.recompute not in RECOMPUTE:
        return f"recompute={L.recompute!r} must be one of {', '.join(RECOMPUTE)}"
    if L.zero_stage not in (0, 1, 2, 3):
        return f"zero={L.zero_stage} must be 0, 1, 2 or 3"
    if L.dp_mode not in DP_MODES:
        return f"dp_mode={L.dp_mode!r} must be one of {', '.join(DP_MODES)}"
    if L.dp_mode != "allreduce" and (L.tp, L.pp, L.cp, L.zero_stage, w.precision, L.dp < 2) != (
            1, 1, 1, 0, "fp32", False):
        return f"dp_mode={L.dp_mode!r} needs tp=pp=cp=1, zero=0, fp32 and dp >= 2 (the " \
               "server holds whole fp32 replicas)"
    if spec.heads % L.tp or spec.ffn_hidden % L.tp:
        return f"tp={L.tp} must divide heads={spec.heads} and ffn_hidden={spec.ffn_hidden}"
    if spec.kv_heads % L.tp and L.tp % spec.kv_heads:
        return f"tp={L.tp} must divide kv_heads={spec.kv_heads} or be a multiple of it"
    if w.seq_len % L.cp or (L.sequence_parallel and (w.seq_len // L.cp) % L.tp):
        return f"seq_len={w.seq_len} must be divisible by cp (and by tp with sequence parallel)"
    if L.sequence_parallel and L.tp == 1:
        return "sequence parallelism needs tp > 1"
    if L.cp > 1 and L.cp_method in ("ulysses", "hybrid"):
        from tessera.parallel.context_parallel import ulysses_kv_repeat

        u = L.cp if L.cp_method == "ulysses" else L.cp_ulysses
        if L.cp_method == "hybrid" and (u < 2 or L.cp % u):
            return f"cp_ulysses={u} must be >= 2 and divide cp={L.cp}"
        try:
            ulysses_kv_repeat(spec.heads // L.tp, max(spec.kv_heads // L.tp, 1), u)
        except ValueError as e:
            return str(e)
    if n_chunks > spec.layers:
        return f"pp*virtual={n_chunks} chunks exceed layers={spec.layers}"
    if L.stage_layout is None and spec.layers % n_chunks:
        example = stage_layout_text(_uneven(spec.layers, n_chunks))
        return (f"pp*virtual={n_chunks} must divide layers={spec.layers}, or give the blocks "
                f"per chunk (stage_layout, e.g. {example})")
    if L.pp == 1 and (L.virtual_stages != 1 or L.schedule != "1f1b"):
        return "without pipeline parallelism the schedule is 1f1b with virtual=1"
    from tessera.pipeline.schedules import SCHEDULES, check_schedule

    if L.virtual_stages > 1 and not SCHEDULES[L.schedule].virtual:
        return (f"virtual={L.virtual_stages} needs schedule "
                f"{', '.join(n for n, s in SCHEDULES.items() if s.virtual)}")
    m = L.microbatches(w.global_batch)
    if L.pp > 1 or L.virtual_stages > 1:  # the schedule's own rules (m, micro-batch groups)
        try:
            check_schedule(L.schedule, L.pp, m, L.virtual_stages, L.microbatch_group)
        except ConfigError as e:
            return str(e).replace("group=", "microbatch_group=", 1)
    if L.schedule == "naive" and m != 1:
        return "naive model parallelism runs the whole batch as one micro-batch"
    return None


def _uneven(layers: int, n: int) -> tuple[int, ...]:
    """An example split for the error message: the remainder on the middle chunks."""
    base, extra = divmod(layers, n)
    sizes = [base] * n
    for i in range(extra):
        sizes[(n - extra) // 2 + i] += 1
    return tuple(sizes)
