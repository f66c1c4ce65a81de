"""The hardware the planner reasons about: one accelerator kind, its node and its links.

A :class:`Hardware` is everything the cost model needs about a device: the dense 16-bit peak
FLOP/s (never the 2:4-sparse figure vendors also print), memory size and bandwidth, the per-GPU
bandwidth of the intra-node link (NVLink/NVSwitch) and of the inter-node link (InfiniBand),
with a per-message latency for each, and how many devices share a node.

Communication follows the α–β (Hockney) model: moving ``n`` bytes in one message step costs
``α + n·β`` with ``β = 1 / (bandwidth · link_efficiency)``; collectives are sums of such steps
(see :mod:`tessera.planner.cost`). The same form is used by ``tessera.collectives`` for the
collectives it measures; :func:`tessera.planner.local.calibrate.calibrate` writes the α and β it
measures on this machine into a hardware file, with what ranks on one machine's CPU cores add
(time-sharing, stragglers, tessera's own data-parallel work): a
:class:`~tessera.planner.local.terms.LocalTerms` in ``Hardware.local``, None for the catalog's
GPUs, whose fields the file holds as flat keys beside the others.

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

from tessera.config_io import load_yaml
from tessera.errors import ConfigError
from tessera.planner.local.terms import (
    GPU_TERMS,
    LOCAL_KEYS,
    LocalTerms,
    local_terms,
    terms_from_flat,
)

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
# The host's seconds per kernel of an eager PyTorch step on a GPU: the Python call, autograd's
# graph, the dispatcher and the CUDA launch (cudaLaunchKernel alone ~3-5 µs). Timed as a
# tiny block's eager forward + backward over its kernels (calibrate's launch_cost): 16 µs per
# kernel on this project's CPU hosts in fp32, where the kernels themselves are nil, 28 µs in
# bf16; an H100 ran the demo model's step (~540 kernels of blocks and head and 84 of its
# zero_grad, norm, clipping and AdamW, by planner.kernels) in 19 ms
# (benchmarks/results/gpu_h100.txt): at most 31 µs each. Launches only bound a stretch whose
# kernels are shorter than them (kernels module): the blocks' forwards and backwards, and the
# optimizer's step (planner.state.optimizer_step_time).
LAUNCH_US_GPU = 20.0
LINK_EFFICIENCY = 0.8
FILE_KEYS = ("name", "peak_tflops", "memory_gb", "memory_bw_gbs", "intra_node_gbs",
             "inter_node_gbs", "gpus_per_node", "intra_node_alpha_us", "inter_node_alpha_us",
             "p2p_alpha_us", "p2p_gbs", "matmul_efficiency", "matmul_tail_us",
             "attention_tflops", "link_efficiency", "gather_efficiency", "op_overhead_us",
             "optimizer_tensor_us", "zero_unit_us", "zero_unit_passes", "ddp_tensor_us",
             "ddp_copy_passes", "elementwise_passes", "fp32_tflops", "eager_elementwise_passes",
             "launch_us", "compiled_elementwise_passes", "cores", "jitter", "jitter_fixed_us",
             "jitter_rate", "dp_overlap",
             "calibrated_micro_batch", "source")
"""A hardware file's keys, in the order ``save_hardware`` writes them: Hardware's fields with
its LocalTerms' among them."""


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
    op_overhead_us: float = 0.0
    """Fixed cost per kernel (launch, dispatch): negligible on GPUs at these sizes, but
    dominant for small models on a CPU, where calibrate measures it."""
    elementwise_passes: float = 2.0
    """Times a memory-bound kernel moves each stored activation byte in a forward pass: 2 (one
    write, one read) with fused kernels as in Megatron-LM; calibrate measures tessera's
    unfused reference block."""
    fp32_tflops: float | None = None
    """Dense fp32 peak TFLOP/s of one device without tensor cores: what an fp32 run's matrix
    multiplies get under PyTorch's default (TF32 off). A workload in fp32 is priced at it
    (:meth:`for_precision`). None: peak_tflops (a calibrated machine measures in fp32)."""
    launch_us: float = 0.0
    """Host seconds (µs) to issue one kernel to an asynchronous device in an eager step: a
    stretch of k kernels takes at least k · launch_us (:mod:`tessera.planner.kernels`). The
    catalog GPUs: LAUNCH_US_GPU; calibrate measures it (a tiny block's eager forward and
    backward over its kernels). 0: launches are free."""
    compiled_elementwise_passes: float | None = None
    """Passes of a compiled block's memory-bound kernels over the activation bytes (each fused
    run reads its inputs and writes its outputs once), priced for ``Workload.kernels``
    'compiled'; None: elementwise_passes (the catalog's fused count, 2). Calibrate measures
    it where torch.compile runs."""
    eager_elementwise_passes: float | None = None
    """The same for tessera's own unfused block where it differs from elementwise_passes
    (the catalog GPUs, whose elementwise_passes are fused kernels'): what a workload that
    tessera's engine runs (``Workload.tessera_engine``) is priced with. None: a calibrated
    machine, whose elementwise_passes were measured on tessera's block."""
    local: LocalTerms | None = None
    """What ranks that compute on one machine's CPU cores add (:mod:`tessera.planner.local`):
    None for the catalog's GPUs; a hardware file holds its fields as flat keys."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        if self.fp32_tflops is not None and not self.fp32_tflops > 0:
            raise ConfigError("hardware.fp32_tflops", self.fp32_tflops,
                              "must be a positive number")
        for f in ("peak_tflops", "memory_gb", "memory_bw_gbs", "intra_node_gbs",
                  "inter_node_gbs", "matmul_efficiency", "link_efficiency"):
            value = getattr(self, f)
            if not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"hardware.{f}", value, "must be a positive number")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ConfigError("hardware.gpus_per_node", self.gpus_per_node,
                              "must be a positive integer")
        for f in ("intra_node_alpha_us", "inter_node_alpha_us", "op_overhead_us",
                  "elementwise_passes", "matmul_tail_us", "eager_elementwise_passes",
                  "launch_us", "compiled_elementwise_passes"):
            if getattr(self, f) is not None and getattr(self, f) < 0:
                raise ConfigError(f"hardware.{f}", getattr(self, f), "must be >= 0")
        if self.local == GPU_TERMS:  # the GPU values: no local terms
            object.__setattr__(self, "local", None)

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
        alpha_us, gbs = ((self.intra_node_alpha_us, self.intra_node_gbs) if intra_node
                         else (self.inter_node_alpha_us, self.inter_node_gbs))
        return Link(alpha=alpha_us * 1e-6, bandwidth=gbs * 1e9 * self.link_efficiency,
                    gather_efficiency=local_terms(self).gather_efficiency)

    def to_dict(self) -> dict[str, Any]:
        """The hardware file's flat fields (the local terms beside the others, the GPU values
        where there are none), in FILE_KEYS order; None values left out."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "local"}
        terms = local_terms(self)
        flat.update((k, getattr(terms, k)) for k in LOCAL_KEYS)
        return {k: flat[k] for k in FILE_KEYS if flat[k] is not None}


@dataclass(frozen=True)
class Link:
    """α–β parameters of one link class: seconds per message step, achieved bytes per second."""

    alpha: float
    bandwidth: float
    gather_efficiency: float = 1.0
    """All-gather and reduce-scatter speed relative to the ring form (``LocalTerms``)."""

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
                    launch_us=LAUNCH_US_GPU, source=source)


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
    """The Hardware of a file's flat table (FILE_KEYS; the LocalTerms keys go into ``local``)."""
    raw = dict(raw.get("hardware", raw))
    known = set(FILE_KEYS)
    for key in raw:
        if key not in known:
            raise ConfigError(f"hardware.{key}", raw[key],
                              f"unknown field in {where}; known: {', '.join(sorted(known))}")
    raw.setdefault("name", Path(where).stem)
    try:
        rest, local = terms_from_flat(raw)
        return Hardware(**rest, local=local)
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
    """`hw` with `changes`, which may name the local terms' fields as a file does."""
    mine = {k: changes.pop(k) for k in list(changes) if k in LOCAL_KEYS}
    if mine:
        changes["local"] = dataclasses.replace(local_terms(hw), **mine)
    return dataclasses.replace(hw, **changes)
