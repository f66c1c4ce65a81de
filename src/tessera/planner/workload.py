"""The planning problem and one answer to it: a :class:`Workload` (what to train on what) and a
:class:`Layout` (how to split it), shared by every module of the planner.

Notation: B global batch (sequences), b micro-batch size, s sequence length, l layers, h hidden
size, a heads, V vocabulary, t tensor-parallel, p pipeline-parallel, d data-parallel, c
context-parallel degree, v virtual stages per pipeline rank, m micro-batches per step per
pipeline (m = B / (d·b)), P parameters, e bytes per activation element (2 in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from tessera.config import Config
from tessera.errors import ConfigError
from tessera.planner.hardware import Hardware
from tessera.planner.models import ModelSpec, expressible, from_model_config

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
KERNELS = ("tessera", "fused", "compiled")
"""Whose kernels a model is planned with: tessera's reference block run eagerly ('tessera':
fp32 norm copies, unfused SwiGLU, one kernel per op), fused kernels as in Megatron-LM and
Llama 3's training ('fused': Korthikanti et al. 2022's tensor count), or tessera's block
under torch.compile ('compiled', ``train.compile``: tessera's engine and saved bytes, the
memory-bound runs fused, :mod:`tessera.planner.kernels`)."""
RECOMPUTE = ("none", "selective", "full")
GB = 1e9


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
    """Pipeline sends b·s·h/t per tensor-parallel rank, all-gathered over tp by the receiver
    (Narayanan et al. 2021 §4.1; tessera's ``parallel.scatter_gather``)."""
    p2p_blocking: bool = False
    """Each rank blocks on its pipeline exchange after every forward and backward, as
    Megatron-LM of 2021 did (``batch_isend_irecv``, wait, ``cuda.synchronize``); False: sends
    and receives are in flight beside compute (tessera's runtime posts receives ahead)."""
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
    loss_chunk_tokens: int = 0
    """``train.loss_chunk_tokens``: the head and loss run this many tokens at a time, so only
    one chunk's fp32 logits exist (and the head's GEMM runs again in backward); 0: whole."""
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
        if not (isinstance(self.loss_chunk_tokens, int) and self.loss_chunk_tokens >= 0):
            raise ConfigError("train.loss_chunk_tokens", self.loss_chunk_tokens,
                              "must be an integer >= 0")
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
        micro_batch_size · grad_accum sequences of data.seq_len tokens), precision, whether
        its pipeline scatters and gathers (``parallel.scatter_gather``), its gradient bucket
        (``parallel.bucket_mb``), its kernels ('compiled' under ``train.compile``) and the
        chunked loss's tokens (``train.loss_chunk_tokens``). `kw` overrides any of them."""
        p, t = cfg.parallel, cfg.train
        kw.setdefault("gpus", p.world_size)
        kw.setdefault("scatter_gather", p.scatter_gather)
        kw.setdefault("bucket_mb", p.bucket_mb)
        kw.setdefault("kernels", "compiled" if t.compile else "tessera")
        kw.setdefault("loss_chunk_tokens", t.loss_chunk_tokens)
        return cls(model=from_model_config(name, cfg.model, cfg.data.seq_len), hardware=hardware,
                   global_batch=p.dp * t.micro_batch_size * t.grad_accum,
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
        return (expressible(self.model) and self.kernels in ("tessera", "compiled")
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
        (``Hardware.eager_elementwise_passes``), a compiled block's where kernels is
        'compiled' (``Hardware.compiled_elementwise_passes``), else the hardware's."""
        hw = self.hardware
        if self.kernels == "compiled":
            compiled = hw.compiled_elementwise_passes
            return compiled if compiled is not None else hw.elementwise_passes
        eager = hw.eager_elementwise_passes
        return eager if eager is not None and self.tessera_engine else hw.elementwise_passes


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to split the work: degrees, micro-batching, ZeRO, recomputation, schedule.

    Its fields are ``tessera.config.ParallelConfig``'s, by the same names (PARALLEL_FIELDS),
    plus the micro-batch size (``train.micro_batch_size``) and the stage layout as blocks per
    chunk (``parallel.stage_layout`` is its text). Unlike a ParallelConfig it is frozen and
    hashable (the planner caches by it) and may hold a layout tessera refuses
    (``rules.check_layout`` says why); ``engine.to_config`` and ``engine.layout_of`` convert."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved and breadth-first schedules)."""
    microbatch_group: int = 0
    """Interleaved: micro-batches per chunk visit (Megatron-LM's
    microbatch_group_size_per_vp_stage, Llama 3's N); 0: pp."""
    micro_batch: int = 1
    """Sequences per micro-batch (b)."""
    zero_stage: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    dp_mode: str = "allreduce"
    """How replicas agree: 'allreduce' (DDP or ZeRO), or a parameter server ('ps' synchronous,
    'ps-async' with bounded staleness; tessera.parallel.parameter_server)."""
    cp_method: str = "ring"
    """Context-parallel attention (tessera.parallel.context_parallel): ring, allgather,
    ulysses or hybrid (Ulysses over cp_ulysses ranks, ring across)."""
    cp_ulysses: int = 2
    """Hybrid's Ulysses degree: the all-to-all runs over groups of cp_ulysses consecutive cp
    ranks, the ring over cp/cp_ulysses ranks (read only by cp_method='hybrid')."""
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
        if self.pp > 1 or self.virtual_stages > 1:
            text += f" {self.schedule}"
            text += f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
            text += f" g={self.microbatch_group}" if self.microbatch_group else ""
        text += f" b={self.micro_batch} zero={self.zero_stage} recompute={self.recompute}"
        if self.sequence_parallel:
            text += " sp"
        if self.dp_mode != "allreduce":
            text += f" {self.dp_mode}"
        if self.cp > 1 and self.cp_method != "ring":
            text += f" cp_method={self.cp_method}"
            text += f" cp_ulysses={self.cp_ulysses}" if self.cp_method == "hybrid" else ""
        if self.stage_layout:
            text += f" stages={stage_layout_text(self.stage_layout)}"
        return text

    def key(self) -> tuple:
        return (self.dp, self.tp, self.pp, self.cp, self.virtual_stages, self.micro_batch,
                self.zero_stage, self.recompute, self.schedule, self.sequence_parallel,
                self.dp_mode, self.cp_method, self.stage_layout, self.microbatch_group,
                self.cp_ulysses)

    def key_without_schedule(self) -> tuple:
        """:meth:`key` less the schedule, which orders the chunks but does not change their
        costs (the search prices such layouts once; a plain tuple, since ``replace`` on a
        frozen dataclass costs ~20 µs and the search asks for ~20,000 keys)."""
        return (self.dp, self.tp, self.pp, self.cp, self.virtual_stages, self.micro_batch,
                self.zero_stage, self.recompute, self.sequence_parallel, self.dp_mode,
                self.cp_method, self.stage_layout, self.microbatch_group, self.cp_ulysses)


PARALLEL_FIELDS = tuple(f.name for f in fields(Layout)
                        if f.name not in ("micro_batch", "stage_layout"))
"""The Layout fields that ParallelConfig holds under the same name and meaning."""


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
