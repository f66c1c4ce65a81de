"""Typed configuration: model, parallel layout, training and data.

Every config is a keyword-only dataclass; each field carries a docstring right under it, and
``__post_init__`` validates each field on its own (its range, its type, a name in a registry).
Rules that tie two fields together (``tp`` must divide ``n_heads``, the layout must multiply to
the world size) live in ``tessera.layout.validate``, which the preflight runs on every rank
before any collective. ``tessera.config_io`` builds a config from a preset, a file and
overrides (``make_config``); ``tessera.config_warnings`` lists its likely unintended settings.

Every failure raises :class:`~tessera.errors.ConfigError`, whose message names the field, the
value and the rule, e.g. ``parallel.tp=3: must divide model.n_heads=8``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tessera.errors import check_path
from tessera.errors import require as _require
from tessera.pipeline.schedules import SCHEDULES

INT64_MAX = 2**63 - 1
"""The largest integer any field takes: torch, numpy and the collectives hold sizes and seeds
as 64-bit integers (a larger one fails deep inside them, e.g. "Overflow when unpacking long
long")."""


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(isinstance(value, int) and value >= 1, f"{section}.{name}", value,
                 "must be a positive integer")
        _require(value <= INT64_MAX, f"{section}.{name}", value,
                 f"must be at most {INT64_MAX} (a 64-bit integer)")


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama-style decoder-only transformer (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level tokenizer."""
    d_model: int = 64
    """Hidden size h."""
    n_layers: int = 2
    """Number of transformer blocks L."""
    n_heads: int = 4
    """Number of query heads a; head size is d_model / n_heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means n_heads (plain MHA)."""
    ffn_hidden: int | None = None
    """SwiGLU inner size; None picks Llama's rule: 2/3 of 4h rounded up to a multiple of 32."""
    max_seq_len: int = 256
    """Longest sequence the RoPE tables cover."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling_factor: float | None = None
    """Llama 3 RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``): low frequencies
    are divided by this factor, high ones kept, the band between interpolated (see
    ``model.rope_frequencies``). None: plain RoPE. Llama 3.1 and 3.2 use 8 and 32."""
    rope_low_freq_factor: float = 1.0
    """Llama 3 scaling: wavelengths above original_max_seq_len / this are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """Llama 3 scaling: wavelengths below original_max_seq_len / this are kept as they are."""
    rope_original_max_seq_len: int = 8192
    """Llama 3 scaling: the context length the model was pre-trained at (Hugging Face's
    ``original_max_position_embeddings``)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the token-embedding matrix with the LM head."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization of weight matrices."""
    moe_experts: int = 0
    """Experts E of each mixture-of-experts layer (``tessera.moe``); 0: a dense model."""
    moe_top_k: int = 2
    """Experts each token is routed to (1: Switch Transformer, 2: GShard/Mixtral)."""
    moe_every: int = 1
    """Every this-many-th block is MoE (layers moe_every-1, 2·moe_every-1, ...); 1: all."""
    moe_capacity_factor: float = 0.0
    """C: each expert takes at most ceil(C·T·k/E) assignments per sequence, the rest are
    dropped (priority: first choices, then position); 0: dropless."""
    moe_aux_loss_coef: float = 0.01
    """Weight of Switch Transformer's load-balancing loss E·Σ f·P (0: off)."""
    moe_z_loss_coef: float = 0.0
    """Weight of ST-MoE's router z-loss, mean logsumexp(logits)² (0: off)."""
    moe_router_bias_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: per-step update of each expert's routing
    bias (0: no bias)."""
    moe_shared_expert: bool = False
    """Add a dense SwiGLU expert (ffn_hidden wide) that every token goes through."""
    moe_ffn_hidden: int | None = None
    """Each expert's SwiGLU inner size; None: ffn_hidden."""

    def __post_init__(self) -> None:
        _positive("model", self, "vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _positive("model", self, "n_kv_heads")
        _require(self.d_model % self.n_heads == 0, "model.d_model", self.d_model,
                 f"must be divisible by model.n_heads={self.n_heads}")
        _require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                 f"must divide model.n_heads={self.n_heads}")
        _require((self.d_model // self.n_heads) % 2 == 0, "model.d_model", self.d_model,
                 "head size d_model/n_heads must be even for RoPE")
        if self.ffn_hidden is None:
            self.ffn_hidden = 32 * math.ceil(int(2 * 4 * self.d_model / 3) / 32)
        _positive("model", self, "ffn_hidden")
        _require(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        _require(self.rope_scaling_factor is None or self.rope_scaling_factor >= 1,
                 "model.rope_scaling_factor", self.rope_scaling_factor, "must be >= 1 or null")
        _require(self.rope_low_freq_factor > 0, "model.rope_low_freq_factor",
                 self.rope_low_freq_factor, "must be > 0")
        _require(self.rope_high_freq_factor > self.rope_low_freq_factor,
                 "model.rope_high_freq_factor", self.rope_high_freq_factor,
                 f"must be > model.rope_low_freq_factor={self.rope_low_freq_factor}")
        _positive("model", self, "rope_original_max_seq_len")
        _require(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        _require(self.init_std > 0, "model.init_std", self.init_std, "must be > 0")
        self._check_moe()

    def _check_moe(self) -> None:
        _require(isinstance(self.moe_experts, int) and self.moe_experts >= 0,
                 "model.moe_experts", self.moe_experts, "must be an integer >= 0 (0: dense)")
        # The ranges hold for a dense model too: a value that could never work is refused
        # whether or not it is used yet.
        _require(self.moe_capacity_factor >= 0, "model.moe_capacity_factor",
                 self.moe_capacity_factor, "must be >= 0 (0: dropless)")
        for name in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_router_bias_rate"):
            _require(getattr(self, name) >= 0, f"model.{name}", getattr(self, name),
                     "must be >= 0")
        if not self.moe_experts:
            return
        _positive("model", self, "moe_top_k", "moe_every")
        _require(self.moe_top_k <= self.moe_experts, "model.moe_top_k", self.moe_top_k,
                 f"must be <= model.moe_experts={self.moe_experts}")
        if self.moe_ffn_hidden is not None:
            _positive("model", self, "moe_ffn_hidden")

    def is_moe_layer(self, layer: int) -> bool:
        """Is block `layer`'s feed-forward a mixture of experts?"""
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe_hidden(self) -> int:
        """Each expert's SwiGLU inner size."""
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rope_scaling(self) -> RopeScaling | None:
        """The Llama 3 frequency scaling, or None for plain RoPE."""
        if self.rope_scaling_factor is None:
            return None
        return RopeScaling(self.rope_scaling_factor, self.rope_low_freq_factor,
                           self.rope_high_freq_factor, self.rope_original_max_seq_len)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (Meta's ``apply_scaling``; Hugging Face "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int


DP_MODES = ("allreduce", "ps", "ps-async")
LR_SCALINGS = ("none", "linear", "sqrt")
"""train.lr_scaling's rules (``tessera.optim.scaled``)."""
CP_METHODS = ("ring", "allgather", "ulysses", "hybrid")
ALLREDUCE_ALGORITHMS = ("backend", "auto", "naive", "parallel", "ring", "rabenseifner")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the world is split. Ranks are ordered (pp, dp, cp, tp), tp fastest-varying."""

    dp: int = 1
    """Data-parallel degree: replicas that each see 1/dp of the global batch."""
    tp: int = 1
    """Tensor-parallel degree (Megatron): heads and MLP columns split across tp ranks."""
    pp: int = 1
    """Pipeline-parallel degree: layers split into pp stages."""
    cp: int = 1
    """Context-parallel degree: every sequence split across cp ranks (zig-zag chunks); only
    attention communicates (``tessera.parallel.context_parallel``)."""
    cp_method: str = "ring"
    """How attention sees the other cp ranks' tokens: 'ring' (K/V passed around a ring),
    'allgather' (Llama 3), 'ulysses' (all-to-all to head-sharded), 'hybrid' (Ulysses inside
    groups of cp_ulysses ranks, ring across them)."""
    cp_ulysses: int = 2
    """Ulysses degree inside the cp group for cp_method='hybrid' (must divide cp)."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts): the experts of each MoE layer are split
    over blocks of ep consecutive dp ranks (``tessera.parallel.expert_parallel``);
    dp = ep × expert-dp."""
    ep_alltoall: str = "backend"
    """All-to-all that dispatches tokens to experts: 'backend' (torch.distributed's) or
    'pairwise' (ours, ``tessera.collectives.all_to_all_v``)."""
    zero_stage: int = 0
    """ZeRO stage: 0 plain DP, 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    dp_mode: str = "allreduce"
    """How data-parallel replicas agree: 'allreduce' (DDP), 'ps' (synchronous parameter server),
    'ps-async' (asynchronous parameter server with bounded staleness)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and residuals hold 1/tp of the sequence."""
    scatter_gather: bool = True
    """Pipeline scatter/gather (Narayanan et al. 2021 §4.1): each tp rank sends 1/tp of an
    activation or gradient to the next stage, which all-gathers it over tp."""
    schedule: str = "1f1b"
    """The pipeline schedule's name in the registry ``tessera.pipeline.schedules.SCHEDULES``
    (the built-in schedules and any added with register())."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (v) for interleaved and breadth-first schedules (zb-v and
    dualpipev run exactly 2)."""
    microbatch_group: int = 0
    """Interleaved 1F1B: micro-batches run through one chunk before the next (Megatron-LM's
    microbatch_group_size_per_vp_stage, Llama 3's N); 0 means pp, Megatron's default; at
    least pp. More hide more of the point-to-point transfers and hold more activations."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB for the data-parallel all-reduce."""
    allreduce_algorithm: str = "backend"
    """All-reduce used by data parallelism: 'backend' (torch.distributed's) or one of ours."""
    max_staleness: int = 2
    """Asynchronous parameter server: the most server versions a gradient may lag behind."""
    recompute: str = "none"
    """Activation recomputation: 'none', 'selective' (attention core) or 'full' (whole block)."""
    stage_layout: str = ""
    """Blocks in each of the pp*virtual_stages pipeline chunks, comma-separated, `N*k` for k
    chunks of N (Llama 3 405B: '7,8*14,7', the first and last stages one block fewer for the
    embedding and the head), or the same in Megatron-LM's --pipeline-model-parallel-layout
    form, 'Et*7|(t*8|)*14t*7L' (chunks split by |; E embedding, t block, L loss head);
    empty: tessera's cost-balanced split."""

    def __post_init__(self) -> None:
        _positive("parallel", self, "dp", "tp", "pp", "cp", "ep", "virtual_stages",
                  "max_staleness")
        _require(self.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", self.zero_stage,
                 "must be 0, 1, 2 or 3")
        _require(self.dp_mode in DP_MODES, "parallel.dp_mode", self.dp_mode,
                 f"must be one of {', '.join(DP_MODES)}")
        # The pipeline's registry, so a schedule added with register() is trainable by name.
        _require(self.schedule in SCHEDULES, "parallel.schedule", self.schedule,
                 f"must be one of {', '.join(SCHEDULES)}")
        _require(self.bucket_mb > 0, "parallel.bucket_mb", self.bucket_mb, "must be > 0")
        _require(self.allreduce_algorithm in ALLREDUCE_ALGORITHMS,
                 "parallel.allreduce_algorithm", self.allreduce_algorithm,
                 f"must be one of {', '.join(ALLREDUCE_ALGORITHMS)}")
        _require(self.cp_method in CP_METHODS, "parallel.cp_method", self.cp_method,
                 f"must be one of {', '.join(CP_METHODS)}")
        _require(self.recompute in ("none", "selective", "full"), "parallel.recompute",
                 self.recompute, "must be one of none, selective, full")
        _require(self.ep_alltoall in ("backend", "pairwise"), "parallel.ep_alltoall",
                 self.ep_alltoall, "must be one of backend, pairwise")
        _require(isinstance(self.microbatch_group, int) and self.microbatch_group >= 0,
                 "parallel.microbatch_group", self.microbatch_group,
                 "must be a non-negative integer (0: pp)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass(kw_only=True)
class DataConfig:
    """Where tokens come from and how they are cut into training windows."""

    path: str = "data/stdlib"
    """Directory of prepared token shards (written by `tessera data prepare`)."""
    seq_len: int = 64
    """Tokens per training sequence."""
    seed: int = 1234
    """Seed of the batch sampler; with the step number it fixes every batch."""
    val_tokens: int = 65536
    """Held-out tokens scored by each validation pass."""

    def __post_init__(self) -> None:
        _positive("data", self, "seq_len", "val_tokens")
        _require(bool(self.path), "data.path", self.path, "must not be empty")
        check_path("data.path", self.path)


MAX_TIMEOUT_S = 10**6
"""train.collective_timeout_s's maximum, 11.6 days, far beyond any collective's wait: torch
takes timeouts as ``datetime.timedelta``, which overflows past 999,999,999 days (8.6e13 s),
and its TCPStore already fails to connect at 8e13 s (1e9 s works)."""


@dataclass(kw_only=True)
class TrainConfig:
    """The optimizer, the schedule of learning rates and what gets logged."""

    steps: int = 100
    """Optimizer steps to run."""
    micro_batch_size: int = 8
    """Sequences in one micro-batch on one data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each data-parallel rank (the pipeline's m under PP)."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warm-up."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to lr."""
    lr_scaling: str = "none"
    """How lr follows the global batch (dp x grad_accum x micro_batch_size) against
    reference_batch, with k = global batch / reference_batch: 'none' keeps lr; 'linear' uses
    k * lr (Goyal et al. 2017, "Accurate, Large Minibatch SGD"); 'sqrt' uses sqrt(k) * lr (the
    square-root rule for Adam, Malladi et al. 2022). Goyal et al. warm up the k-times larger
    rate over 5 of their 90 epochs, so under 'linear' with k > 1 the warm-up lasts at least
    ceil(steps / 18) steps (the same fraction of the run); otherwise warmup_steps is kept."""
    reference_batch: int = 0
    """Sequences per optimizer step at which lr (and warmup_steps) were tuned; 0: the run's own
    global batch (no scaling)."""
    noise_scale: bool = True
    """Measure the gradient noise scale B_simple under dp >= 2 (``tessera.noise_scale``)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: int = 0
    """Seed of the parameter initialization."""
    precision: str = "fp32"
    """'fp32', or 'bf16' (bf16 compute and gradients, fp32 master weights where supported)."""
    eval_interval: int = 50
    """Run validation every this many steps (and at the end); 0 only at the end."""
    log_interval: int = 10
    """Print a metrics line every this many steps."""
    out_dir: str = ""
    """Where metrics.jsonl, the sample, pictures and checkpoints go; empty: a new
    runs/<YYYYmmdd-HHMMSS> for each run, with runs/latest a link to it (``tessera.run_dir``).
    It belongs to one run: a new run where another run's checkpoints are is refused."""
    sample_tokens: int = 200
    """Tokens generated at the end of training; 0 skips the sample."""
    sample_prompt: str = "def "
    """Prompt of the sample generated at the end."""
    peak_tflops: float | None = None
    """Peak FLOP/s of one device in TFLOP/s for MFU; None asks the device (GPUs) or skips MFU."""
    checkpoint_interval: int = 0
    """Save a checkpoint every this many steps and after the last one; 0 saves none."""
    checkpoint_dir: str = ""
    """Where checkpoints go (step-NNNNNNN/ directories); empty: <out_dir>/checkpoints."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; 0 keeps them all."""
    async_checkpoint: bool = False
    """Write checkpoints in a background thread: each rank copies what it writes and training
    goes on while the files are written; a save is finished (manifest, rename, pruning) before
    the next one starts and before training ends."""
    resume: str = ""
    """A checkpoint directory to continue from, or 'latest': the newest checkpoint of the run
    checkpoint_dir belongs to, if there is one (else start fresh); without an out_dir, 'latest'
    continues the run runs/latest points to. The resumed run keeps the checkpoint's run id. Any
    layout may resume any checkpoint of the same model and global batch (dp x grad_accum x
    micro_batch_size). A job the elastic launcher restarted (TORCHELASTIC_RESTART_COUNT > 0)
    always takes its own run's newest checkpoint."""
    overwrite: bool = False
    """Let a run start where another run's checkpoints are (under checkpoint_dir): rank 0
    deletes them when the run starts, before its first save, so they never mix with this run's
    (without it, such a run is refused)."""
    collective_timeout_s: float = 300.0
    """Seconds a collective may wait for the other ranks before it fails (every process group
    of the run), and how long a rank's heartbeat may stay silent before the others stop with a
    line naming it (``tessera.watchdog``). Not torch's 30-minute default: a dead or stopped
    rank should end the job in minutes."""
    keep_host_memory: bool = True
    """On a CPU rank, keep the host memory malloc frees instead of handing it back to the
    kernel, which faults it in again the next step (``tessera.host_memory``; on the demo's
    shape 1-4% of a one-rank step and 7% of a DataParallel step at dp 2,
    ``benchmarks/host_memory.py``). The rank's resident memory then stays at its peak. No
    effect on GPU ranks or without glibc."""

    init_from: str = ""
    """Start from these weights instead of the random initialization: a checkpoint (step
    directory, checkpoint root or run directory: its weights and MoE routing biases) or a
    Hugging Face Llama directory. The model section is taken from them; the optimizer starts
    fresh."""
    profile_steps: str = ""
    """'A:B': record steps A to B (1-based, both included) with torch.profiler and write one
    Chrome/Perfetto trace per rank to <out_dir>/profile/; empty: no profiling. Profiled steps
    run slower; their metrics records say "profiled": true."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars under <out_dir>/tensorboard (rank 0;
    needs the tensorboard package: pip install 'tessera[tensorboard]')."""
    loss_chunk_tokens: int = 0
    """Compute the LM head and the loss this many tokens at a time, so that a micro-batch's
    fp32 logits (micro_batch_size x seq_len x vocab_size x 4 bytes) are never held whole:
    each chunk's logits are computed again in backward. 0: the whole micro-batch at once."""
    compile: bool = False
    """Compile each transformer block, the final norm and the loss with torch.compile
    (regional compilation, inductor): faster steps after a one-off compile at the first step,
    reported as compile_s. Validation runs eagerly; collectives inside a block are graph
    breaks (tessera.parallel.compile)."""
    memory_snapshot: bool = False
    """CUDA only: record the caching allocator's history from the first step and write
    <out_dir>/memory/rank-NNNNN.pickle after the last (its newest 100,000 events), for
    https://pytorch.org/memory_viz."""

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """(A, B) of profile_steps, or None."""
        if not self.profile_steps:
            return None
        a, _, b = self.profile_steps.partition(":")
        return int(a), int(b)

    @property
    def checkpoint_root(self) -> str:
        return self.checkpoint_dir or f"{self.out_dir}/checkpoints"

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "micro_batch_size", "grad_accum")
        for name in ("out_dir", "checkpoint_dir", "resume", "init_from"):
            check_path(f"train.{name}", getattr(self, name))
        _require(self.checkpoint_interval >= 0, "train.checkpoint_interval",
                 self.checkpoint_interval, "must be >= 0")
        _require(self.keep_checkpoints >= 0, "train.keep_checkpoints", self.keep_checkpoints,
                 "must be >= 0")
        _require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio,
                 "must be in [0, 1]")
        _require(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.lr_scaling in LR_SCALINGS, "train.lr_scaling", self.lr_scaling,
                 f"must be one of {', '.join(LR_SCALINGS)}")
        _require(self.reference_batch >= 0, "train.reference_batch", self.reference_batch,
                 "must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        _require(0 <= self.beta1 < 1, "train.beta1", self.beta1, "must be in [0, 1)")
        _require(0 <= self.beta2 < 1, "train.beta2", self.beta2, "must be in [0, 1)")
        _require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0")
        _require(self.precision in ("fp32", "bf16"), "train.precision", self.precision,
                 "must be fp32 or bf16")
        _require(self.eval_interval >= 0, "train.eval_interval", self.eval_interval,
                 "must be >= 0")
        _require(self.log_interval >= 1, "train.log_interval", self.log_interval, "must be >= 1")
        _require(1 <= self.collective_timeout_s <= MAX_TIMEOUT_S, "train.collective_timeout_s",
                 self.collective_timeout_s,
                 f"must be a finite number of seconds >= 1 and <= {MAX_TIMEOUT_S:,}")
        _require(self.sample_tokens >= 0, "train.sample_tokens", self.sample_tokens,
                 "must be >= 0")
        _require(self.loss_chunk_tokens >= 0, "train.loss_chunk_tokens",
                 self.loss_chunk_tokens, "must be >= 0")
        _require(self.peak_tflops is None or self.peak_tflops > 0, "train.peak_tflops",
                 self.peak_tflops, "must be > 0")
        _require(not self.profile_steps or re.fullmatch(r"\d+:\d+", self.profile_steps)
                 is not None, "train.profile_steps", self.profile_steps,
                 "must look like A:B (steps A to B), e.g. 5:7")
        if self.profile_range:
            a, b = self.profile_range
            _require(1 <= a <= b <= self.steps, "train.profile_steps", self.profile_steps,
                     f"needs 1 <= A <= B <= train.steps={self.steps}")


@dataclass(kw_only=True)
class Config:
    """One run: what model, split how, trained how, on what data."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MAX_STEPS = 10**9
"""train.steps: a thousand times the longest published runs (~10^6 optimizer steps); more can
only run for years, its cosine schedule flat at the peak for all of the first ones."""

# Sizes above which a run can only fail or hang, each with why (int fields have INT64_MAX).
LIMITS: dict[str, tuple[int, str]] = {
    "train.steps": (MAX_STEPS, "more steps than any run can take (the cosine learning rate "
                               "would stay flat)"),
    "train.sample_tokens": (10**6, "the end-of-run sample is generated one token at a time"),
    "model.n_layers": (4096, "thirty times the deepest published transformers (~126 blocks)"),
    "model.d_model": (2**20, "sixty times the widest published transformers (16384)"),
    "model.ffn_hidden": (2**22, "each block allocates d_model x ffn_hidden weights"),
    "model.moe_ffn_hidden": (2**22, "each expert allocates d_model x moe_ffn_hidden weights"),
    "model.vocab_size": (2**32, "token ids are stored as at most 32-bit integers"),
    "model.max_seq_len": (2**24, "the RoPE tables hold max_seq_len x head_dim values"),
    "model.moe_experts": (2**16, "each expert is a module of its own"),
    # The batch sampler seeds each step with seed * 1,000,003 + step in 64 bits (data.loader).
    "data.seed": (2**43, "the batch sampler's per-step seed must fit in 64 bits"),
}
