"""The hardware the planner reasons about: one accelerator kind, its node and its links.

A :class:`Hardware` is everything the cost model needs about a device: the dense 16-bit peak
FLOP/s (never the 2:4-sparse figure vendors also print), memory size and bandwidth, the per-GPU
bandwidth of the intra-node link (NVLink/NVSwitch) and of the inter-node link (InfiniBand),
with a per-message latency for each, and how many devices share a node.

Communication follows the α–β (Hockney) model: moving ``n`` bytes in one message step costs
``α + n·β`` with ``β = 1 / (bandwidth · link_efficiency)``; collectives are sums of such steps
(see :mod:`tessera.planner.cost`). The same form is used by ``tessera.collectives`` for the
collectives it measures; :func:`tessera.planner.local.calibrate.calibrate` writes the α and β it
measures on this machine into a hardware file.

Catalog figures are the vendors' data-sheet numbers (NVIDIA V100, A100, H100 and H200 data
sheets; DGX-1, DGX A100 and DGX H100/H200 system guides for the NICs: one 200 Gb/s HDR or
400 Gb/s NDR InfiniBand adapter per GPU, four 100 Gb/s EDR adapters per eight V100s). Link
bandwidths are per GPU and per direction. The latencies are typical NCCL per-step figures.

User-defined hardware comes from a TOML or YAML file with the same field names, e.g.::

    name = "my-gpu"
    peak_tflops = 400.0
    memory_gb = 96
    memory_bw_gbs = 3000
    intra_node_gbs = 300
    inter_node_gbs = 50
    gpus_per_node = 8
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from tessera.config import ConfigError, load_yaml

# Fraction of dense peak FLOP/s that large 16-bit GEMMs reach inside a training step, the fixed
# time each GEMM adds (its ramp and last partial wave: the shape dependence), and the fraction
# of a link's nominal bandwidth that NCCL collectives reach. cuBLAS reaches 70-80% of peak on
# isolated large A100 GEMMs (clocks under sustained load bring it lower); a GEMM of 2048 x 6144
# x 3072 (one tensor-parallel shard of a 22B GPT's MLP) fills 1.8 waves of 128x256 tiles on
# 108 SMs, losing about a tenth of its time to the partial wave: ~40 µs. The link figure
# matches NCCL's measured bus bandwidth on DGX A100 (about 230 of 300 GB/s). The GEMM pair is
# chosen once, documented in docs/planner.md, and checked as a whole by Megatron-LM's
# weak-scaling table (Narayanan et al. 2021, Table 1) and by Korthikanti et al. 2022's
# iteration times of 22B to 1T GPTs, whose error no longer grows with the model
# (tests/test_planner_published.py); with one rate for every GEMM (tail 0) the 22B run was
# predicted 5% slow and the 530B and 1T runs 15-16% slow.
MATMUL_EFFICIENCY = 0.69
MATMUL_TAIL_US = 40.0
# tessera's own block on a GPU runs its memory-bound work as eager PyTorch kernels (RMSNorm
# in fp32, RoPE, SwiGLU, residual adds, casts), not the fused kernels the catalog's
# elementwise_passes = 2 stands for: on an H200, bench_gpu_step.py's model (d 1024, 12
# layers, 16k tokens per step, bf16) spent 44 ms per step in such kernels, 12 passes over the
# activation bytes the cost model counts for it (benchmarks/results/gpu_h200.txt), and the
# trainer's predicted step was 0.49x the measured one with 2.
EAGER_PASSES_GPU = 12.0
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator kind and the node it lives in."""

    name: str
    """Catalog name or a user's label."""
    peak_tflops: float
    """Dense 16-bit (bf16/fp16) peak TFLOP/s of one device; for calibrated hardware the measured
    matrix-multiply rate at the model's shapes (then matmul_efficiency is 1)."""
    memory_gb: float
    """Device memory in GB (10^9 bytes)."""
    memory_bw_gbs: float
    """Device memory bandwidth in GB/s (drives memory-bound kernels and the optimizer step)."""
    intra_node_gbs: float
    """Per-device, per-direction bandwidth of the intra-node link (NVLink) in GB/s."""
    inter_node_gbs: float
    """Per-device, per-direction bandwidth of the inter-node link (InfiniBand) in GB/s."""
    gpus_per_node: int
    """Devices that share the intra-node link."""
    intra_node_alpha_us: float = 5.0
    """Latency of one message step on the intra-node link, microseconds."""
    inter_node_alpha_us: float = 10.0
    """Latency of one message step on the inter-node link, microseconds."""
    p2p_alpha_us: float | None = None
    """Latency of a point-to-point send when it differs from the collectives' α (gloo on a
    CPU); None: the link's."""
    p2p_gbs: float | None = None
    """Bandwidth of a point-to-point send when it differs from the link's; None: the link's."""
    matmul_efficiency: float = MATMUL_EFFICIENCY
    """Fraction of peak_tflops that large matrix multiplies achieve."""
    matmul_tail_us: float = 0.0
    """Shape dependence of the matrix-multiply rate: a GEMM of F FLOPs takes
    F / (peak · matmul_efficiency) + matmul_tail_us, i.e. it runs at matmul_efficiency ·
    F / (F + F₀) of peak with F₀ = peak · matmul_efficiency · tail (:meth:`gemm_time`). The
    fixed part is the kernel's ramp-up and its last, partly filled wave of thread blocks,
    which small GEMMs (narrow tensor-parallel shards, short micro-batches) cannot amortize.
    0: one rate for every GEMM (calibrated CPUs, whose per-kernel cost is op_overhead_us)."""
    attention_tflops: float | None = None
    """Rate of the attention kernel in TFLOP/s; None uses peak_tflops * matmul_efficiency."""
    link_efficiency: float = LINK_EFFICIENCY
    """Fraction of the nominal link bandwidths that collectives achieve."""
    gather_efficiency: float = 1.0
    """Speed of an all-gather or a reduce-scatter relative to the ring algorithm on the link
    that all-reduce achieves: 1 where both run the ring (NCCL); calibrate measures it for gloo,
    whose all-gather and reduce-scatter are slower than half its all-reduce."""
    op_overhead_us: float = 0.0
    """Fixed cost per kernel (launch, dispatch): negligible on GPUs at these sizes, but
    dominant for small models on a CPU, where calibrate measures it."""
    optimizer_tensor_us: float = 0.0
    """Fixed cost per parameter tensor of a step's gradient norm and optimizer update beyond
    their memory traffic: what tessera's per-parameter loops cost on a CPU, which calibrate
    measures. 0: OPS_PER_TENSOR_ADAMW kernels at op_overhead_us each."""
    zero_unit_us: float = 0.0
    """tessera's ZeRO-3 work per unit per micro-batch besides its collectives, the part that
    does not grow with the unit (hooks, views, bookkeeping), which calibrate measures on a CPU;
    0 for the catalog's GPUs (other engines, and kernels too short to matter)."""
    zero_unit_passes: float = 0.0
    """The part that grows with the unit, as passes over its parameter bytes at the memory
    bandwidth (fresh buffers for the gathered parameters and the flattened gradient, the
    copy into it, and on a CPU what gloo's thread takes from the rank's core while the
    prefetched gathers and the reduce-scatters are in flight); calibrate measures it on
    several ranks from whole forward + backward passes less their waits
    (``calibrate.zero_step_passes``), 0 in the catalog."""
    ddp_tensor_us: float = 0.0
    """tessera's DataParallel gradient hook per parameter tensor beyond its copy's traffic
    (the slot lookup, the re-pointed gradient, the used flag), which calibrate measures on a
    CPU. 0: OPS_PER_TENSOR_BUCKET kernels at op_overhead_us each."""
    ddp_copy_passes: float = 2.0
    """Passes over the gradient bytes, at the memory bandwidth, of the rest of what
    DataParallel adds to a step besides its waits and the division by dp (each fresh
    gradient's copy into its bucket slot and what that copy slows the backward around it,
    the launch, the all-reduce in flight, the work after the wait): 2 (a read and a write)
    for a plain copy; calibrate measures it on a CPU as what DataParallel adds to whole
    training steps at the user's micro-batch, less the waits (``calibrate.ddp_copy_passes``),
    where the copy of a gradient just written by backward runs slower than a streaming copy,
    and slower the larger the micro-batch."""
    elementwise_passes: float = 2.0
    """Times a memory-bound kernel moves each stored activation byte in a forward pass: 2 (one
    write, one read) with fused kernels as in Megatron-LM; calibrate measures tessera's
    unfused reference block."""
    fp32_tflops: float | None = None
    """Dense fp32 peak TFLOP/s of one device without tensor cores: what an fp32 run's matrix
    multiplies get under PyTorch's default (TF32 off). A workload in fp32 is priced at it
    (:meth:`for_precision`). None: peak_tflops (a calibrated machine measures in fp32)."""
    eager_elementwise_passes: float | None = None
    """The same for tessera's own unfused block where it differs from elementwise_passes
    (the catalog GPUs, whose elementwise_passes are fused kernels'): what a workload that
    tessera's engine runs (``Workload.tessera_engine``) is priced with. None: a calibrated
    machine, whose elementwise_passes were measured on tessera's block."""
    cores: int = 0
    """CPU cores that the ranks of one machine share (0: one device per rank, as on GPUs).
    With more ranks on a machine than cores, ranks time-share the cores and every rank's
    compute stretches by ranks / cores."""
    jitter: float = 0.0
    """Noise of compute that adds up independently, in s^½: a stretch of T seconds of kernels
    takes T ± σ with σ = jitter·√T (plus the two terms below). Ranks reach a collective that
    far apart, so each collective waits for the slowest
    (:func:`tessera.planner.comm.straggler_time`). 0 for the catalog's GPUs; a file that gives
    neither of the two terms below holds its whole σ here."""
    jitter_fixed_us: float = 0.0
    """σ's part that does not grow with the stretch (µs): how far apart ranks released
    together start, and a collective's own wake-up; calibrate measures it on a CPU."""
    jitter_rate: float = 0.0
    """σ's part that grows with the stretch, per second of it: ranks that run at different
    speeds for a whole stretch (a shared host's cores) finish it a fraction of T apart, so
    σ = jitter_fixed_us + jitter·√T + jitter_rate·T. calibrate measures it on a CPU (with
    jitter_fixed_us, from stretches of one and four blocks; benchmarks/straggler_scaling.py
    shows the wait growing as T^0.86-0.91 here, not √T)."""
    dp_overlap: float = 1.0
    """Seconds of a data-parallel collective (a ZeRO gather or reduce-scatter, a DDP bucket)
    that one second of compute beside it hides: 1 on GPUs, where NCCL runs on its own
    stream; on CPU ranks with a core each, the share ``calibrate.in_step_overlap`` reads off
    calibrate's ZeRO-3 steps at micro-batch 2 (their waits), at most what
    ``calibrate.collective_overlap`` gives for the machine's shape beside plain compute (0.5:
    gloo's thread and the compute thread share the core); 0 where ranks time-share fewer
    cores."""
    calibrated_micro_batch: int = 0
    """The micro-batch `tessera plan calibrate` measured at (matmul shapes, the DDP hooks'
    copy, the jitter's stretches all depend on it); 0: not known (a catalog GPU, or a
    file written before the field)."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        if self.fp32_tflops is not None and not self.fp32_tflops > 0:
            raise ConfigError("hardware.fp32_tflops", self.fp32_tflops,
                              "must be a positive number")
        for f in ("peak_tflops", "memory_gb", "memory_bw_gbs", "intra_node_gbs",
                  "inter_node_gbs", "matmul_efficiency", "link_efficiency",
                  "gather_efficiency"):
            value = getattr(self, f)
            if not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"hardware.{f}", value, "must be a positive number")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ConfigError("hardware.gpus_per_node", self.gpus_per_node,
                              "must be a positive integer")
        for f in ("cores", "calibrated_micro_batch"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 0):
                raise ConfigError(f"hardware.{f}", getattr(self, f), "must be an integer >= 0")
        if not 0.0 <= self.dp_overlap <= 1.0:
            raise ConfigError("hardware.dp_overlap", self.dp_overlap, "must be in [0, 1]")
        for f in ("intra_node_alpha_us", "inter_node_alpha_us", "op_overhead_us",
                  "optimizer_tensor_us", "zero_unit_us", "zero_unit_passes", "ddp_tensor_us",
                  "ddp_copy_passes", "elementwise_passes", "jitter", "jitter_fixed_us",
                  "jitter_rate", "matmul_tail_us", "eager_elementwise_passes"):
            if getattr(self, f) is not None and getattr(self, f) < 0:
                raise ConfigError(f"hardware.{f}", getattr(self, f), "must be >= 0")

    @property
    def cpu_ranks(self) -> bool:
        """Ranks compute on CPU cores (a calibrated CPU machine: ``cores`` > 0), not one
        accelerator each."""
        return self.cores > 0

    def for_precision(self, precision: str) -> Hardware:
        """This hardware as a run in `precision` computes on it: in fp32, matrix multiplies
        and attention at fp32_tflops (where given) instead of the 16-bit peak."""
        if precision != "fp32" or self.fp32_tflops is None:
            return self
        return dataclasses.replace(self, peak_tflops=self.fp32_tflops, attention_tflops=None)

    # -- derived rates, SI units ----------------------------------------------------------------
    @property
    def matmul_flops(self) -> float:
        """Achieved FLOP/s of large matrix multiplies."""
        return self.peak_tflops * 1e12 * self.matmul_efficiency

    def gemm_time(self, flops: float) -> float:
        """Seconds of one matrix multiply of `flops` FLOPs (matmul_tail_us)."""
        return flops / self.matmul_flops + self.matmul_tail_us * 1e-6

    @property
    def attention_flops(self) -> float:
        if self.attention_tflops is not None:
            return self.attention_tflops * 1e12
        return self.matmul_flops

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def memory_bw(self) -> float:
        return self.memory_bw_gbs * 1e9

    def link(self, intra_node: bool) -> Link:
        """The α–β parameters of the intra-node or the inter-node link."""
        if intra_node:
            return Link(alpha=self.intra_node_alpha_us * 1e-6,
                        bandwidth=self.intra_node_gbs * 1e9 * self.link_efficiency,
                        gather_efficiency=self.gather_efficiency)
        return Link(alpha=self.inter_node_alpha_us * 1e-6,
                    bandwidth=self.inter_node_gbs * 1e9 * self.link_efficiency,
                    gather_efficiency=self.gather_efficiency)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Link:
    """α–β parameters of one link class: seconds per message step, achieved bytes per second."""

    alpha: float
    bandwidth: float
    gather_efficiency: float = 1.0
    """All-gather and reduce-scatter speed relative to the ring form (Hardware's field)."""

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth


def _dgx(name: str, sheet: str, peak: float, fp32: float, mem: float, memory: str, bw: float,
         nvlink: float, ib: float, system: str) -> Hardware:
    """A catalog GPU in an 8-GPU node; its source names the data sheet and the node's guide,
    with the figures taken from them (nvlink is one direction: half the sheet's figure)."""
    source = (f"{sheet} data sheet ({peak:g} TFLOP/s dense 16-bit tensor, {fp32:g} fp32, "
              f"{mem:g} GB {memory} at {bw:g} GB/s, NVLink {2 * nvlink:g} GB/s bidirectional); "
              f"{system}")
    return Hardware(name=name, peak_tflops=peak, fp32_tflops=fp32, memory_gb=mem,
                    memory_bw_gbs=bw, intra_node_gbs=nvlink, inter_node_gbs=ib, gpus_per_node=8,
                    matmul_tail_us=MATMUL_TAIL_US, eager_elementwise_passes=EAGER_PASSES_GPU,
                    source=source)


CATALOG: dict[str, Hardware] = {
    h.name: h for h in (
        _dgx("V100", "V100 SXM2", 125.0, 15.7, 32.0, "HBM2", 900.0, 150.0, 6.25,
             "DGX-1: 4x100 Gb/s EDR per 8 GPUs"),
        _dgx("A100-40GB", "A100", 312.0, 19.5, 40.0, "HBM2", 1555.0, 300.0, 25.0,
             "DGX A100: one 200 Gb/s HDR adapter per GPU"),
        _dgx("A100-80GB", "A100", 312.0, 19.5, 80.0, "HBM2e", 2039.0, 300.0, 25.0,
             "DGX A100: one 200 Gb/s HDR adapter per GPU"),
        _dgx("H100-SXM", "H100 SXM", 989.0, 67.0, 80.0, "HBM3", 3350.0, 450.0, 50.0,
             "DGX H100: one 400 Gb/s NDR adapter per GPU"),
        _dgx("H200", "H200 SXM", 989.0, 67.0, 141.0, "HBM3e", 4800.0, 450.0, 50.0,
             "DGX H200: one 400 Gb/s NDR adapter per GPU"),
    )
}
ALIASES = {"A100": "A100-80GB", "H100": "H100-SXM"}
CALIBRATED = Path("runs/local_hardware.toml")
"""Where ``tessera plan calibrate`` writes this machine's hardware file by default (two ranks;
git ignores runs/); a training run's summary prices its layout with it."""


def ranks_time_share(cores: int, ranks: int) -> bool:
    """Whether `ranks` ranks on one machine with `cores` CPU cores take turns on them: more
    ranks than cores. Never for devices (``cores`` 0: a GPU each)."""
    return 0 < cores < ranks


def calibrated_path(ranks: int, default: Path = CALIBRATED) -> Path:
    """The hardware file of a calibration with `ranks` processes measuring at once, beside
    `default` (the two-rank file): `default` itself for 2 ranks or fewer, else
    ``local_hardware_<ranks>.toml``. ``tessera plan calibrate --ranks N`` writes there, and a
    training run on N CPU ranks reads there first: the collectives' α and β, the jitter and,
    with more ranks than cores, the time-shared rates all depend on the rank count."""
    if ranks <= 2:
        return default
    return default.with_name(f"{default.stem}_{ranks}{default.suffix}")


def known_hardware() -> list[str]:
    return sorted(CATALOG) + sorted(ALIASES)


def load_hardware(name_or_file: str | Path) -> Hardware:
    """A catalog entry by name (case-insensitive), or a TOML/YAML hardware file."""
    text = str(name_or_file)
    by_lower = {k.lower(): v for k, v in CATALOG.items()}
    by_lower.update({k.lower(): CATALOG[v] for k, v in ALIASES.items()})
    if text.lower() in by_lower:
        return by_lower[text.lower()]
    path = Path(text)
    if not path.is_file():
        raise ConfigError("--hardware", text, f"unknown hardware and not a file; known: "
                          f"{', '.join(known_hardware())}")
    return hardware_from_dict(_read_table(path), str(path))


def hardware_from_dict(raw: dict[str, Any], where: str = "hardware") -> Hardware:
    raw = dict(raw.get("hardware", raw))
    known = {f.name for f in fields(Hardware)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"hardware.{key}", raw[key],
                              f"unknown field in {where}; known: {', '.join(sorted(known))}")
    raw.setdefault("name", Path(where).stem)
    try:
        return Hardware(**raw)
    except TypeError as e:  # a required field is missing
        raise ConfigError("hardware", where, str(e).split(": ", 1)[-1]) from None


def _read_table(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else load_yaml(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError("file", str(path), f"cannot be parsed: {e}".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise ConfigError("file", str(path), "must hold a table of fields")
    return raw


def save_hardware(hw: Hardware, path: str | Path) -> Path:
    """Write `hw` as a flat TOML table (strings quoted, numbers as they are)."""
    path = Path(path)
    lines = []
    for key, value in hw.to_dict().items():
        if isinstance(value, str):
            escaped = value.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{key} = "{escaped}"')
        elif isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        else:
            lines.append(f"{key} = {value!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def replace(hw: Hardware, **changes: Any) -> Hardware:
    return dataclasses.replace(hw, **changes)
