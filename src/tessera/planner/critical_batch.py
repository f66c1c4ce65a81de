"""The critical batch: what a larger batch costs in samples, and the time/cost frontier it makes.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", §2): to reach a given
loss, training at global batch B needs S = S_min·(1 + B/B_crit) samples, where S_min is what
a small batch needs and B_crit ≈ the gradient noise scale (``noise_scale`` in a run's
metrics.jsonl). With ``--tokens T`` the small-batch minimum is S_min = T/s sequences (s the
sequence length), so a run at batch B reads T·(1 + B/B_crit) tokens.

On N GPUs at batch B = β·N (β sequences per GPU) with the best layout's step time t(N, B):

    steps = S/B,   time = steps · t,   cost = N · time (GPU-hours).

Since t = B·s·F / (N·peak·U) (F FLOPs per token, U the layout's MFU), cost ∝ (1 + β·N/B_crit)
/ U(N, β) and time = cost/N: more GPUs cut the time only while β·N stays below B_crit, and a
smaller β per GPU keeps B small but lowers U (pipeline bubbles, exposed communication). No
plan minimizes both; :func:`frontier` keeps those that no other plan beats on both.

Learning rate: the S(B) model assumes the learning rate suits each batch. ``train.lr_scaling``
(linear: Goyal et al. 2017; sqrt: Malladi et al. 2022) is the rule a run would apply against
``train.reference_batch``, and the plan states the scale it gives at each batch; below B_crit
linear scaling keeps the samples near S_min, above it no learning rate buys the extra samples
back (the warning in :func:`explain`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tessera.errors import ConfigError, UserError
from tessera.layout import check_split_backward
from tessera.pipeline.schedules import SCHEDULES
from tessera.planner.estimate import Estimate, PlanError
from tessera.planner.search import SearchSpace, enumerate_layouts, search
from tessera.planner.workload import Layout, Workload

FAMILIES = ("1F1B", "1F1B + ZeRO-3", "interleaved", "interleaved + ZeRO-3", "breadth-first",
            "breadth-first + ZeRO-3", "zero-bubble")
"""Schedule families of the frontier; a layout without a pipeline (pp = v = 1) counts as 1F1B.
Zero-bubble has no ZeRO-3 variant: tessera refuses ZeRO-3 with a split backward."""
ZERO_BUBBLE = tuple(name for name, spec in SCHEDULES.items() if spec.split_backward)
"""The schedules of the zero-bubble family: those that split each backward into I and W
(zb-h1, zb-v, dualpipev)."""
SCHEDULE_FAMILY = {"1f1b": "1F1B", "interleaved": "interleaved",
                   "interleaved-lean": "interleaved", "bfs": "breadth-first"} | {
                       name: "zero-bubble" for name in ZERO_BUBBLE}
DEFAULT_BETAS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Sequences per GPU tried at every GPU count (B = β·N must be a whole number)."""
MAX_GPU_COUNTS = 6
"""GPU counts tried by default: the powers of two up to --gpus, at most this many."""
SECONDS_PER_HOUR = 3600.0


def samples_needed(tokens: float, seq_len: int, batch: int, b_crit: float) -> float:
    """Sequences to train on at global batch `batch`: S_min·(1 + B/B_crit), S_min = T/s."""
    if not (tokens > 0 and b_crit > 0):
        raise ConfigError("--tokens" if tokens <= 0 else "--critical-batch",
                          tokens if tokens <= 0 else b_crit, "must be positive")
    return tokens / seq_len * (1.0 + batch / b_crit)


def family(L: Layout) -> str | None:
    """The frontier family of layout `L` (None: a schedule outside the families, or a
    zero-bubble schedule under ZeRO-3, which ``layout.check_split_backward`` refuses)."""
    name = "1F1B" if L.pp * L.virtual_stages == 1 else SCHEDULE_FAMILY.get(L.schedule)
    if name is None:
        return None
    if name == "zero-bubble":
        try:
            check_split_backward(L.zero_stage, L.schedule, True)
        except ConfigError:
            return None
        return name
    return f"{name} + ZeRO-3" if L.zero_stage == 3 else name


@dataclass(frozen=True)
class Point:
    """One (GPU count, global batch, family): its best layout and what training takes."""

    family: str
    gpus: int
    batch: int
    best: Estimate
    samples: float
    """Sequences needed, S_min·(1 + B/B_crit)."""

    @property
    def beta(self) -> float:
        return self.batch / self.gpus

    @property
    def steps(self) -> float:
        return self.samples / self.batch

    @property
    def hours(self) -> float:
        return self.steps * self.best.step_time / SECONDS_PER_HOUR

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.hours

    @property
    def mfu(self) -> float:
        return self.best.mfu


@dataclass
class CriticalBatchPlan:
    """Every point of the grid with its family's best layout, and the rules it was made with."""

    workload: Workload
    """The workload at the largest GPU count (model, hardware, sequence, precision)."""
    b_crit: float
    tokens: float
    points: list[Point]
    lr_scaling: str = "none"
    reference_batch: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)
    """(N, B) pairs no layout could run, one line each."""

    def frontier(self, name: str | None = None) -> list[Point]:
        """The Pareto frontier of time against cost (of family `name`, else of all points)."""
        return frontier([p for p in self.points if name is None or p.family == name])

    def at(self, b_crit: float) -> CriticalBatchPlan:
        """The same grid and layouts under another critical batch (only the samples change:
        the layouts do not depend on it)."""
        points = [dataclasses.replace(p, samples=samples_needed(
            self.tokens, self.workload.seq_len, p.batch, b_crit)) for p in self.points]
        return dataclasses.replace(self, b_crit=b_crit, points=points)

    def cheapest(self) -> Point:
        return min(self.points, key=lambda p: (p.gpu_hours, p.hours))

    def fastest(self) -> Point:
        return min(self.points, key=lambda p: (p.hours, p.gpu_hours))

    def lr_scale(self, batch: int) -> float:
        """The learning-rate factor train.lr_scaling gives at `batch` (1 without a rule)."""
        return lr_scale(self.lr_scaling, self.reference_batch, batch)


def lr_scale(rule: str, reference_batch: int, batch: int) -> float:
    """``tessera.optim.scaled``'s factor: k = batch / reference (linear), √k (sqrt), else 1."""
    from tessera.config import TrainConfig
    from tessera.optim import scaled

    _, note = scaled(TrainConfig(lr_scaling=rule, reference_batch=reference_batch), batch)
    return 1.0 if note is None else note["lr_scale"]


def frontier(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both time and cost (ties: the first), by time."""
    kept: list[Point] = []
    for p in sorted(points, key=lambda p: (p.hours, p.gpu_hours)):
        if not kept or p.gpu_hours < kept[-1].gpu_hours:
            kept.append(p)
    return kept


def gpu_counts(most: int) -> list[int]:
    """The default grid of GPU counts: powers of two up to `most` (and `most` itself), the
    largest MAX_GPU_COUNTS of them."""
    counts = sorted({1 << k for k in range(most.bit_length()) if 1 << k <= most} | {most})
    return counts[-MAX_GPU_COUNTS:]


def best_by_family(w: Workload, space: SearchSpace) -> dict[str, Estimate]:
    """Each family's fastest fitting layout at `w` (one enumeration, one bounded search per
    family; a family with nothing that fits is left out)."""
    buckets: dict[str, list[Layout]] = {}
    for L in enumerate_layouts(w, space):
        name = family(L)
        if name is not None:
            buckets.setdefault(name, []).append(L)
    out: dict[str, Estimate] = {}
    for name, layouts in buckets.items():
        try:
            out[name] = search(w, space, top=1, layouts=layouts).best
        except PlanError:  # nothing of this family fits in memory
            continue
    return out


def plan_critical_batch(w: Workload, b_crit: float, tokens: float,
                        counts: Sequence[int] | None = None,
                        betas: Sequence[float] = DEFAULT_BETAS,
                        space: SearchSpace | None = None, lr_scaling: str = "none",
                        reference_batch: int = 0) -> CriticalBatchPlan:
    """Every (N, B = β·N) of the grid: each family's best layout (searched once per pair,
    cached), the samples needed and the resulting time and GPU-hours. `w` gives the model,
    hardware and sequence; its gpus is the largest count of the default grid."""
    samples_needed(tokens, w.seq_len, 1, b_crit)  # refuses non-positive values
    counts = sorted(set(counts or gpu_counts(w.gpus)))
    if min(counts) < 1 or not betas or min(betas) <= 0:
        raise ConfigError("--batch-per-gpu" if counts and min(counts) >= 1 else "--gpu-counts",
                          list(betas) if counts and min(counts) >= 1 else counts,
                          "must be positive")
    space = space or SearchSpace()
    cache: dict[tuple[int, int], dict[str, Estimate]] = {}
    points: list[Point] = []
    skipped: list[str] = []
    fractional: list[str] = []  # GPUs x batch per GPU that is no whole batch
    for n in counts:
        for beta in betas:
            batch = beta * n
            if batch < 1 or abs(batch - round(batch)) > 1e-9:
                fractional.append(f"{n} x {beta:g}")
                continue
            batch = round(batch)
            if (n, batch) not in cache:
                here = dataclasses.replace(w, gpus=n, global_batch=batch)
                try:
                    cache[n, batch] = best_by_family(here, space)
                except PlanError:
                    cache[n, batch] = {}
                if not cache[n, batch]:
                    skipped.append(f"{n} GPUs at batch {batch}: no layout fits")
            for name, est in cache[n, batch].items():
                points.append(Point(family=name, gpus=n, batch=batch, best=est,
                                    samples=samples_needed(tokens, w.seq_len, batch, b_crit)))
    if not points:
        reasons = skipped + ([f"{', '.join(fractional)} (GPUs x batch per GPU): no whole "
                              "batch"] if fractional else [])
        raise PlanError(f"{w.model.name}: no plan at any of {counts} GPUs x batch per GPU "
                        f"{list(betas)} on {w.hardware.name}: {'; '.join(reasons)}; try more "
                        "GPUs, or a batch per GPU that makes whole batches")
    return CriticalBatchPlan(workload=w, b_crit=b_crit, tokens=tokens, points=points,
                             lr_scaling=lr_scaling, reference_batch=reference_batch,
                             skipped=skipped)


# ---------------------------------------------------------------------------------------------
# A run's measured noise scale


def noise_scale_from_run(run_dir: str | Path, seq_len: int) -> tuple[float, str, dict]:
    """(B_crit in sequences of `seq_len` tokens, where it came from, the run's train config as
    a dict, empty if absent) from a run directory's metrics.jsonl: its last record with a
    positive ``noise_scale`` (McCandlish et al.'s B_simple, an estimate of B_crit, in the
    run's sequences). A record that also holds ``noise_scale_tokens`` is converted to this
    plan's sequence length (the noise scale counts tokens when the sequence changes, as
    Kaplan et al. 2020 measure B_crit); config.json's train section gives the lr rule."""
    import json

    from tessera.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError("--from-run", str(run_dir), "has no metrics.jsonl")
    records = [r for r in read_metrics(path) if _positive(r.get("noise_scale"))]
    if not records:
        raise UserError(f"--from-run {run_dir}: metrics.jsonl holds no noise_scale record (the "
                        f"trainer measures it under dp >= 2); give --critical-batch B instead")
    last = records[-1]
    value, where = float(last["noise_scale"]), (f"noise scale {last['noise_scale']:.4g} "
                                                f"sequences at step {last.get('step')} of "
                                                f"{run_dir}")
    if _positive(last.get("noise_scale_tokens")):
        value = float(last["noise_scale_tokens"]) / seq_len
        where += f" ({last['noise_scale_tokens']:.4g} tokens: {value:.4g} x {seq_len})"
    train: dict = {}
    config = Path(run_dir) / "config.json"
    if config.is_file():
        train = json.loads(config.read_text()).get("train", {}) or {}
    return value, where, train


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0
