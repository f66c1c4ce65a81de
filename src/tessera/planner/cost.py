"""The cost model: FLOPs, memory and communication of one parallel layout, every formula cited.

Notation: B global batch (sequences), b micro-batch size, s sequence length, l layers, h hidden
size, a heads, V vocabulary, t tensor-parallel, p pipeline-parallel, d data-parallel, c
context-parallel degree, v virtual stages per pipeline rank, m micro-batches per step per
pipeline (m = B / (d·b)), P parameters, e bytes per activation element (2 in bf16).

FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", §5.1):

- model FLOPs per iteration, eq. (3) without recomputation:
  ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` = 3 × (forward 24Bslh² + 4Bs²lh + 2BshV).
  Generalized here to GQA and SwiGLU by counting the forward matrix multiplies, 2 FLOPs per
  multiply-add: ``2·B·s·N_mm + 4·B·s²·l·h`` with N_mm = l·(h(h + 2·kv) + h² + k·h·f) + V·h
  (k = 2 GeLU matrices or 3 SwiGLU matrices, kv the key/value width), times 3 for forward and
  backward (PaLM, Chowdhery et al. 2022, App. B: 6·N + 12·l·h·s per token);
- hardware FLOPs add recomputation. Full recomputation repeats every block's forward, giving
  eq. (3)'s ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``; selective recomputation (Korthikanti et
  al. 2022) repeats only attention's ``4·B·s²·l·h``.
- MFU = model FLOP/s over peak; HFU = hardware FLOP/s over peak (Chowdhery et al. 2022).
- parameters, eq. (2): ``P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))``; the exact count of a
  ModelSpec is in :mod:`tessera.planner.models`.
- time to train on T tokens, §5.1: ``8·T·P / (n·X)`` for n GPUs at X FLOP/s each (full
  recomputation: 8 = 2·(forward + recompute + 2·backward) FLOPs per parameter per token).

Memory (bytes per rank):

- model state (Rajbhandari et al. 2020, "ZeRO", §3.1 and §5): mixed-precision Adam keeps
  2Ψ parameters + 2Ψ gradients + KΨ optimizer state (K = 12: fp32 master weights, momentum,
  variance); ZeRO-1 divides the K term by N_d, ZeRO-2 also the gradients, ZeRO-3 everything:
  ``(2 + 2 + K)Ψ``, ``4Ψ + KΨ/N_d``, ``2Ψ + (2 + K)Ψ/N_d``, ``(2 + 2 + K)Ψ/N_d``;
- activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Table 2), in bytes with e = 2: no parallelism ``sbh(34 + 5as/h)``,
  tensor parallel ``sbh(10 + 24/t + 5as/(ht))``, with sequence parallel ``sbh/t·(34 + 5as/h)``,
  selective recomputation drops the ``5as/h`` term, full recomputation keeps ``2sbh`` (the
  block's input). :func:`layer_activation_bytes` rebuilds these from the tensors each block
  stores, so GQA, SwiGLU, no dropout and flash attention (no s² tensors) follow from the
  same count; context parallelism divides s by c except the s² term, which is ``a·(s/c)·s``;
- a stage holds the activations of as many (micro-batch, chunk) pairs as the schedule keeps in
  flight on it, which the pipeline simulator reports (1F1B: at most p; GPipe: m; interleaving
  holds more on the first rank); the first stage also holds the embedding, the last the final
  norm, the LM head and fp32 logits ``4·s·b·V/t`` (Korthikanti et al. §4.3).
- for a model tessera's own transformer expresses, the layout rules, the pipeline split and
  both byte counts are tessera's (:mod:`tessera.planner.engine`): model state as
  ``tessera.parallelize`` allocates it (ZeRO units padded to dp, vocabulary padded to t,
  replicated norms and kv heads, a tied copy on the last stage, DDP's and AdamW's per-tensor
  extras) and activations as tessera's block saves them (fp32 norm inputs, flash attention's
  log-sum-exp). The compute-time model's memory-traffic term keeps the count above, the
  quantity ``calibrate`` fits ``elementwise_passes`` against.

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
- data parallelism: one all-reduce of the gradients per step (Li et al. 2020, PyTorch DDP),
  bucketed so that each chunk's reduction can overlap the remaining backward; ZeRO-1/2 replace
  it by a reduce-scatter and an all-gather of the same volume, ZeRO-3 adds a second
  all-gather of the parameters: 1.5× the volume (Rajbhandari et al. §7). Priced per unit
  (bucket, block) on the link the group crosses, and exposed only where compute cannot cover
  it (:func:`exposed_behind`; a second of compute hides ``hardware.dp_overlap`` seconds of
  a collective: 1 on GPUs, 0.5 on CPU ranks whose gloo thread shares a core with the
  compute, 0 where ranks time-share cores); breadth-first ZeRO-3 is placed by the schedule's
  sharding actions and simulated (:func:`zero3_by_actions`); tessera's own work around them (DDP's
  gradient hooks and division, :func:`ddp_bucket_time`; ZeRO-3's per-unit buffers and views,
  ``hardware.zero_unit_us`` and ``zero_unit_passes``, which on a calibrated CPU also hold
  what the collectives' thread takes from the compute's core) is exposed beside them;
- context parallelism (``tessera.parallel.context_parallel``, the bytes of its
  ``bytes_per_layer``): ring attention (Liu et al. 2023) passes a K/V block of b·(s/c)·kv in
  each of c−1 steps forward, and K/V (c−1 steps) plus the dK/dV accumulators (c steps)
  backward, overlapped with the attention compute of the step; all-gather (Llama 3), Ulysses
  all-to-alls and the hybrid are priced by their volumes, not overlapped;
- stragglers: ranks reach a collective after a stretch of compute whose time varies, and the
  collective waits for the slowest; for N ranks with independent normal noise the wait
  beyond a typical rank is the expected maximum of N standard normals (Blom's approximation,
  ``Φ⁻¹((N − 0.375)/(N + 0.25))``) times σ, with σ = a + jitter·√T + r·T for T seconds of
  compute (a fixed part, noise adding up, and ranks running at different speeds for the
  whole stretch; zero on GPUs; a shared CPU measures a ≈ 1-3 ms and r ≈ 3-6%). Counted at
  every blocking tensor-parallel collective and at each data-parallel reduction;
- the step: the pipeline simulator (``tessera.pipeline.simulator``) runs the chosen schedule
  with per-chunk forward/backward times (compute + exposed TP and CP communication), the
  point-to-point costs and each chunk's data-parallel reduction, and returns step time,
  bubble and exposed DP time; the optimizer step (memory-bound) is added after.

Compute time of a chunk: each matrix multiply at ``peak · matmul_efficiency`` (in fp32 the
catalog GPUs' fp32 peak, ``Workload.compute_hardware``: PyTorch keeps TF32 off) plus a fixed
``matmul_tail_us`` (its shape dependence: :func:`gemm_times`, :func:`block_matmul_times`); an
extra per-layer term (e.g. a mixture-of-experts layer's) belongs in :func:`block_costs`,
which every chunk multiplies by its blocks; attention at the
attention rate (half the FLOPs when flash attention skips the causal mask's upper half);
memory-bound kernels move every stored activation byte ``Workload.elementwise_passes`` times
(2 with fused kernels: written by the kernel that makes it, read by the one that consumes it;
on a catalog GPU running tessera's own unfused block, the 12 measured on an H200,
``Hardware.eager_elementwise_passes``) in forward and twice as much in backward, at the memory
bandwidth; a fixed overhead per kernel (zero on GPUs in the catalog).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from statistics import NormalDist

from tessera.config import DP_MODES, Config, ConfigError
from tessera.planner import engine
from tessera.planner.hardware import Hardware, Link, ranks_time_share
from tessera.planner.models import ModelSpec, from_model_config

OPS_PER_LAYER_FORWARD = 70
"""Top-level ATen ops in one block's forward: norms, projections, RoPE, attention, MLP, residuals
(tessera's reference block, counted with torch.profiler); backward runs about twice as many."""
OPS_PER_TENSOR_ADAMW = 12
"""Kernels per parameter tensor in one single-tensor (foreach=False) AdamW update."""
TESSERA_NORM_BYTES_CPU = 16
"""Bytes per gradient element that tessera's gradient norm (``optim.add_sums_of_squares``: one
``torch._foreach_norm`` in fp64) moves besides reading the gradient, on CPU ranks: torch's CPU
kernel casts each piece to an fp64 copy first (write 8) and sums the copy (read 8); timed
here, a 16M-element fp32 norm in fp64 costs a cast copy plus an fp64 sum. On a GPU the batched
kernel reads each gradient once and accumulates in fp64 registers: nothing more, as a fused
multi-tensor norm (Megatron-LM)."""

PRECISIONS = {
    # name: (parameter, gradient, optimizer-state bytes per parameter; activation bytes)
    "bf16": (2, 2, 12, 2),  # mixed precision: fp32 master weights, momentum, variance (16 B;
    # Rajbhandari et al. 2020 §3.1)
    "bf16-fp32grads": (2, 4, 12, 2),  # as above with fp32 gradient accumulation (18 B:
    # Megatron-LM's default, --accumulate-allreduce-grads-in-fp32)
    "bf16-states": (2, 2, 8, 2),  # fp32 master weights, bf16 momentum and variance (12 B)
    "fp32": (4, 4, 8, 4),  # everything fp32: Adam momentum and variance only
}
TESSERA_PRECISIONS = ("bf16", "fp32")
"""The recipes tessera's runtime implements (``train.precision``); the others are planned with
the closed forms."""
KERNELS = ("tessera", "fused")
"""Whose activation bytes a tessera-expressible model is planned with: tessera's reference
block ('tessera': fp32 norm copies, unfused SwiGLU) or fused kernels as in Megatron-LM and
Llama 3's training ('fused': Korthikanti et al. 2022's tensor count)."""
FLOP_CONVENTIONS = ("causal", "full")
"""How the attention score FLOPs are counted: 'full' s² per sequence, as Megatron-LM (Narayanan
et al. 2021, eq. 3) and the PaLM appendix count; 'causal' half of it, the products a causal
mask leaves, as Llama 3 (Grattafiori et al. 2024, Table 4) and most MFU reports count."""
RECOMPUTE = ("none", "selective", "full")
GB = 1e9


# ---------------------------------------------------------------------------------------------
# Closed forms from the papers (used by the tests and by --explain)


def megatron_params(l: int, h: int, V: int, s: int) -> float:  # noqa: E741
    """Narayanan et al. 2021, eq. (2): P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def megatron_model_flops(B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """Model FLOPs per iteration: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_hardware_flops(B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """Narayanan et al. 2021, eq. (3), full recomputation: 96·B·s·l·h²·(1 + s/(6h) + V/(16lh))."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Narayanan et al. 2021 §5.1: end-to-end training time ≈ 8·T·P / (n·X), in days."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86400


def zero_model_state_bytes(params: float, zero_stage: int, n_d: int, k: int = 12,
                           param_bytes: int = 2, grad_bytes: int = 2) -> float:
    """Rajbhandari et al. 2020 §5, Figure 1: bytes of model state per data-parallel rank."""
    p = param_bytes * params / (n_d if zero_stage >= 3 else 1)
    g = grad_bytes * params / (n_d if zero_stage >= 2 else 1)
    o = k * params / (n_d if zero_stage >= 1 else 1)
    return p + g + o


def zero_max_params(memory_bytes: float, zero_stage: int, n_d: int, k: int = 12) -> float:
    """Largest Ψ whose model state fits `memory_bytes` per rank (inverse of the above)."""
    return memory_bytes / zero_model_state_bytes(1.0, zero_stage, n_d, k)


# ---------------------------------------------------------------------------------------------
# The problem and a layout


@dataclass(frozen=True, kw_only=True, eq=True)
class Workload:
    """What to train on what: the fixed part of a planning problem."""

    model: ModelSpec
    hardware: Hardware
    gpus: int
    global_batch: int
    """Sequences per optimizer step (B)."""
    seq_len: int
    precision: str = "bf16"
    """'bf16' (mixed precision, 2+2+12 bytes of model state per parameter) or 'fp32'."""
    flash_attention: bool = True
    """Attention never stores the s×s scores (FlashAttention, Dao et al. 2022)."""
    scatter_gather: bool = True
    """Pipeline sends b·s·h/t per tensor-parallel rank (Narayanan et al. 2021 §4.1)."""
    tp_overlap: float = 0.0
    """Fraction of tensor-parallel communication hidden behind compute (0: Megatron 2021)."""
    tp_async_backward: bool = False
    """Megatron-LM from 2022 on (Korthikanti et al. 2022 §4.2.2; Megatron's
    LinearWithGradAccumulationAndAsyncCommunication): in the backward of a column-parallel
    linear the input's all-gather (sequence parallel) runs during the input-gradient GEMM and
    the input gradient's reduce-scatter (or all-reduce) during the weight-gradient GEMM.
    tessera's runtime and Megatron-LM 2021 (Narayanan et al.) wait for each."""
    reserve_gb: float = 0.0
    """Memory per device kept free for the framework (context, workspace, fragmentation)."""
    bucket_mb: float = 25.0
    """Gradient bucket of the data-parallel reduction in MiB (PyTorch DDP's default)."""
    kernels: str = "tessera"
    """See KERNELS: only changes tessera-expressible models (their activation bytes, split
    and layout rules become the catalog's closed forms when 'fused')."""
    zero_prefetch: int = 1
    """ZeRO-3 units gathered ahead of the one computing (FSDP's and tessera's one-ahead
    prefetch); 0 gathers each unit only when it is needed."""

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "seq_len"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"--{name.replace('_', '-')}", value,
                                  "must be a positive integer")
        if self.precision not in PRECISIONS:
            raise ConfigError("--precision", self.precision,
                              f"must be one of {', '.join(PRECISIONS)}")
        if not 0.0 <= self.tp_overlap <= 1.0:
            raise ConfigError("tp_overlap", self.tp_overlap, "must be in [0, 1]")
        if self.kernels not in KERNELS:
            raise ConfigError("--kernels", self.kernels, f"must be one of {', '.join(KERNELS)}")
        if not (isinstance(self.zero_prefetch, int) and self.zero_prefetch >= 0):
            raise ConfigError("zero_prefetch", self.zero_prefetch, "must be an integer >= 0")

    def __hash__(self) -> int:  # hashed on every cached block-cost lookup: compute it once
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    @classmethod
    def from_config(cls, cfg: Config, hardware: Hardware, name: str = "config",
                    **kw) -> Workload:
        """What a tessera run of `cfg` trains: its model, world size, global batch (dp ·
        micro_batch_size · grad_accum sequences of data.seq_len tokens) and precision. tessera's
        pipeline sends whole activations between stages (no scatter/gather)."""
        p, t = cfg.parallel, cfg.train
        kw.setdefault("scatter_gather", False)
        return cls(model=from_model_config(name, cfg.model, cfg.data.seq_len), hardware=hardware,
                   gpus=p.world_size, global_batch=p.dp * t.micro_batch_size * t.grad_accum,
                   seq_len=cfg.data.seq_len, precision=t.precision, **kw)

    @property
    def bytes(self) -> tuple[int, int, int, int]:
        """(parameter, gradient, optimizer-state, activation) bytes per element."""
        return PRECISIONS[self.precision]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @cached_property
    def tessera_engine(self) -> bool:
        """Plan with tessera's own rules, split and byte counts (engine module): a model its
        transformer expresses, in a precision it runs, with its own kernels."""
        return (engine.expressible(self.model) and self.kernels == "tessera"
                and self.precision in TESSERA_PRECISIONS)

    @cached_property
    def compute_hardware(self) -> Hardware:
        """The hardware as this workload's precision computes on it
        (:meth:`Hardware.for_precision`: fp32 GEMMs at the fp32 peak)."""
        return self.hardware.for_precision(self.precision)

    @cached_property
    def elementwise_passes(self) -> float:
        """Passes of the memory-bound kernels over the activation bytes: tessera's unfused
        block's where its engine runs the model and the hardware says
        (``Hardware.eager_elementwise_passes``), else the hardware's."""
        eager = self.hardware.eager_elementwise_passes
        return eager if eager is not None and self.tessera_engine else (
            self.hardware.elementwise_passes)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to split the work: degrees, micro-batching, ZeRO, recomputation, schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    virtual: int = 1
    """Model chunks per pipeline rank (interleaved and breadth-first schedules)."""
    microbatch_group: int = 0
    """Interleaved: micro-batches per chunk visit (Megatron-LM's
    microbatch_group_size_per_vp_stage, Llama 3's N); 0: pp."""
    micro_batch: int = 1
    """Sequences per micro-batch (b)."""
    zero: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    dp_mode: str = "allreduce"
    """How replicas agree: 'allreduce' (DDP or ZeRO), or a parameter server ('ps' synchronous,
    'ps-async' with bounded staleness; tessera.parallel.parameter_server)."""
    cp_method: str = "ring"
    """Context-parallel attention (tessera.parallel.context_parallel): ring, allgather,
    ulysses or hybrid (Ulysses over 2 ranks, ring across)."""
    stage_layout: tuple[int, ...] | None = None
    """Blocks in each of the pp·v chunks (uneven stages, e.g. Llama 3's 7, 8 x 14, 7); None:
    tessera's cost-balanced split for tessera models, l/(p·v) each for the others."""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def microbatches(self, global_batch: int) -> int:
        """m: micro-batches per step per pipeline."""
        return global_batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        text = f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}"
        if self.pp > 1 or self.virtual > 1:
            text += f" {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "")
            text += f" g={self.microbatch_group}" if self.microbatch_group else ""
        text += f" b={self.micro_batch} zero={self.zero} recompute={self.recompute}"
        if self.sequence_parallel:
            text += " sp"
        if self.dp_mode != "allreduce":
            text += f" {self.dp_mode}"
        if self.cp > 1 and self.cp_method != "ring":
            text += f" cp_method={self.cp_method}"
        if self.stage_layout:
            text += f" stages={stage_layout_text(self.stage_layout)}"
        return text

    def key(self) -> tuple:
        return (self.dp, self.tp, self.pp, self.cp, self.virtual, self.micro_batch, self.zero,
                self.recompute, self.schedule, self.sequence_parallel, self.dp_mode,
                self.cp_method, self.stage_layout, self.microbatch_group)

    def key_without_schedule(self) -> tuple:
        """:meth:`key` less the schedule, which orders the chunks but does not change their
        costs (the search prices such layouts once; a plain tuple, since ``replace`` on a
        frozen dataclass costs ~20 µs and the search asks for ~20,000 keys)."""
        return (self.dp, self.tp, self.pp, self.cp, self.virtual, self.micro_batch, self.zero,
                self.recompute, self.sequence_parallel, self.dp_mode, self.cp_method,
                self.stage_layout, self.microbatch_group)


def stage_layout_text(sizes: tuple[int, ...]) -> str:
    """(7, 8, ..., 8, 7) -> '7,8*14,7' (parallel.stage_layout's form)."""
    parts: list[str] = []
    i = 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        parts.append(f"{sizes[i]}*{j - i}" if j - i > 1 else str(sizes[i]))
        i = j
    return ",".join(parts)


def chunk_sizes(w: Workload, L: Layout) -> tuple[int, ...]:
    """Blocks per chunk: the layout's own stage layout, tessera's split, or l/(p·v) each."""
    if L.stage_layout:
        return L.stage_layout
    n = L.pp * L.virtual
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
    n_chunks = L.pp * L.virtual
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
    if L.zero not in (0, 1, 2, 3):
        return f"zero={L.zero} must be 0, 1, 2 or 3"
    if L.dp_mode not in DP_MODES:
        return f"dp_mode={L.dp_mode!r} must be one of {', '.join(DP_MODES)}"
    if L.dp_mode != "allreduce" and (L.tp, L.pp, L.cp, L.zero, w.precision, L.dp < 2) != (
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

        u = L.cp if L.cp_method == "ulysses" else 2
        try:
            if L.cp % u:
                raise ValueError(f"hybrid: the Ulysses degree 2 must divide cp={L.cp}")
            ulysses_kv_repeat(spec.heads // L.tp, max(spec.kv_heads // L.tp, 1), u)
        except ValueError as e:
            return str(e)
    if n_chunks > spec.layers:
        return f"pp*virtual={n_chunks} chunks exceed layers={spec.layers}"
    if L.stage_layout is None and spec.layers % n_chunks:
        example = stage_layout_text(_uneven(spec.layers, n_chunks))
        return (f"pp*virtual={n_chunks} must divide layers={spec.layers}, or give the blocks "
                f"per chunk (stage_layout, e.g. {example})")
    if L.pp == 1 and (L.virtual != 1 or L.schedule != "1f1b"):
        return "without pipeline parallelism the schedule is 1f1b with virtual=1"
    from tessera.pipeline.schedules import SCHEDULES, check_schedule

    if L.virtual > 1 and not SCHEDULES[L.schedule].virtual:
        return (f"virtual={L.virtual} needs schedule "
                f"{', '.join(n for n, s in SCHEDULES.items() if s.virtual)}")
    m = L.microbatches(w.global_batch)
    if L.pp > 1 or L.virtual > 1:  # the schedule's own rules (m, micro-batch groups)
        try:
            check_schedule(L.schedule, L.pp, m, L.virtual, L.microbatch_group)
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


# ---------------------------------------------------------------------------------------------
# Per-layer quantities


def layer_activation_bytes(spec: ModelSpec, b: int, s: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", flash: bool = False, cp: int = 1,
                           e: int = 2) -> float:
    """Bytes one block keeps for its backward, per rank (Korthikanti et al. 2022, §4).

    Counted tensor by tensor as in the paper's derivation; with GPT's shapes (MHA, 4h GeLU,
    dropout) and e = 2 this is exactly Table 2. Replicated across tensor-parallel ranks unless
    sequence parallel: the two norm inputs, the inputs of the QKV and first MLP projections
    and the two residual dropout masks. Split over t: Q and K (inputs of QKᵀ), V, the attention
    output, the MLP's inner activations, and the s×s score tensors unless flash attention or
    selective recomputation avoids keeping them.
    """
    h, f = spec.hidden, spec.ffn_hidden
    sl = s // cp  # this rank's tokens
    tokens = sl * b
    mask = 1 if spec.dropout else 0
    if recompute == "full":
        return e * tokens * h / (t if sp else 1)
    replicated = tokens * (2 * e * h + 2 * e * h + 2 * mask * h)  # norms, proj inputs, masks
    qk = e * tokens * (h + spec.kv_dim)
    v = e * tokens * spec.kv_dim
    attn_out = e * tokens * h
    inner = (3 if spec.mlp == "swiglu" else 2) * e * tokens * f
    scores = 0.0
    if not flash and recompute != "selective":
        # softmax output, and with dropout its mask and output: 2 + 1 + 2 bytes per score
        per_score = e + (mask + e) * mask
        scores = per_score * spec.heads * sl * s * b
    split = qk + v + attn_out + inner + scores
    return replicated / (t if sp else 1) + split / t


def layer_forward_flops(spec: ModelSpec, b: int, s: int, cp: int = 1) -> tuple[float, float]:
    """(matmul, attention-core) forward FLOPs of one block on b sequences of this rank's s/c
    tokens, before tensor-parallel splitting: 2·tokens·N_mm_layer and 4·b·(s/c)·s·h."""
    sl = s // cp
    return 2 * b * sl * spec.layer_matmul_params, 4 * b * sl * s * spec.hidden


def model_flops_per_step(spec: ModelSpec, B: int, s: int, convention: str = "full") -> float:
    """Model FLOPs per iteration: 3·(2·B·s·N_mm + 4·B·s²·l·h), N_mm with the LM head; the
    causal convention (FLOP_CONVENTIONS) counts half the score products, 2·B·s²·l·h."""
    mm = spec.layers * spec.layer_matmul_params + spec.vocab_size * spec.hidden
    attn = 4 * B * s * s * spec.layers * spec.hidden * _attention_share(convention)
    return 3 * (2 * B * s * mm + attn)


def _attention_share(convention: str) -> float:
    if convention not in FLOP_CONVENTIONS:
        raise ConfigError("flops", convention, f"must be one of {', '.join(FLOP_CONVENTIONS)}")
    return 0.5 if convention == "causal" else 1.0


def hardware_flops_per_step(spec: ModelSpec, B: int, s: int, recompute: str,
                            convention: str = "full") -> float:
    """Model FLOPs plus what recomputation repeats (eq. 3's 96 for full recomputation)."""
    mm_layer, attn = layer_forward_flops(spec, B, s)
    attn *= _attention_share(convention)
    extra = {"none": 0.0, "selective": attn, "full": mm_layer + attn}[recompute]
    return model_flops_per_step(spec, B, s, convention) + spec.layers * extra


# ---------------------------------------------------------------------------------------------
# Collectives, α–β


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


def time_shared(w: Workload) -> bool:
    """More ranks on a machine than CPU cores (``hardware.cores``): they take turns on them."""
    return ranks_time_share(w.hardware.cores, min(w.gpus, w.hardware.gpus_per_node))


def rank_skew(w: Workload, n: int, busy: float) -> float:
    """The wait for the slowest of `n` ranks at a collective (:func:`straggler_time`), except
    where ranks time-share cores: there a rank that arrives early leaves its core to the late
    ones, so the skew costs nothing beyond :func:`shared_cpu_bound`'s count of all the work
    and the cores it leaves idle, which a calibration at that rank count holds in its
    collectives' times (``calibrate.timed_collective``)."""
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
    """σ of `busy` seconds of compute on one rank (``Hardware.jitter`` and the two terms
    beside it)."""
    return hw.jitter_fixed_us * 1e-6 + hw.jitter * busy ** 0.5 + hw.jitter_rate * busy


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
    if hw.p2p_alpha_us is not None or hw.p2p_gbs is not None:
        link = Link(alpha=link.alpha if hw.p2p_alpha_us is None else hw.p2p_alpha_us * 1e-6,
                    bandwidth=link.bandwidth if hw.p2p_gbs is None else hw.p2p_gbs * 1e9)
    return link


# ---------------------------------------------------------------------------------------------
# Per-chunk costs of one layout


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


def shared_cpu_bound(w: Workload, L: Layout, chunks: list[ChunkCosts],
                     optimizer_time: float, exposed_dp: float = 0.0,
                     sync_time: float = 0.0) -> float:
    """Ranks that share CPU cores (``hardware.cores``) cannot finish a step before the cores
    have done all their work: ranks per machine · (a pipeline's work / p) / cores. A rank
    waiting in a bubble or on a message leaves its core to another rank, so this bound, not
    a uniform slow-down, is what oversubscription adds (0 on GPUs).

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
    compute. Measured here (dp_cost.py, the bench's sixteenth run): the hooks' own timer read
    3.5 ms a step at dp 2 on 2 cores and 6.6 ms at dp 4 on the same cores. ZeRO-3's work,
    calibrated as the ranks' mean thread CPU in whole steps (``calibrate.zero_step_passes``),
    was left unstretched until the thirty-second run of the local-truth bench, which put its
    4-rank rows at 0.78-0.89 at micro-batch 2 (docs/planner.md). Stretched in full it
    over-prices them on a slower host (1.23 and 1.25 in the thirty-fifth run): how much of it
    a time-shared step pays is open (docs/planner.md, How much of ZeRO-3's work time-shared
    ranks pay)."""
    hw = w.hardware
    if not time_shared(w):
        return 0.0
    ranks = min(w.gpus, hw.gpus_per_node)
    m = L.microbatches(w.global_batch)
    zero = m * sum(c.zero_forward + c.zero_backward for c in chunks)
    pipeline_work = m * sum(c.forward + c.backward for c in chunks) - zero + \
        L.pp * optimizer_time
    own = sum(c.dp_cpu for c in chunks) / L.pp  # already in exposed_dp / zero once
    return (ranks * pipeline_work / L.pp / hw.cores + zero / L.pp + exposed_dp + sync_time
            + (ranks / hw.cores - 1) * own)


def context_parallel_times(w: Workload, t: int, cp: int, b: int, method: str, link: Link
                           ) -> tuple[float, float, bool]:
    """(forward, backward seconds, whether they hide behind attention) of one layer's
    context-parallel traffic: the bytes of ``context_parallel.bytes_per_layer`` (heads per tp
    rank; bf16/fp32 activations, the ring's dK/dV in fp32) over `link`, one α per message step.
    The ring's hops overlap the block products; all-gather and all-to-all wait for their data."""
    if cp == 1:
        return 0.0, 0.0, True
    from tessera.parallel.context_parallel import bytes_per_layer

    spec, e = w.model, w.bytes[3]
    heads, kv = spec.heads // t, max(spec.kv_heads // t, 1)
    vol = bytes_per_layer(method, cp, b, heads, kv, w.seq_len // cp, spec.head_dim, e)
    steps = {"ring": (cp - 1, 2 * cp - 1), "allgather": (cp - 1, 2 * (cp - 1)),
             "ulysses": (4 * (cp - 1), 4 * (cp - 1)),
             "hybrid": (4 + cp // 2 - 1, 4 + 2 * (cp // 2) - 1)}[method]
    fwd = steps[0] * link.alpha + vol["forward"] * link.beta
    bwd = steps[1] * link.alpha + vol["backward"] * link.beta
    return fwd, bwd, method == "ring"


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


@lru_cache(maxsize=8192)
def block_costs(w: Workload, t: int, cp: int, b: int, sp: bool, recompute: str,
                cp_method: str = "ring") -> BlockCosts:
    """Forward/backward seconds of one block and its activation bytes (module docstring)."""
    spec, hw = w.model, w.compute_hardware
    e = w.bytes[3]
    s = w.seq_len
    tp_link, cp_link = group_link(hw, t), p2p_link(hw, t * cp)
    _, attn = layer_forward_flops(spec, b, s, cp)
    mm_time, mm_back = block_matmul_times(spec, hw, b * (s // cp), t)
    column_back = block_matmul_times(spec, hw, b * (s // cp), t, column_only=True)[1]
    attn_time = attn / t / hw.attention_flops * (0.5 if w.flash_attention else 1.0)
    full_bytes = layer_activation_bytes(spec, b, s, t, sp, "none", w.flash_attention, cp, e)
    score_bytes = full_bytes - layer_activation_bytes(spec, b, s, t, sp, "selective",
                                                      w.flash_attention, cp, e)
    mem_time = w.elementwise_passes * full_bytes / hw.memory_bw
    ops_time = OPS_PER_LAYER_FORWARD * hw.op_overhead_us * 1e-6
    fwd = mm_time + attn_time + mem_time + ops_time
    back = mm_back + 2 * (attn_time + mem_time + ops_time)
    redo = {"none": 0.0,
            "selective": attn_time + w.elementwise_passes * score_bytes / hw.memory_bw,
            "full": fwd}[recompute]
    # Tensor parallel: 2 all-reduces forward, 2 backward (with sequence parallelism an
    # all-gather plus a reduce-scatter each: the same volume), 2 more for a recomputed forward.
    # Sequence parallelism keeps only the s/t slice of the attention's and the MLP's input for
    # backward and all-gathers it again there (Korthikanti et al. §4.2.2): 2 more all-gathers.
    act_tensor = e * b * (s // cp) * spec.hidden
    one = 2 * allgather_time(act_tensor, t, tp_link) if sp else allreduce_time(act_tensor, t,
                                                                               tp_link)
    regather = 2 * allgather_time(act_tensor, t, tp_link) if sp else 0.0
    tp_fwd = 2 * one
    tp_bwd = 2 * one + regather + (2 * one if recompute == "full" else 0.0)
    if w.tp_async_backward and t > 1:
        # The row-parallel linears' gradient collectives stay blocking (one each); the
        # column-parallel ones' (one each, and SP's regathers) hide behind their GEMMs.
        async_part = one + regather
        tp_bwd -= async_part - max(0.0, async_part - column_back)
    # Each blocking collective (2 forward and 2 backward; SP: 4 and 4, the regather overlaps)
    # ends a stretch of compute, and waits for the slowest rank of the group.
    syncs = 4 if sp else 2
    bwd = back + redo
    tp_fwd += syncs * rank_skew(w, t, fwd / syncs)
    tp_bwd += syncs * rank_skew(w, t, bwd / syncs)
    cp_fwd, cp_bwd, cp_hidden_ok = context_parallel_times(w, t, cp, b, cp_method, cp_link)
    act = layer_activation_bytes(spec, b, s, t, sp, recompute, w.flash_attention, cp, e)
    work = full_bytes
    if w.tessera_engine and cp == 1:  # what tessera's block saves (engine module)
        act = engine.block_saved_bytes(spec, b, s, t, sp, recompute, e)
        work = engine.block_saved_bytes(spec, b, s, t, sp, "none", e)
    return BlockCosts(forward=fwd, backward=back, recompute=redo, tp_forward=tp_fwd,
                      tp_backward=tp_bwd,
                      cp_forward=max(0.0, cp_fwd - attn_time) if cp_hidden_ok else cp_fwd,
                      cp_backward=max(0.0, cp_bwd - 2 * attn_time) if cp_hidden_ok else cp_bwd,
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

    @property
    def forward(self) -> float:
        return self.forward_compute + self.tp_forward + self.cp_forward + self.zero_forward

    @property
    def backward(self) -> float:
        return self.backward_compute + self.tp_backward + self.cp_backward + self.zero_backward


@dataclass
class RankState:
    """Model-state bytes of one pipeline rank and its optimizer step time."""

    params: float
    grads: float
    optimizer: float
    zero3_buffer: float
    optimizer_time: float


@dataclass
class LayoutCosts:
    """Everything about a layout that does not need the schedule's timing."""

    chunks: ChunkList
    """Per chunk; chunk c runs on rank c mod p. Chunks of the same shape share one object."""
    ranks: dict[int, RankState]
    """Model state of the pipeline ranks: every rank, or, when the middle chunks are all alike,
    0 (embedding), p−1 (head) and 1 standing for all the others."""
    p2p_latency: float
    p2p_bytes: float
    p2p_bandwidth: float
    dp_overlap: bool
    optimizer_time: float
    """The slowest rank's optimizer step."""
    dp_time: float
    """Data-parallel communication seconds per step on one rank (all its chunks)."""
    ps_time: float = 0.0
    """Parameter server: seconds its exchanges (and, asynchronous, its extra updates) add to a
    step after the backward."""
    sync: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """tessera's per-step scalar all-reduces (:func:`scalar_sync_times`), seconds over the
    (dp·cp, tp, pp) groups."""

    @property
    def sync_time(self) -> float:
        return sum(self.sync)

    @property
    def uniform_middle(self) -> bool:
        """All chunks but the first and the last are one object (the O(1) bound applies)."""
        return self.chunks.uniform_middle


class ChunkList(list):
    """The chunks of one layout as ``_chunk_costs`` builds them, knowing whether every chunk but
    the first and the last is one shared object (asked once per estimate: a search asks it of
    ~18,000 layouts, so it is settled when the list is built)."""

    uniform_middle: bool = False


def layout_costs(w: Workload, L: Layout) -> LayoutCosts:
    """Per-chunk times and bytes of `L` on `w` (chunk c runs on rank c mod p)."""
    chunks, p2p_latency, p2p_bytes, p2p_bandwidth = _chunk_costs(
        w, L.tp, L.cp, L.pp, L.dp, L.virtual, L.micro_batch, L.recompute,
        L.sequence_parallel, L.zero, L.dp_mode, L.cp_method, chunk_sizes(w, L),
        zero3_by_actions(L))
    n_chunks = L.pp * L.virtual
    wanted = sorted({0, min(1, L.pp - 1), L.pp - 1}) if chunks.uniform_middle else range(L.pp)
    ranks: dict[int, RankState] = {}
    by_chunks: dict[tuple[int, ...], RankState] = {}  # ranks holding the same chunks
    for r in wanted:
        mine = tuple(id(chunks[c]) for c in range(r, n_chunks, L.pp))
        if mine not in by_chunks:
            by_chunks[mine] = rank_state(w, L, r, chunks)
        ranks[r] = by_chunks[mine]
    dp_time = max(sum(chunks[c].dp_total for c in range(r, n_chunks, L.pp)) for r in ranks)
    optimizer_time = max(rs.optimizer_time for rs in ranks.values())
    return LayoutCosts(chunks=chunks, ranks=ranks, p2p_latency=p2p_latency,
                       p2p_bytes=p2p_bytes, p2p_bandwidth=p2p_bandwidth,
                       dp_overlap=w.hardware.dp_overlap > 0, optimizer_time=optimizer_time,
                       dp_time=dp_time, ps_time=_parameter_server_time(w, L, chunks,
                                                                       optimizer_time),
                       sync=scalar_sync_times(w, L) if w.tessera_engine else (0.0, 0.0, 0.0))


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
    dp = allreduce_time(8, dpcp, dp_link) * (2 if L.zero >= 1 else 1)
    tp = allreduce_time(8, t, group_link(hw, t))
    pp = 2 * allreduce_time(8, p, group_link(hw, t * L.cp * L.dp * p, stride=t * L.cp * L.dp))
    return dp, tp, pp


def _parameter_server_time(w: Workload, L: Layout, chunks: list[ChunkCosts],
                           optimizer_time: float) -> float:
    """Li et al. 2014's push/pull through one server (tessera.parallel.parameter_server): the
    server receives N−1 pushes of (S + P + 2) fp32 values and sends N−1 pulls of (S + 3), one
    message at a time over its own link (S parameter elements, P tensors, N = dp). Synchronous:
    after the slowest replica's backward. Asynchronous: nobody waits for the slowest, but the
    server also applies each of the N−1 gradients it serves (N−1 more optimizer steps)."""
    if L.dp_mode == "allreduce":
        return 0.0
    hw = w.hardware
    link = p2p_link(hw, L.gpus)
    S = sum(c.params for c in chunks)
    P = sum(c.tensors for c in chunks)
    exchange = 2 * link.alpha + 4 * ((S + P + 2) + (S + 3)) * link.beta
    if L.dp_mode == "ps-async":
        return (L.dp - 1) * (exchange + optimizer_time)
    m = L.microbatches(w.global_batch)
    work = m * sum(c.forward + c.backward for c in chunks)
    return (L.dp - 1) * exchange + rank_skew(w, L.dp, work)


def _activation_bytes(w: Workload, b: int, cp: int) -> float:
    """Bytes of one micro-batch's hidden states on a context-parallel rank: what crosses a
    pipeline boundary, and what a tensor-parallel embedding reduces."""
    return w.bytes[3] * b * (w.seq_len // cp) * w.model.hidden


@lru_cache(maxsize=65536)
def _compute_chunks(w: Workload, t: int, cp: int, pp: int, v: int, b: int, recompute: str,
                    sp: bool, cp_method: str, sizes: tuple[int, ...]) -> ChunkList:
    """Per-chunk compute, tensor- and context-parallel costs and bytes, before any data
    parallelism (cached: the layouts that differ only in their ZeRO stage or data-parallel
    mode share them; :func:`_chunk_costs` adds those to copies, these stay read-only)."""
    spec, hw = w.model, w.compute_hardware
    e = w.bytes[3]
    s = w.seq_len
    n_chunks = pp * v
    tessera = w.tessera_engine and cp == 1
    blk = block_costs(w, t, cp, b, sp, recompute, cp_method)
    keep = 1.0 - w.tp_overlap

    def blocks_only(nl: int) -> ChunkCosts:
        return ChunkCosts(
            forward_compute=nl * blk.forward, recompute=nl * blk.recompute,
            backward_compute=nl * (blk.backward + blk.recompute),
            tp_forward=nl * blk.tp_forward * keep, tp_backward=nl * blk.tp_backward * keep,
            tp_hidden=nl * (blk.tp_forward + blk.tp_backward) * w.tp_overlap,
            cp_forward=nl * blk.cp_forward, cp_backward=nl * blk.cp_backward,
            cp_hidden=nl * (blk.cp_total - blk.cp_forward - blk.cp_backward),
            params=nl * spec.layer_params / t, tensors=nl * _layer_tensors(spec),
            act_bytes=nl * blk.act_bytes, work_bytes=blk.work_bytes)

    # Embedding on chunk 0 (a gather: memory-bound) and final norm, LM head and fp32 logits
    # for the loss on the last chunk (Korthikanti et al. §4.3).
    tokens = b * (s // cp)
    split = t if sp else 1
    tp_link = group_link(hw, t)
    act = _activation_bytes(w, b, cp)
    logits_bytes = 4 * tokens * spec.vocab_size / t

    def add_embedding(ch: ChunkCosts) -> None:
        embed_mem = w.elementwise_passes * act / hw.memory_bw
        ch.forward_compute += embed_mem
        ch.backward_compute += 2 * embed_mem
        ch.params += spec.embedding_params / t
        ch.tensors += 2 if spec.learned_positions else 1
        ch.act_bytes += (tokens * spec.hidden if spec.dropout else 0) / split
        if t > 1:
            # Vocabulary-parallel embedding: each rank looks up its rows, an all-reduce (with
            # SP a reduce-scatter) sums them (Shoeybi et al. 2019 §3).
            comm = allgather_time(act, t, tp_link) if sp else allreduce_time(act, t, tp_link)
            ch.tp_forward += comm * keep
            ch.tp_hidden += comm * w.tp_overlap

    def add_head(ch: ChunkCosts) -> None:
        head_f, head_b = gemm_times(hw, tokens, spec.hidden, spec.vocab_size / t)
        head = w.elementwise_passes * logits_bytes / hw.memory_bw
        ch.forward_compute += head_f + head
        ch.backward_compute += head_b + 2 * head
        if t > 1:  # the loss over split logits all-reduces the b·s row maxima, then the sums
            # of exponentials with the target logits (Shoeybi et al. 2019 §3)
            ch.tp_forward += allreduce_time(4 * tokens, t, tp_link) + allreduce_time(
                8 * tokens, t, tp_link)
        # A tied head on another rank than the embedding keeps its own copy of the matrix.
        tied_copy = spec.tied_embeddings and pp > 1
        ch.params += (spec.head_params + (spec.vocab_size * spec.hidden if tied_copy else 0)) / t
        ch.tensors += 2
        ch.act_bytes += logits_bytes + 2 * act / split

    shared: dict[int, ChunkCosts] = {}
    chunks = ChunkList()
    for c, nl in enumerate(sizes):
        first, last = c == 0, c == n_chunks - 1
        if not (first or last):
            if nl not in shared:
                shared[nl] = blocks_only(nl)
            chunks.append(shared[nl])
            continue
        ch = blocks_only(nl)
        if first:
            add_embedding(ch)
        if last:
            add_head(ch)
        if tessera:  # tessera's exact parameters and saved tensors (engine module)
            units = engine.chunk_units(spec, t, pp, n_chunks, c, nl)
            ch.params = sum(n for n, _ in units)
            ch.tensors = sum(k for _, k in units)
            ch.act_bytes = nl * blk.act_bytes + engine.chunk_saved_bytes(
                spec, b, s, t, sp, e, first=first, last=last)
        chunks.append(ch)
    if tessera:
        for nl, ch in shared.items():
            ch.params = nl * engine.block_numel(spec, t)
    # The middle chunks are shared[nl] objects: one object iff one middle size.
    chunks.uniform_middle = len(shared) <= 1
    return chunks


_CHUNK_FIELDS = tuple(f.name for f in fields(ChunkCosts))


def _copy(ch: ChunkCosts) -> ChunkCosts:
    """A copy of `ch` (its fields are numbers; faster than dataclasses.replace)."""
    new = object.__new__(ChunkCosts)
    for name in _CHUNK_FIELDS:
        setattr(new, name, getattr(ch, name))
    return new


@lru_cache(maxsize=65536)
def _chunk_costs(w: Workload, t: int, cp: int, pp: int, dp: int, v: int, b: int,
                 recompute: str, sp: bool, zero: int, dp_mode: str,
                 cp_method: str, sizes: tuple[int, ...], by_actions: bool = False
                 ) -> tuple[list[ChunkCosts], float, float, float]:
    """Per-chunk costs (:func:`_compute_chunks`, with the data-parallel collectives) and the
    point-to-point latency, bytes and bandwidth (cached: a search asks for the same chunks
    under many layouts; the returned chunks are read-only)."""
    spec, hw = w.model, w.compute_hardware
    gb = w.bytes[1]
    n_chunks = pp * v
    tessera = w.tessera_engine and cp == 1
    base = _compute_chunks(w, t, cp, pp, v, b, recompute, sp, cp_method, sizes)
    copies: dict[int, ChunkCosts] = {}  # a shared middle chunk stays one object
    chunks = ChunkList()
    for ch in base:
        if id(ch) not in copies:
            copies[id(ch)] = _copy(ch)
        chunks.append(copies[id(ch)])
    chunks.uniform_middle = base.uniform_middle
    distinct = list(copies.values())
    tp_link = group_link(hw, t)
    act = _activation_bytes(w, b, cp)

    # -- data parallel --------------------------------------------------------------------------
    # Every collective is priced per unit on the link its group crosses (group_link: the dp·cp
    # ranks of a tensor-parallel rank sit t apart in the (pp, dp, cp, tp) order) and only what
    # compute cannot cover is exposed (:func:`exposed_behind`; never a negative hidden time).
    # ZeRO-0/1: gradients accumulate over the m micro-batches and are all-reduced once, in
    # buckets that start as the last backward completes them (Li et al. 2020, PyTorch DDP);
    # ZeRO-1 reduce-scatters them and all-gathers the updated parameters after the step.
    # ZeRO-2 reduce-scatters every micro-batch's gradients unit by unit during its backward;
    # ZeRO-3 also all-gathers each unit's parameters before its forward and again before its
    # backward, `zero_prefetch` units ahead (Rajbhandari et al. 2020 §7; FSDP, Zhao et al.
    # 2023 §3.3). A parameter server moves nothing here (``_parameter_server_time``).
    dp_group = dp * cp
    dp_link = group_link(hw, t * cp * dp, stride=t * cp)
    m = w.global_batch // (dp * b)
    ovl = hw.dp_overlap
    pb = w.bytes[0]
    reducing = distinct if dp_mode == "allreduce" else []
    for ch in reducing:
        grads, weights = gb * ch.params, pb * ch.params
        units = _units_of(ch, sizes, chunks)
        # The reduction waits for the slowest replica: after the step's backward (ZeRO-0/1),
        # after each micro-batch (ZeRO-2/3).
        wait = rank_skew(w, dp_group, (m if zero <= 1 else 1) * (ch.forward
                                                                       + ch.backward))
        # the seconds of collective that the compute beside it hides (hardware.dp_overlap)
        fwd, bwd = ovl * ch.forward, ovl * ch.backward
        if zero <= 1:
            n_buckets = max(1, math.ceil(grads / (w.bucket_mb * 2**20)))
            per_bucket = (allreduce_time(grads / n_buckets, dp_group, dp_link) if zero == 0
                          else allgather_time(grads / n_buckets, dp_group, dp_link))
            gather_after = allgather_time(weights, dp_group, dp_link) if zero == 1 else 0.0
            ddp = zero == 0 and tessera and dp_group > 1
            book = ddp_bucket_time(hw, grads, ch.tensors) if ddp else 0.0
            ch.dp_total = n_buckets * per_bucket + gather_after + wait + book
            ch.dp_reduce = (exposed_behind(per_bucket, n_buckets, bwd, 0) + gather_after + wait
                            + book)
            ch.dp_cpu = book
        else:
            ag = allgather_time(weights / units, dp_group, dp_link)
            rs = allgather_time(grads / units, dp_group, dp_link)
            # tessera's own work around each unit's collectives (ZeRO-3, calibrated: a fixed
            # part per unit and passes over the gathered parameter bytes, per micro-batch,
            # with what the collectives in flight take from the rank's core): exposed, on
            # the rank's own thread, every rank of the group at the same time when a collective
            # releases them all, so ranks that time-share cores stretch it like compute
            # (dp_cpu, shared_cpu_bound).
            book = (hw.zero_unit_us * 1e-6 * _engine_units(spec, t, pp, n_chunks, sizes, chunks,
                                                           ch)
                    + hw.zero_unit_passes * weights / hw.memory_bw
                    if zero == 3 and tessera else 0.0)
            if zero == 2:
                ch.zero_backward = exposed_behind(rs, units, bwd, 0) + wait
                ch.dp_reduce = units * ag  # the parameters, gathered once after the step
                ch.dp_total = m * (units * rs + wait) + units * ag
            elif by_actions:
                # Breadth-first: the schedule's sharding actions say when each chunk is
                # gathered (twice per step: its forwards, its backwards) and reduced (after
                # its last backward, while the rank's other chunks still run backward), and
                # the simulator overlaps them with compute (Lamy-Poirier 2022, §4).
                ch.unshard = units * ag
                ch.dp_reduce = units * rs + wait + book
                ch.dp_total = 2 * ch.unshard + ch.dp_reduce  # gathered twice per step
            else:
                depth = w.zero_prefetch
                ch.zero_forward = exposed_behind(ag, units, fwd, depth, lead=True)
                ch.zero_backward = (exposed_behind(ag + rs, units, bwd, depth, lead=True) + wait
                                    + book)
                ch.dp_reduce = 0.0
                ch.dp_total = m * (units * (2 * ag + rs) + wait + book)
                ch.dp_cpu = m * book

    # -- pipeline point-to-point ------------------------------------------------------------
    p2p_bytes = float(act)
    p2p_latency = 0.0
    pp_link = p2p_link(hw, t * cp * dp * pp)
    if pp > 1 and t > 1 and (w.scatter_gather or sp):
        p2p_bytes /= t
        if not sp:  # gather the full activation back on the fast link
            p2p_latency += allgather_time(act, t, tp_link)
    p2p_latency += pp_link.alpha if pp > 1 else 0.0
    return chunks, p2p_latency, p2p_bytes, pp_link.bandwidth


def zero3_by_actions(L: Layout) -> bool:
    """ZeRO-3 under a breadth-first schedule is timed from the schedule's sharding actions
    (``schedule.add_sharding_actions``, simulated); elsewhere each micro-batch gathers and
    reduces unit by unit (depth-first runs are single actions: per micro-batch)."""
    return L.zero >= 3 and L.schedule == "bfs" and L.pp * L.virtual > 1 and (
        L.dp_mode == "allreduce")


def _chunk_index(ch: ChunkCosts, chunks: list[ChunkCosts]) -> int | None:
    """Where `ch` (this object, not an equal one: middle chunks may share one) first appears."""
    return next((c for c, other in enumerate(chunks) if other is ch), None)


def _units_of(ch: ChunkCosts, sizes: tuple[int, ...], chunks: list[ChunkCosts]) -> int:
    """ZeRO units of a chunk: one per block (tessera's and FSDP's wrapping), the embedding
    and the head folded into the first and last block's units."""
    c = _chunk_index(ch, chunks)
    return 1 if c is None else sizes[c]


def _engine_units(spec: ModelSpec, t: int, pp: int, n_chunks: int, sizes: tuple[int, ...],
                  chunks: list[ChunkCosts], ch: ChunkCosts) -> int:
    """tessera's ZeRO units of chunk `ch` (``engine.chunk_units``: the embedding and the head
    are units of their own, beside one per block)."""
    c = _chunk_index(ch, chunks)
    return 1 if c is None else len(engine.chunk_units(spec, t, pp, n_chunks, c, sizes[c]))


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


def _layer_tensors(spec: ModelSpec) -> int:
    matrices = 4 + spec.mlp_matrices
    return matrices * (2 if spec.bias else 1) + 2 * (2 if spec.norm == "layernorm" else 1)


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
    per_tensor = (hw.ddp_tensor_us if hw.ddp_tensor_us > 0
                  else OPS_PER_TENSOR_BUCKET * hw.op_overhead_us) * 1e-6
    return (hw.ddp_copy_passes + 2) * grad_bytes / hw.memory_bw + tensors * per_tensor


def optimizer_traffic(stepped: float, normed: float, nbytes: tuple[int, int, int, int],
                      tessera: bool, cpu_ranks: bool = False) -> float:
    """Bytes one rank's optimizer step moves: the gradient norm over the `normed` gradient
    elements it holds (one read; on CPU ranks tessera's fp64 sum moves TESSERA_NORM_BYTES_CPU
    more per element, and tessera prices the clipping too, a read and a write of each, as a
    step whose norm is above train.grad_clip), then AdamW over the `stepped` parameters
    (reads and writes its states, reads the gradient, writes the parameter)."""
    pb, gb, ob, _ = nbytes
    norm = 3 * gb + (TESSERA_NORM_BYTES_CPU if cpu_ranks else 0) if tessera else gb
    return normed * norm + stepped * (2 * ob + gb + 2 * pb)


def optimizer_step_time(hw: Hardware, stepped: float, normed: float, tensors: int,
                        nbytes: tuple[int, int, int, int], tessera: bool) -> float:
    """Seconds of one rank's gradient norm and optimizer step: memory-bound traffic plus a
    fixed cost per parameter tensor (``hw.optimizer_tensor_us`` where calibrate measured
    tessera's per-parameter loops, else OPS_PER_TENSOR_ADAMW kernels at ``op_overhead_us``)."""
    per_tensor = (hw.optimizer_tensor_us if hw.optimizer_tensor_us > 0
                  else OPS_PER_TENSOR_ADAMW * hw.op_overhead_us) * 1e-6
    return (optimizer_traffic(stepped, normed, nbytes, tessera, hw.cpu_ranks) / hw.memory_bw
            + tensors * per_tensor)


def rank_state(w: Workload, L: Layout, rank: int, chunks: list[ChunkCosts]) -> RankState:
    """Pipeline rank `rank`'s model state (it holds chunks rank, rank + p, ... of `chunks`).

    ZeRO (Rajbhandari et al. 2020 §5): stage 1 shards optimizer state over the dp·cp ranks
    that hold the same parameters, stage 2 also gradients, stage 3 also parameters, which
    are then gathered two blocks at a time (one computing, one prefetched). For a tessera
    model, the bytes tessera allocates (``engine.model_state_bytes``)."""
    pb, gb, ob, _ = w.bytes
    mine = chunks[rank::L.pp]
    params = sum(ch.params for ch in mine)
    tensors = sum(ch.tensors for ch in mine)
    shard = L.dp * L.cp
    stepped = params / (shard if L.zero >= 1 else 1)
    normed = params / (shard if L.zero >= 2 else 1)  # the gradient elements this rank holds
    opt_time = optimizer_step_time(w.hardware, stepped, normed, tensors, w.bytes,
                                   w.tessera_engine)
    if w.tessera_engine and L.cp == 1:
        state = engine.model_state_bytes(w, L, rank)
        largest = sorted(n for n, _ in engine.rank_units(w, L, rank))[-2:]
        return RankState(params=state["params"], grads=state["grads"],
                         optimizer=state["optimizer"],
                         zero3_buffer=pb * sum(largest) if L.zero >= 3 else 0.0,
                         optimizer_time=opt_time)
    # Gathered at once: two blocks (pp = v = 1, gathered unit by unit), or with several
    # chunks two whole chunks (the sharding actions gather a chunk per run, one ahead).
    gathered = (2 * w.model.layer_params / L.tp if L.pp * L.virtual == 1
                else sum(sorted(ch.params for ch in mine)[-2:]))
    return RankState(
        params=pb * params / (shard if L.zero >= 3 else 1),
        grads=gb * params / (shard if L.zero >= 2 else 1),
        optimizer=ob * stepped,
        zero3_buffer=pb * gathered if L.zero >= 3 else 0.0,
        optimizer_time=opt_time)
