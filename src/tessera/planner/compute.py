"""Compute: the seconds and bytes of one transformer block and of each pipeline chunk, with
their tensor- and context-parallel communication, before any data parallelism.

Compute time of a chunk: each matrix multiply at ``peak · matmul_efficiency`` (in fp32 the
catalog GPUs' fp32 peak, ``Workload.compute_hardware``: PyTorch keeps TF32 off) plus a fixed
``matmul_tail_us`` (its shape dependence: :func:`gemm_times`, :func:`block_matmul_times`); a
term that differs by block belongs in :func:`block_costs` (an active model's MoE block: its
router's GEMM, its kernels, and only attention's tensor-parallel collectives where each tp rank
holds the block whole), which each chunk counts for its blocks of each kind; attention at the
attention rate (half the FLOPs when flash attention skips the causal mask's upper half);
memory-bound kernels move every stored activation byte ``Workload.elementwise_passes`` times
(2 with fused kernels: written by the kernel that makes it, read by the one that consumes it;
on a catalog GPU running tessera's own unfused block, the 12 measured on an H200,
``Hardware.eager_elementwise_passes``) in forward and twice as much in backward, at the memory
bandwidth; a fixed overhead per kernel (zero on GPUs in the catalog); and no stretch of
compute faster than the host issues its kernels (``Hardware.launch_us`` per kernel, counted
by :mod:`tessera.planner.kernels`: eager, or compiled with ``Workload.kernels`` 'compiled').

Bytes kept for backward: for a model tessera's transformer expresses, what tessera's block
saves (:func:`tessera.planner.engine.block_saved_bytes`: fp32 norm inputs, flash attention's
log-sum-exp); else the closed-form count (:func:`tessera.planner.formulas.layer_activation_bytes`).
The memory-traffic term keeps the closed-form count, the quantity ``calibrate`` fits
``elementwise_passes`` against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from tessera.planner import engine
from tessera.planner.comm import (
    allgather_time,
    allreduce_time,
    context_parallel_times,
    group_link,
    p2p_link,
)
from tessera.planner.formulas import layer_activation_bytes, layer_forward_flops
from tessera.planner.hardware import Hardware
from tessera.planner.kernels import (
    EMBEDDING,
    Hooks,
    block_kernels,
    head,
    hook_kernels_per_microbatch,
    launch_floor,
)
from tessera.planner.local.terms import rank_skew
from tessera.planner.models import ModelSpec
from tessera.planner.workload import Workload

OPS_PER_LAYER_FORWARD = 70
"""Top-level ATen ops in one block's forward: norms, projections, RoPE, attention, MLP, residuals
(tessera's reference block, counted with torch.profiler); backward runs about twice as many."""


def gemm_times(hw: Hardware, m: float, k: float, n: float) -> tuple[float, float]:
    """(forward, backward) seconds of Y = X·W with X (m, k), W (k, n): one GEMM of 2mkn FLOPs
    forward, two backward (dX = dY·Wᵀ, dW = Xᵀ·dY), each at Hardware.gemm_time."""
    one = hw.gemm_time(2 * m * k * n)
    return one, 2 * one


def block_gemm_shapes(spec: ModelSpec, t: int, column_only: bool = False
                      ) -> tuple[tuple[float, float], ...]:
    """(k, n) of each weight GEMM of one block on a tensor-parallel rank: QKV (k = h), the
    output projection (k = h/t), the MLP's input matrices (k = h) and its output matrix
    (k = f/t) (Shoeybi et al. 2019's column/row split); `column_only`: the column-parallel
    ones (QKV, the MLP's input matrices)."""
    h, f = spec.hidden, spec.ffn_hidden
    column = ((h, (h + 2 * spec.kv_dim) / t), *(((h, f / t),) * (spec.mlp_matrices - 1)))
    return column if column_only else (*column, (h / t, h), (f / t, h))


def block_matmul_times(spec: ModelSpec, hw: Hardware, tokens: int, t: int,
                       column_only: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one block's matrix multiplies on a tensor-parallel rank
    (:func:`block_gemm_shapes`, each with m = `tokens`)."""
    fwd = bwd = 0.0
    for k, n in block_gemm_shapes(spec, t, column_only):
        a, b = gemm_times(hw, tokens, k, n)
        fwd, bwd = fwd + a, bwd + b
    return fwd, bwd


@dataclass(frozen=True)
class BlockCosts:
    """One transformer block, one micro-batch, one rank: seconds and bytes."""

    forward: float
    backward: float
    """Backward compute without recomputation."""
    recompute: float
    tp_forward: float
    """Tensor-parallel communication of the forward, before any overlap."""
    tp_backward: float
    """Of the backward, with the recomputed forward's."""
    cp_forward: float
    """Context-parallel ring communication of the forward, exposed beyond attention."""
    cp_backward: float
    cp_total: float
    act_bytes: float
    """Kept for backward under the layout's recomputation."""
    work_bytes: float
    """Transient while the block's backward runs (its recomputed activations)."""


@lru_cache(maxsize=8192)
def block_costs(w: Workload, t: int, cp: int, b: int, sp: bool, recompute: str,
                cp_method: str = "ring", cp_ulysses: int = 2, moe: bool = False,
                hook_kernels: float = 0.0) -> BlockCosts:
    """Forward/backward seconds of one block and its activation bytes (module docstring);
    `cp_ulysses`: hybrid context parallelism's Ulysses degree; `moe`: one of an active model's
    MoE blocks (``ModelSpec.moe``), with its router's GEMM, its own kernel count
    (``kernels.eager_moe_block``) and, where each tp rank holds it whole, attention's
    tensor-parallel collectives only; `hook_kernels`: the data-parallel
    wrapper's kernels in the block's backward per micro-batch
    (``kernels.hook_kernels_per_microbatch``), under its launch floor with the block's own."""
    spec, hw = w.model, w.compute_hardware
    e = w.bytes[3]
    s = w.seq_len
    tp_link, cp_link = group_link(hw, t), p2p_link(hw, t * cp)
    _, attn = layer_forward_flops(spec, b, s, cp)
    mm_time, mm_back = block_matmul_times(spec, hw, b * (s // cp), t)
    whole_mlp = moe and spec.moe is not None and spec.moe.whole_tp > 1
    if whole_mlp:  # attention's QKV is the one column-parallel GEMM
        qkv = block_gemm_shapes(spec, t, column_only=True)[0]
        column_back = gemm_times(hw, b * (s // cp), *qkv)[1]
    else:
        column_back = block_matmul_times(spec, hw, b * (s // cp), t, column_only=True)[1]
    if moe and spec.moe is not None:
        # The router, replicated over tp: (tokens, h)·(h, E) on the rank's tokens (tessera
        # refuses sequence parallelism with MoE; other engines route the s/t slice under it).
        router = gemm_times(hw, b * (s // cp) / (t if sp else 1), spec.hidden, spec.moe.experts)
        mm_time, mm_back = mm_time + router[0], mm_back + router[1]
    attn_time = attn / t / hw.attention_flops * (0.5 if w.flash_attention else 1.0)
    full_bytes = layer_activation_bytes(spec, b, s, t, sp, "none", w.flash_attention, cp, e)
    score_bytes = full_bytes - layer_activation_bytes(spec, b, s, t, sp, "selective",
                                                      w.flash_attention, cp, e)
    mem_time = w.elementwise_passes * full_bytes / hw.memory_bw
    kernels = block_kernels(spec, w.precision, w.kernels, moe=moe and spec.moe is not None)
    # The forward's ops; backward about twice as many (MoE blocks too: op_overhead_us is
    # priced from this profiled count, not from the kernel count)
    if w.kernels == "tessera":
        ops_time = OPS_PER_LAYER_FORWARD * hw.op_overhead_us * 1e-6
        back_ops = 2 * ops_time
    else:
        ops_time = kernels.forward * hw.op_overhead_us * 1e-6
        back_ops = kernels.backward * hw.op_overhead_us * 1e-6
    fwd = max(mm_time + attn_time + mem_time + ops_time,
              launch_floor(hw.launch_us, kernels.forward))
    back = max(mm_back + 2 * (attn_time + mem_time) + back_ops,
               launch_floor(hw.launch_us, kernels.backward + hook_kernels))
    redo = {"none": 0.0,
            "selective": attn_time + w.elementwise_passes * score_bytes / hw.memory_bw,
            "full": fwd}[recompute]
    # Tensor parallel, per split sublayer (attention, and the MLP unless an MoE block is
    # whole on every tp rank: tessera.parallel.expert_parallel): 1 all-reduce forward, 1
    # backward (with sequence parallelism an all-gather plus a reduce-scatter each: the same
    # volume), 1 more for a recomputed forward. Sequence parallelism keeps only the s/t slice
    # of the sublayer's input for backward and all-gathers it again there (Korthikanti et al.
    # §4.2.2): 1 more all-gather.
    split = 1 if whole_mlp else 2
    act_tensor = e * b * (s // cp) * spec.hidden
    one = 2 * allgather_time(act_tensor, t, tp_link) if sp else allreduce_time(act_tensor, t,
                                                                               tp_link)
    regather = split * allgather_time(act_tensor, t, tp_link) if sp else 0.0
    tp_fwd = split * one
    tp_bwd = split * one + regather + (split * one if recompute == "full" else 0.0)
    if w.tp_async_backward and t > 1:
        # The row-parallel linears' gradient collectives stay blocking (half of each
        # sublayer's); the column-parallel ones' (the other half, and SP's regathers) hide
        # behind their GEMMs.
        async_part = split / 2 * one + regather
        tp_bwd -= async_part - max(0.0, async_part - column_back)
    # Each blocking collective (1 forward and 1 backward per split sublayer; SP: 2 and 2, the
    # regather overlaps) ends a stretch of compute, and waits for the slowest rank of the group.
    syncs = (2 if sp else 1) * split
    bwd = back + redo
    tp_fwd += syncs * rank_skew(w, t, fwd / syncs)
    tp_bwd += syncs * rank_skew(w, t, bwd / syncs)
    # Hybrid's Ulysses group: cp_ulysses consecutive cp ranks, t·cp_ulysses ranks apart at most.
    cp_fwd, cp_bwd, ring_fwd, ring_bwd = context_parallel_times(
        w, t, cp, b, cp_method, cp_link, cp_ulysses, p2p_link(hw, t * cp_ulysses))
    act = layer_activation_bytes(spec, b, s, t, sp, recompute, w.flash_attention, cp, e)
    work = full_bytes
    if w.tessera_engine and cp == 1:  # what tessera's block saves (engine module)
        act = engine.block_saved_bytes(spec, b, s, t, sp, recompute, e)
        work = engine.block_saved_bytes(spec, b, s, t, sp, "none", e)
    return BlockCosts(forward=fwd, backward=back, recompute=redo, tp_forward=tp_fwd,
                      tp_backward=tp_bwd,
                      cp_forward=cp_fwd - ring_fwd + max(0.0, ring_fwd - attn_time),
                      cp_backward=cp_bwd - ring_bwd + max(0.0, ring_bwd - 2 * attn_time),
                      cp_total=cp_fwd + cp_bwd,
                      act_bytes=act, work_bytes=work if recompute == "full" else 0.0)


@dataclass(slots=True)
class ChunkCosts:
    """Seconds per micro-batch on one chunk, split by cause, and its bytes."""

    forward_compute: float = 0.0
    backward_compute: float = 0.0
    """Includes recomputation."""
    recompute: float = 0.0
    """The part of backward_compute that repeats forward work."""
    tp_forward: float = 0.0
    """Exposed tensor-parallel communication (forward)."""
    tp_backward: float = 0.0
    """Exposed tensor-parallel communication (backward and recomputed forward)."""
    tp_hidden: float = 0.0
    cp_forward: float = 0.0
    """Exposed context-parallel ring communication."""
    cp_backward: float = 0.0
    cp_hidden: float = 0.0
    zero_forward: float = 0.0
    """ZeRO-3's parameter all-gather before each forward, the part not hidden by it."""
    zero_backward: float = 0.0
    """ZeRO-2/3's per-micro-batch gradient reduce-scatter (ZeRO-3: and parameter all-gather)
    during each backward, the part not hidden by it."""
    params: float = 0.0
    """Parameters held per tensor-parallel rank."""
    tensors: int = 0
    act_bytes: float = 0.0
    """Activation bytes kept per micro-batch in flight."""
    work_bytes: float = 0.0
    """Transient bytes while this chunk runs (a recomputed block's full activations)."""
    dp_total: float = 0.0
    """Seconds of this chunk's gradient reduction (ZeRO-3: with its parameter all-gathers)."""
    dp_reduce: float = 0.0
    """The part of dp_total left after the chunk's last backward (what the simulator sees;
    pipelined ZeRO-3: the reduce-scatter at the chunk's REDUCE_GRAD action)."""
    unshard: float = 0.0
    """Pipelined ZeRO-3: seconds of one all-gather of the chunk's parameters (its UNSHARD
    action in ``schedule.add_sharding_actions``; the simulator places and overlaps them)."""
    dp_cpu: float = 0.0
    """Seconds a step of the chunk's data-parallel time (dp_reduce; ZeRO-3: its zero_forward
    and zero_backward, every micro-batch) that are work on the rank's own thread while every
    other rank of the group does the same work (tessera DDP's gradient hooks during the
    backward, and its division of the buckets once the all-reduce releases every rank;
    tessera ZeRO-3's work around each unit's collectives): ranks that time-share cores
    stretch it like compute (``shared_cpu_bound``)."""

    p2p_exchange: float = 0.0
    """Seconds the rank blocks on a pipeline exchange after each forward and each backward
    (``Workload.p2p_blocking``; 0 where transfers are in flight beside compute)."""

    @property
    def forward(self) -> float:
        return (self.forward_compute + self.tp_forward + self.cp_forward + self.zero_forward
                + self.p2p_exchange)

    @property
    def backward(self) -> float:
        return (self.backward_compute + self.tp_backward + self.cp_backward + self.zero_backward
                + self.p2p_exchange)


class ChunkList(list):
    """The chunks of one layout as ``cost.chunk_costs`` builds them, knowing whether every chunk but
    the first and the last is one shared object (asked once per estimate: a search asks it of
    ~18,000 layouts, so it is settled when the list is built)."""

    uniform_middle: bool = False


def layer_tensors(spec: ModelSpec) -> int:
    matrices = 4 + spec.mlp_matrices
    return matrices * (2 if spec.bias else 1) + 2 * (2 if spec.norm == "layernorm" else 1)


def hidden_state_bytes(w: Workload, b: int, cp: int) -> float:
    """Bytes of one micro-batch's hidden states on a context-parallel rank: what crosses a
    pipeline boundary, and what a tensor-parallel embedding reduces."""
    return w.bytes[3] * b * (w.seq_len // cp) * w.model.hidden


@lru_cache(maxsize=65536)
def compute_chunks(w: Workload, t: int, cp: int, pp: int, v: int, b: int, recompute: str,
                    sp: bool, cp_method: str, sizes: tuple[int, ...],
                    head_apart: bool, cp_ulysses: int = 2, hooks: Hooks | None = None
                    ) -> ChunkList:
    """Per-chunk compute, tensor- and context-parallel costs and bytes, before any data
    parallelism (cached: the layouts that differ only in their ZeRO stage or data-parallel
    mode share them; :func:`tessera.planner.cost.chunk_costs` adds those to copies, these stay
    read-only). `head_apart`: the last chunk runs on another rank than chunk 0
    (``pipeline.head_apart``), so a tied head holds a copy of the embedding. `hooks`: the
    data-parallel wrapper whose backward kernels each unit's backward launches (tessera's)
    (``kernels.Hooks``), or None."""
    spec, hw = w.model, w.compute_hardware
    e = w.bytes[3]
    s = w.seq_len
    n_chunks = pp * v
    tessera = w.tessera_engine and cp == 1
    def hooked(units: list[tuple[int, int]]) -> float:
        return hook_kernels_per_microbatch(units, hooks) if hooks is not None else 0.0

    block_hooks = hooked([(engine.block_numel(spec, t), layer_tensors(spec))])
    blk = block_costs(w, t, cp, b, sp, recompute, cp_method, cp_ulysses, hook_kernels=block_hooks)
    # An active model's MoE blocks (ModelSpec.moe) differ in their router and tp collectives.
    moe_blk = (block_costs(w, t, cp, b, sp, recompute, cp_method, cp_ulysses, moe=True,
                           hook_kernels=block_hooks)
               if spec.moe is not None else blk)
    keep = 1.0 - w.tp_overlap

    def blocks_only(nl: int, n_moe: int) -> ChunkCosts:
        """`nl` blocks of which `n_moe` are MoE blocks."""
        def total(cost: Callable[[BlockCosts], float]) -> float:
            return (nl - n_moe) * cost(blk) + n_moe * cost(moe_blk)

        return ChunkCosts(
            forward_compute=total(lambda k: k.forward), recompute=total(lambda k: k.recompute),
            backward_compute=total(lambda k: k.backward + k.recompute),
            tp_forward=total(lambda k: k.tp_forward) * keep,
            tp_backward=total(lambda k: k.tp_backward) * keep,
            tp_hidden=total(lambda k: k.tp_forward + k.tp_backward) * w.tp_overlap,
            cp_forward=total(lambda k: k.cp_forward), cp_backward=total(lambda k: k.cp_backward),
            cp_hidden=total(lambda k: k.cp_total - k.cp_forward - k.cp_backward),
            params=nl * spec.layer_params / t, tensors=nl * layer_tensors(spec),
            act_bytes=total(lambda k: k.act_bytes),
            work_bytes=max(blk.work_bytes, moe_blk.work_bytes))

    # Embedding on chunk 0 (a gather: memory-bound) and final norm, LM head and fp32 logits
    # for the loss on the last chunk (Korthikanti et al. §4.3).
    tokens = b * (s // cp)
    split = t if sp else 1
    tp_link = group_link(hw, t)
    act = hidden_state_bytes(w, b, cp)
    logits_bytes = 4 * tokens * spec.vocab_size / t
    # train.loss_chunk_tokens: one chunk's fp32 logits at a time, the head's GEMM again in
    # backward (tessera.parallel.chunked_loss)
    chunked = 0 < w.loss_chunk_tokens < tokens
    held_logits = 4 * w.loss_chunk_tokens * spec.vocab_size / t if chunked else logits_bytes
    launch_us, compiled = hw.launch_us, w.kernels != "tessera"

    def add_embedding(ch: ChunkCosts, hook_kernels: float) -> None:
        embed_mem = w.elementwise_passes * act / hw.memory_bw
        ch.forward_compute += max(embed_mem, launch_floor(launch_us, EMBEDDING.forward))
        ch.backward_compute += max(2 * embed_mem,
                                   launch_floor(launch_us, EMBEDDING.backward + hook_kernels))
        ch.params += spec.embedding_params / t
        ch.tensors += 2 if spec.learned_positions else 1
        ch.act_bytes += (tokens * spec.hidden if spec.dropout else 0) / split
        if t > 1:
            # Vocabulary-parallel embedding: each rank looks up its rows, an all-reduce (with
            # SP a reduce-scatter) sums them (Shoeybi et al. 2019 §3).
            comm = allgather_time(act, t, tp_link) if sp else allreduce_time(act, t, tp_link)
            ch.tp_forward += comm * keep
            ch.tp_hidden += comm * w.tp_overlap

    def add_head(ch: ChunkCosts, hook_kernels: float) -> None:
        head_f, head_b = gemm_times(hw, tokens, spec.hidden, spec.vocab_size / t)
        memory = w.elementwise_passes * logits_bytes / hw.memory_bw
        kernels = head(spec, w.precision, compiled)
        ch.forward_compute += max(head_f + memory, launch_floor(launch_us, kernels.forward))
        ch.backward_compute += max(head_b + (head_f if chunked else 0.0) + 2 * memory,
                                   launch_floor(launch_us, kernels.backward + hook_kernels))
        if t > 1:  # the loss over split logits all-reduces the b·s row maxima, then the sums
            # of exponentials with the target logits (Shoeybi et al. 2019 §3)
            ch.tp_forward += allreduce_time(4 * tokens, t, tp_link) + allreduce_time(
                8 * tokens, t, tp_link)
        # A tied head on another rank than the embedding keeps its own copy of the matrix.
        tied_copy = spec.tied_embeddings and head_apart
        ch.params += (spec.head_params + (spec.vocab_size * spec.hidden if tied_copy else 0)) / t
        ch.tensors += 2
        ch.act_bytes += held_logits + 2 * act / split

    shared: dict[tuple[int, int], ChunkCosts] = {}  # by (blocks, MoE blocks)
    chunks = ChunkList()
    start = 0  # the chunk's first block
    for c, nl in enumerate(sizes):
        first, last = c == 0, c == n_chunks - 1
        n_moe = spec.moe.count(start, nl) if spec.moe is not None else 0
        start += nl
        if not (first or last):
            if (nl, n_moe) not in shared:
                shared[nl, n_moe] = blocks_only(nl, n_moe)
            chunks.append(shared[nl, n_moe])
            continue
        ch = blocks_only(nl, n_moe)
        blocks_act = ch.act_bytes
        # tessera's units: embedding (chunk 0), the blocks, head (last chunk)
        units = engine.chunk_units(spec, t, n_chunks, c, nl, head_apart) if tessera else []
        if first:
            add_embedding(ch, hooked(units[:1]) if units else 0.0)
        if last:
            add_head(ch, hooked(units[-1:]) if units else 0.0)
        if tessera:  # tessera's exact parameters and saved tensors (engine module)
            ch.params = sum(n for n, _ in units)
            ch.tensors = sum(k for _, k in units)
            ch.act_bytes = blocks_act + engine.chunk_saved_bytes(
                spec, b, s, t, sp, e, first=first, last=last,
                loss_chunk=w.loss_chunk_tokens if chunked else 0)
        chunks.append(ch)
    if tessera:
        for (nl, _), ch in shared.items():
            ch.params = nl * engine.block_numel(spec, t)
    # The middle chunks are shared[nl, n_moe] objects: one object iff one middle kind.
    chunks.uniform_middle = len(shared) <= 1
    return chunks
