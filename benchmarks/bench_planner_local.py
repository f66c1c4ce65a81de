"""Local truth for the planner: predicted vs measured step time of layouts tessera can run here.

    flock /tmp/tessera-bench.lock python benchmarks/bench_planner_local.py \
        [--steps 16] [--rounds 2] [--hardware FILE] [--hardware4 FILE]
        [--hardware-b2 FILE] [--hardware4-b2 FILE] [--only NAME ...]
        [--overlap-only | --steps-only] [--blocks 24] [--from-json FILE [--measure-missing]]
        [--out benchmarks/results/planner_local.txt]

1. ``tessera plan calibrate`` measures this machine at the demo model's shapes, with 2 ranks
   and with 4 (unless --hardware / --hardware4 give earlier calibrations), and writes
   benchmarks/results/local_hardware.toml and local_hardware_4.toml; each row is predicted
   with the calibration of its rank count.
2. For each layout that this build's engines support (``tessera.layout.validate``), the
   planner predicts the step time of the demo preset (fp32, micro-batch b, m micro-batches).
3. ``tessera train --preset demo --nproc N ...`` runs it on the real corpus (prepared with
   ``tessera data prepare --out data/stdlib``); the measured step time is the median over all
   steps after the second, pooled over --rounds runs taken alternately with the other layouts.
4. It prints predicted, measured and the error, and the target: within ±25%.
5. For the DDP and ZeRO-3 rows (OVERLAP_ROWS) it measures what data parallelism costs the step,
   with its control inside the same run (``benchmarks/dp_cost.py``): the N ranks hold the
   layout and a one-rank copy each (no collectives: N independent runs), and alternate blocks
   of steps of the two; the median over pairs of (DP step - control step) is the measured cost,
   against the planner's: its step for the layout minus its step for the control (one rank
   alone, times ranks/cores where ranks time-share the cores), with the link rates and jitter
   that same run measured (``inrun_hardware``) and, beside it, with the calibration file
   alone. Target ±15% (OVERLAP_TARGET). Beside it, the exposed DP communication the runtime
   timestamps (``comm_wait_s``: the seconds the compute thread blocked on DP collective
   handles). ``--overlap-only`` runs just these rows; every pair is saved as JSON beside
   --out, and ``--from-json`` prints the table again from it (with the run's calibration
   files, ``--hardware`` and ``--hardware4``, and ``--hardware-b2`` and ``--hardware4-b2``
   where the run had them); it measures nothing unless ``--measure-missing`` asks it to
   measure the rows the file lacks (before that flag it measured them silently, beside
   whatever else the machine was running). The overlap rows at micro-batch 2 are predicted with
   calibrations at micro-batch 2 (local_hardware_b2.toml, local_hardware_4_b2.toml).
   Each row also says how often a prediction equal to its measured median would pass a repeat
   of the run (``dp_cost.repeat_chance``, a bootstrap over the row's builds), and the table
   how many rows such a right prediction would pass on average and how often all of them:
   what the row's noise alone allows, to set the planner's count beside.

There is no PyTorch-native peer here: the thing measured is the planner's prediction, and the
reference is tessera's own measured step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # dp_cost.py, beside this file
TARGET = 0.25


@dataclass
class Case:
    name: str
    nproc: int
    flags: dict[str, object]
    """Extra `tessera train` flags (besides --nproc)."""
    layout: dict[str, object]
    """tessera.planner.workload.Layout fields."""
    micro_batch: int = 16
    microbatches: int = 1
    measured: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    """os.getloadavg()[0] just before each of its runs."""
    paired: object = None
    """dp_cost.PairedResult of the overlap rows: DP steps, control steps, waits."""


CASES = [
    Case("dp=2", 2, {"dp": 2}, dict(dp=2)),
    Case("dp=2, m=2, b=8", 2, {"dp": 2, "microbatches": 2, "micro-batch-size": 8},
         dict(dp=2, micro_batch=8), micro_batch=8, microbatches=2),
    Case("dp=2, zero=1", 2, {"dp": 2, "zero-stage": 1}, dict(dp=2, zero_stage=1)),
    Case("tp=2", 2, {"tp": 2, "dp": 1}, dict(tp=2)),
    Case("tp=2, sp", 2, {"tp": 2, "dp": 1, "sequence-parallel": None},
         dict(tp=2, sequence_parallel=True)),
    Case("pp=2, 1f1b, m=4, b=4", 2,
         {"pp": 2, "dp": 1, "schedule": "1f1b", "microbatches": 4, "micro-batch-size": 4},
         dict(pp=2, schedule="1f1b", micro_batch=4), micro_batch=4, microbatches=4),
    Case("pp=2, gpipe, m=4, b=4", 2,
         {"pp": 2, "dp": 1, "schedule": "gpipe", "microbatches": 4, "micro-batch-size": 4},
         dict(pp=2, schedule="gpipe", micro_batch=4), micro_batch=4, microbatches=4),
    Case("dp=2, full recompute", 2, {"dp": 2, "recompute": "full"},
         dict(dp=2, recompute="full")),
    Case("tp=2, full recompute", 2, {"tp": 2, "dp": 1, "recompute": "full"},
         dict(tp=2, recompute="full")),
    Case("dp=2 x tp=2 (4 ranks)", 4, {"dp": 2, "tp": 2}, dict(dp=2, tp=2)),
    Case("dp=2 x pp=2 (4 ranks)", 4,
         {"dp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 4, "micro-batch-size": 4},
         dict(dp=2, pp=2, schedule="1f1b", micro_batch=4), micro_batch=4, microbatches=4),
    # Data-parallel traffic and its overlap (issue 12): DDP's buckets and ZeRO-3's per-block
    # gathers and reduce-scatters at dp 2 and 4; target ±15% (OVERLAP_TARGET).
    Case("dp=2, zero=3", 2, {"dp": 2, "zero-stage": 3}, dict(dp=2, zero_stage=3)),
    Case("dp=4 (4 ranks)", 4, {"dp": 4}, dict(dp=4)),
    Case("dp=4, zero=3 (4 ranks)", 4, {"dp": 4, "zero-stage": 3}, dict(dp=4, zero_stage=3)),
]
# The same four at micro-batch 2: compute per step shrinks 8x, so the collectives are a
# large share of the step (and ZeRO-3's gathers no longer hide behind one block's compute).
CASES += [
    Case("dp=2, b=2", 2, {"dp": 2, "micro-batch-size": 2}, dict(dp=2), micro_batch=2),
    Case("dp=2, zero=3, b=2", 2, {"dp": 2, "zero-stage": 3, "micro-batch-size": 2},
         dict(dp=2, zero_stage=3), micro_batch=2),
    Case("dp=4, b=2 (4 ranks)", 4, {"dp": 4, "micro-batch-size": 2}, dict(dp=4),
         micro_batch=2),
    Case("dp=4, zero=3, b=2 (4)", 4, {"dp": 4, "zero-stage": 3, "micro-batch-size": 2},
         dict(dp=4, zero_stage=3), micro_batch=2),
]
OVERLAP_ROWS = ("dp=2", "dp=2, zero=3", "dp=4 (4 ranks)", "dp=4, zero=3 (4 ranks)",
                "dp=2, b=2", "dp=2, zero=3, b=2", "dp=4, b=2 (4 ranks)",
                "dp=4, zero=3, b=2 (4)")
CASES.append(Case("dp=1", 1, {"dp": 1}, dict(dp=1)))
OVERLAP_TARGET = 0.15
AA_ROWS = {16: "A/A: dp=2 ranks, b=16, two one-rank models",
           2: "A/A: dp=2 ranks, b=2, two one-rank models"}
"""The paired method run with a second one-rank model in place of the DP model
(dp_cost.measure_paired(same=True)), at both micro-batches of the overlap rows: what it
measures as a "DP cost" is its own bias."""


def workload_and_layout(case: Case, hw_path) -> tuple:
    """The planner's view of `case`: the demo preset in fp32 on case.nproc ranks (`hw_path`: a
    hardware file, or a Hardware)."""
    from tessera.planner.hardware import Hardware, load_hardware
    from tessera.planner.models import load_model
    from tessera.planner.workload import Layout, Workload

    layout = Layout(**{"micro_batch": case.micro_batch, **case.layout})
    hw = hw_path if isinstance(hw_path, Hardware) else load_hardware(hw_path)
    w = Workload(model=load_model("demo"), hardware=hw, gpus=case.nproc,
                 global_batch=case.micro_batch * case.microbatches * layout.dp, seq_len=128,
                 precision="fp32")
    return w, layout


def supported(case: Case, hw_path: str) -> str | None:
    """Why this build cannot run `case`, or None: the planner's check, which for the demo
    preset is tessera's own (``tessera.layout.validate``)."""
    from tessera.planner.rules import check_layout

    return check_layout(*workload_and_layout(case, hw_path))


def predict(case: Case, hw_path: str) -> float:
    from tessera.planner.estimate import estimate

    return estimate(*workload_and_layout(case, hw_path)).step_time


def predict_exposed_dp(case: Case, hw_path: str) -> float:
    """The planner's exposed data-parallel communication per step (its breakdown's
    dp_exposed: all-reduce buckets, ZeRO gathers and reduce-scatters compute did not hide)."""
    from tessera.planner.estimate import estimate

    return estimate(*workload_and_layout(case, hw_path)).breakdown()["dp_exposed"]


def idle_fraction(seconds: float = 2.0) -> float:
    """Fraction of this machine's CPU time that was idle over the next `seconds` (/proc/stat)."""
    def sample() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, total

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet(limit_s: float, threshold: float = 0.9) -> float:
    """Wait (up to `limit_s`) until at least `threshold` of the CPU time is idle: other jobs
    on this shared 2-core machine slow a run by 30-60%. Returns the idle fraction when the
    wait ended. (The load average would also count the run that just finished.)"""
    deadline = time.monotonic() + limit_s
    idle = idle_fraction()
    while idle < threshold and time.monotonic() < deadline:
        idle = idle_fraction()
    return idle


def measure(case: Case, steps: int, data: str) -> list[dict]:
    """Per-step records of one `tessera train` run (all ranks' steps end together; rank 0's
    metrics.jsonl: step_s, comm_wait_s, compute_s), without the first two steps."""
    from tessera.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "tessera", "train", "--preset", "demo", "--nproc",
               str(case.nproc), "--steps", str(steps), "--data", data, "--out", str(out),
               "--no-progress", "--set", "train.eval_interval=0", "--set",
               "train.sample_tokens=0", "--set", "data.val_tokens=4096"]
        for key, value in case.flags.items():
            cmd += [f"--{key}"] + ([] if value is None else [str(value)])
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{case.name}: tessera train failed:\n{proc.stderr[-2000:]}")
        return [r for r in read_metrics(out / "metrics.jsonl") if "step_s" in r][2:]


def predict_cost(case: Case, hw_path: str) -> float:
    """The planner's DP cost of `case`: its step minus the control's, one rank alone at the
    same micro-batch, times ranks/cores where the N ranks time-share fewer cores (what N
    independent runs at once take; the planner's own rule, ``terms.shared_cpu_bound``)."""
    from tessera.planner.hardware import Hardware, load_hardware
    from tessera.planner.local.terms import local_terms

    control = Case("control", 1, {}, dict(dp=1), micro_batch=case.micro_batch)
    hw = hw_path if isinstance(hw_path, Hardware) else load_hardware(hw_path)
    cores = local_terms(hw).cores or case.nproc
    sharing = max(1.0, case.nproc / cores)
    return predict(case, hw_path) - sharing * predict(control, hw_path)


SMALL_SHARE_BLOCKS = 4
"""How many times the blocks an overlap row gets where DP is a small share of the step (DDP
at micro-batch 16: 3-7% of a 400-1000 ms step). The 95% interval of a median narrows as
1/√pairs, and at 72 pairs these rows' intervals were -60%/+40% of the cost, too wide to say
whether a prediction is within ±15%."""


def row_blocks(case: Case, blocks: int) -> int:
    """Blocks of 4 steps for an overlap row: `blocks`, or SMALL_SHARE_BLOCKS times that for
    DDP at micro-batch 16."""
    ddp = int(case.flags.get("zero-stage", 0)) == 0
    return blocks * (SMALL_SHARE_BLOCKS if ddp and case.micro_batch >= 16 else 1)


BLOCKS_PER_BUILD = 2
"""Measured blocks per build of the two models (dp_cost.py's rebuilds = blocks / this). A
build's pairs share the seconds they ran in, and the host's speed moves for seconds at a time
(A/A runs of 12 and 24 builds at micro-batch 16: the medians of single builds ranged -73 to
+161 ms on a ~490 ms step, their spread well beyond the pairs' own noise; first read as where a
build's tensors land, but one model run in both places spreads as much: the twenty-second run,
`git show 9c9bd19:docs/planner.md`), so an estimate from the two builds used before carried
that luck as a bias that the interval over pairs did not show (the A/A check read -13.8, -12.8,
+3.0 and +12.7 ms in four runs, the last with [4.1, 23.3]); with 12-24 builds, the interval
over builds (dp_cost.median_interval) held 0 in four A/A runs of four. With a warm-up block per
build, 2 measured blocks per build give the narrowest interval for the time."""


def rebuilds_for(blocks: int) -> int:
    """Builds of the two models for `blocks` measured blocks: one per BLOCKS_PER_BUILD, at
    least 2 (so both build orders run)."""
    return max(2, blocks // BLOCKS_PER_BUILD)


def measure_cost(case: Case, blocks: int) -> object:
    """dp_cost.measure_paired for an overlap row (dp = nproc, its ZeRO stage, micro-batch)."""
    from dp_cost import measure_paired

    n = row_blocks(case, blocks)
    return measure_paired(case.nproc, int(case.flags.get("zero-stage", 0)), case.micro_batch,
                          blocks=n, rebuilds=rebuilds_for(n))


def inrun_hardware(hw_path: str, case: Case):
    """The calibration in `hw_path` with the link rates and the jitter the overlap row's own
    run measured (dp_cost.py, in the same minutes as its steps: on this shared machine gloo's
    speed moves by ~40% within the hour, so a calibration taken earlier misprices the
    collectives whatever the overlap model says). From the run: the bandwidth that gives the
    all-reduce of the gradients its measured time in the ring form (α kept from the file), the
    all-gather and reduce-scatter of a unit against that ring form (gather_efficiency, as
    calibrate derives it), and where each rank has a core of its own, the jitter that gives the
    straggler term the measured skew of the control steps (σ = skew / E[max of n normals] at
    T = the control's compute: the file's σ(T) law scaled to it, all its terms alike; a file
    without one gets jitter = σ / √T). What stays the planner's own is the model under test:
    which collectives a step runs, what overlaps what, the bucket copies, the scalar
    reductions."""
    from tessera.planner.hardware import Link, load_hardware, replace
    from tessera.planner.local.links import gather_efficiency, ring_beta
    from tessera.planner.local.terms import expected_max_normal, jitter_sigma, local_terms

    hw, r, n = load_hardware(hw_path), case.paired, case.nproc
    alpha = hw.intra_node_alpha_us * 1e-6
    beta = ring_beta(statistics.median(r.allreduce_s), r.bucket_bytes, n, alpha)
    gbs = 1.0 / beta / 1e9 / hw.link_efficiency
    timed = [(r.unit_bytes, statistics.median(r.allgather_s)),
             (r.unit_bytes, statistics.median(r.reduce_scatter_s))]
    efficiency = gather_efficiency(Link(alpha=alpha, bandwidth=1.0 / beta), n, timed)
    hw = replace(hw, intra_node_gbs=gbs, inter_node_gbs=gbs, gather_efficiency=efficiency)
    if time_shared(case, hw):
        return hw
    compute = statistics.median(r.control_compute_s)
    sigma = statistics.median(r.skew_s) / expected_max_normal(n)
    law = jitter_sigma(hw, compute)
    if law <= 0:
        return replace(hw, jitter=sigma / compute ** 0.5)
    scale = sigma / law
    terms = local_terms(hw)
    return replace(hw, jitter=terms.jitter * scale, jitter_fixed_us=terms.jitter_fixed_us * scale,
                   jitter_rate=terms.jitter_rate * scale)


def time_shared(case: Case, hw) -> bool:
    """Whether the row's ranks take turns on fewer cores (the planner's ``terms.time_shared``)."""
    from tessera.planner.local.terms import local_terms, ranks_time_share

    return ranks_time_share(local_terms(hw).cores, case.nproc)


def measured_cost(case: Case, hw) -> list[float]:
    """Per pair, what DP costs the step as the planner defines its control: N ranks with a
    core each run independently in the time of one (the DP step minus the ranks' mean
    control step: the wait for the slowest is DP's straggler cost); N ranks time-sharing
    fewer cores take all their work over the cores, until the last of them finishes (the DP
    step minus the slowest rank's control step, dp_cost.PairedResult.cost_vs_slowest_s)."""
    r = case.paired
    return r.cost_vs_slowest_s if time_shared(case, hw) else r.cost_s


def interval_verdict(pred: float, lo: float, hi: float) -> str:
    """What a row's 95% interval [lo, hi] of the measured cost says of predicted/measured:
    'shown within' where the whole interval of the ratio (pred/hi .. pred/lo) is within
    ±OVERLAP_TARGET, 'shown outside' where none of it is, else 'unresolved' (the interval is
    wider than the band: the run cannot tell a right prediction from a wrong one)."""
    r_lo = pred / hi if hi > 0 else math.inf
    r_hi = pred / lo if lo > 0 else math.inf
    if 1 - OVERLAP_TARGET <= r_lo and r_hi <= 1 + OVERLAP_TARGET:
        return "shown within"
    if r_hi < 1 - OVERLAP_TARGET or r_lo > 1 + OVERLAP_TARGET:
        return "shown outside"
    return "unresolved"


def overlap_table(cases: list[Case], hw_path_of: Callable[[Case], str]) -> list[str]:
    """What data parallelism costs a step, predicted against measured with the control in the
    same run (dp_cost.py; target ±15%, OVERLAP_TARGET), and the exposed DP communication the
    runtime timestamps (every rank's waits on DP collective handles, averaged)
    against the planner's dp_exposed. Medians over pairs with their 95% intervals."""
    from dp_cost import median_interval, repeat_chance

    if not cases:
        return []
    out = ["", "what data parallelism costs a step: the DP step minus the control step of the "
           "same run (N one-rank models, no collectives; time-shared rows: its slowest rank), "
           "medians over pairs [95% interval]",
           f"{'layout':<24} {'measured ms':>11} {'interval':>13} {'in-run':>7} {'ratio':>6} "
           f"{'file':>6} {'ratio':>6} {'waits':>6} {'interval':>13} {'exposed':>7} "
           f"{'all-red':>7} {'skew':>5} {'slowed':>6} {'hooks':>5} {'chance':>6}"]
    within = within_file = 0
    all_chance, expected = 1.0, 0.0
    verdicts: dict[str, int] = {}
    for c in cases:
        r = c.paired
        inrun = inrun_hardware(hw_path_of(c), c)
        measured = measured_cost(c, inrun)
        cost, lo, hi = median_interval(measured, r.build)
        chance = repeat_chance(measured, r.build, OVERLAP_TARGET)
        all_chance *= chance
        expected += chance
        pred = predict_cost(c, inrun)
        from_file = predict_cost(c, hw_path_of(c))
        waits, wlo, whi = median_interval(r.waits_s, r.build)
        ratio = pred / cost if cost > 0 else math.inf
        within += abs(ratio - 1) <= OVERLAP_TARGET
        within_file += abs(from_file / cost - 1) <= OVERLAP_TARGET
        verdict = interval_verdict(pred, lo, hi)
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
        mark = f"  {verdict}"
        mark += "" if abs(from_file / cost - 1) <= OVERLAP_TARGET else "  <-- file outside ±15%"
        mark += "" if abs(ratio - 1) <= OVERLAP_TARGET else "  <-- in-run outside ±15%"
        out.append(f"{c.name:<24} {1e3 * cost:>11.1f} {1e3 * lo:>6.1f}-{1e3 * hi:<6.1f} "
                   f"{1e3 * pred:>7.1f} {ratio:>6.2f} {1e3 * from_file:>6.1f} "
                   f"{from_file / cost:>6.2f} {1e3 * waits:>6.1f} "
                   f"{1e3 * wlo:>6.1f}-{1e3 * whi:<6.1f} "
                   f"{1e3 * predict_exposed_dp(c, inrun):>7.1f} "
                   f"{1e3 * statistics.median(r.allreduce_s):>7.1f} "
                   f"{1e3 * statistics.median(r.skew_s):>5.1f} "
                   f"{1e3 * statistics.median(r.slowed_compute_s):>6.1f} "
                   f"{f'{1e3 * statistics.median(r.hooks_s):.1f}' if r.hooks_s else '-':>5} "
                   f"{chance:>6.2f}{mark}")
    out.append(f"DP costs within ±15%: {within_file} of {len(cases)} with the calibration file, "
               f"{within} of {len(cases)} with the run's own link rates and jitter")
    out.append("what the intervals can say of the in-run ratio (interval_verdict): "
               + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())))
    out.append(f"how often a right prediction would pass: all {len(cases)} rows in one run "
               f"{all_chance:.2f} (the product of the chance column; rows measured apart); "
               f"rows within ±15% on average {expected:.1f} of {len(cases)} (its sum), "
               f"against the planner's {within} in-run")
    out.append("measured: DP step minus control step (where ranks time-share the cores, "
               "minus the slowest rank's control step: what N independent runs at once take, "
               "the control the planner predicts), median over pairs and its 95% interval; "
               "in-run / file: the planner's step for the layout minus its step for one rank "
               "alone (times ranks/cores when ranks time-share cores), with the link rates and "
               "jitter measured in the row's run (inrun_hardware) / with the calibration file "
               "alone, and predicted / measured; waits: the DP step's waits on collective "
               "handles (tessera.parallel.comm_timing), averaged over the ranks; exposed: the "
               "planner's dp_exposed (in-run rates); all-red: gloo's all-reduce of the "
               "gradients, timed in the run; skew: slowest rank's control step minus the mean; "
               "slowed: the DP step's compute actions minus the control's (DDP's hooks, ZeRO's "
               "copies, collectives' threads on the cores); hooks: of which DDP's gradient hooks "
               "(DataParallel.hook_seconds; - where not recorded); chance: how often a "
               "prediction equal to the measured median would be within ±15% of a repeat "
               "run's median, from a "
               "bootstrap over the row's builds (dp_cost.repeat_chance; optimistic: the "
               "prediction's own inputs are noisy too)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hardware", help="an existing 2-rank calibration (skips calibrate)")
    ap.add_argument("--hardware4", help="an existing 4-rank calibration, for the 4-rank rows "
                    "(default: calibrate with --ranks 4)")
    ap.add_argument("--hardware-b2", help="an existing 2-rank calibration at micro-batch 2, "
                    "for the overlap rows at micro-batch 2 (default: calibrate)")
    ap.add_argument("--hardware4-b2", help="the same with 4 ranks, for the 4-rank overlap rows "
                    "at micro-batch 2 (default: calibrate)")
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--only", nargs="+", help="case names to run (quote each)")
    ap.add_argument("--out", default="benchmarks/results/planner_local.txt")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="seconds to wait for a quiet machine before each run")
    ap.add_argument("--blocks", type=int, default=24,
                    help="blocks of 4 steps of each model per overlap row (dp_cost.py; DDP "
                    "at micro-batch 16 gets SMALL_SHARE_BLOCKS times as many)")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--overlap-only", action="store_true",
                      help="only the overlap rows' DP costs (no tessera train step-time runs)")
    only.add_argument("--steps-only", action="store_true",
                      help="only the step-time table (no DP-cost pairs for the overlap rows)")
    ap.add_argument("--from-json", help="the overlap rows' pairs saved by an earlier run "
                    "(with --overlap-only and its --hardware files: the table again)")
    ap.add_argument("--measure-missing", action="store_true",
                    help="with --from-json: measure the overlap rows the file lacks and add "
                    "them to it (a run cut short, or a row to measure again); without it, "
                    "such rows are left out of the table")
    args = ap.parse_args()
    if args.from_json and (args.hardware is None or args.hardware4 is None):
        # without them the run would calibrate again, over the tracked calibration files
        ap.error("--from-json reprints a saved run's table: give the calibration files it "
                 "used, --hardware and --hardware4 (the run's .txt holds them in its header)")

    subprocess.run([sys.executable, "-m", "tessera", "data", "prepare", "--out", args.data,
                    "--if-missing"], cwd=ROOT, check=True, capture_output=True)
    lines = [f"# bench_planner_local.py, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
             f"(each run waits for idle CPUs: see the idle column)"]
    # The machine is calibrated as each run uses it: 2 ranks at once for the 2-rank rows, 4
    # (time-sharing the 2 cores) for the 4-rank rows (``plan calibrate --ranks``), at
    # micro-batch 16, and for the overlap rows at micro-batch 2 at that micro-batch: the cost
    # of DDP's gradient hooks per byte depends on it (``calibrate.ddp_copy_passes``: what
    # the hooks add to the backward is ~40% as much at micro-batch 2 as at 16 for the same
    # gradients).
    # A saved run (--from-json) without micro-batch-2 files is priced as it ran before them,
    # with the micro-batch-16 ones.
    given = {(2, 16): args.hardware, (4, 16): args.hardware4,
             (2, 2): args.hardware_b2, (4, 2): args.hardware4_b2}
    small = args.steps_only or (args.only and not any(
        c.name in OVERLAP_ROWS and c.micro_batch == 2 for c in CASES if c.name in args.only))
    for (ranks, b), name in (((2, 16), "local_hardware.toml"), ((4, 16), "local_hardware_4.toml"),
                             ((2, 2), "local_hardware_b2.toml"),
                             ((4, 2), "local_hardware_4_b2.toml")):
        if given[ranks, b] is None:
            if b != 16 and (args.from_json or small):
                given[ranks, b] = given[ranks, 16]
                continue
            given[ranks, b] = str(ROOT / "benchmarks/results" / name)
            wait_for_quiet(args.quiet_wait)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tessera", "plan", "calibrate", "--model",
                            "demo", "--micro-batch", str(b), "--ranks", str(ranks), "--out",
                            given[ranks, b]], cwd=ROOT, check=True, capture_output=True)
            lines.append(f"# calibrated {ranks} ranks at micro-batch {b} in "
                         f"{time.perf_counter() - t0:.1f} s -> {given[ranks, b]}")
        lines.append(f"# {ranks}-rank calibration" + (f" at micro-batch {b}:" if b != 16
                                                        else ":"))
        lines.append("# " + Path(given[ranks, b]).read_text().replace("\n", "\n# ")
                     .rstrip("# "))

    def hw_path_of(case: Case) -> str:
        """The row's calibration: its rank count, and for the overlap rows its micro-batch."""
        b = 2 if case.name in OVERLAP_ROWS and case.micro_batch == 2 else 16
        return given[4 if case.nproc > 2 else 2, b]

    cases = [c for c in CASES if not args.only or c.name in args.only]
    runnable = []
    for c in cases:
        if args.overlap_only and c.name not in OVERLAP_ROWS:
            continue
        why = supported(c, hw_path_of(c))
        if why:
            lines.append(f"# skipped {c.name}: {why}")
        else:
            runnable.append(c)
    for r in range(0 if args.overlap_only else args.rounds):
        for c in (runnable if r % 2 == 0 else reversed(runnable)):
            idle = wait_for_quiet(args.quiet_wait)
            c.idle.append(idle)
            c.load.append(os.getloadavg()[0])
            records = measure(c, args.steps, args.data)
            c.measured += [r["step_s"] for r in records]
            print(f"round {r + 1}: {c.name}: median so far "
                  f"{statistics.median(c.measured):.3f} s ({100 * idle:.0f}% idle at start)",
                  flush=True)

    # The DP cost of the overlap rows, control in the same run; every pair is kept in a JSON
    # file beside --out (--from-json prints the table again from it).
    from dp_cost import PairedResult, summary

    raw_path = Path(args.from_json or Path(args.out).with_suffix(".json"))
    raw = json.loads(raw_path.read_text()) if args.from_json else {}
    for c in runnable:
        if c.name not in OVERLAP_ROWS or args.steps_only:
            continue
        if c.name not in raw:
            if args.from_json and not args.measure_missing:
                lines.append(f"# {c.name}: not in {raw_path} (--measure-missing measures it)")
                continue
            wait_for_quiet(args.quiet_wait)
            raw[c.name] = measure_cost(c, args.blocks).to_dict()
            raw_path.write_text(json.dumps(raw))
        c.paired = PairedResult(**raw[c.name])
        print(f"paired: {c.name}:\n  " + "\n  ".join(summary(c.paired)), flush=True)
    aa = {}
    if any(c.name in OVERLAP_ROWS for c in runnable) and not args.steps_only:
        from dp_cost import measure_paired

        for b, name in AA_ROWS.items():
            if name not in raw and args.from_json and not args.measure_missing:
                continue  # a file saved before this A/A row was run
            if name not in raw:
                wait_for_quiet(args.quiet_wait)
                raw[name] = measure_paired(2, 0, b, blocks=args.blocks, same=True,
                                           rebuilds=rebuilds_for(args.blocks)).to_dict()
                raw_path.write_text(json.dumps(raw))
            aa[name] = PairedResult(**raw[name])

    head = (f"{'layout':<24} {'predicted s':>11} {'measured s':>10} {'spread':>13} "
            f"{'error':>7} {'idle':>5}")
    table = [head]
    errors = []
    for c in runnable:
        if not c.measured:
            continue
        pred = predict(c, hw_path_of(c))
        meas = statistics.median(c.measured)
        q = statistics.quantiles(c.measured, n=4)
        err = pred / meas - 1
        errors.append(err)
        mark = "" if abs(err) <= TARGET else "  <-- outside ±25%"
        if c.name in OVERLAP_ROWS and abs(err) > OVERLAP_TARGET:
            mark = "  <-- outside ±15% (DP/ZeRO overlap row)"
        table.append(f"{c.name:<24} {pred:>11.3f} {meas:>10.3f} {q[0]:>6.3f}-{q[2]:<6.3f} "
                     f"{100 * err:>+6.1f}% {100 * min(c.idle):>4.0f}%{mark}")
    within = sum(abs(e) <= TARGET for e in errors)
    table.append(f"{within} of {len(errors)} layouts within ±25% (target: at least 4, covering "
                 f"dp, tp, pp and a mix)")
    table.append("spread: interquartile range of the measured steps; idle: the lowest idle "
                 "share of the CPUs just before one of its runs started")
    if errors:
        lines += table
    lines += overlap_table([c for c in runnable if c.paired is not None], hw_path_of)
    for name, r in aa.items():
        from dp_cost import median_interval

        bias, lo, hi = median_interval(r.cost_s, r.build)
        step = statistics.median(r.control_s)
        builds = f" in {len(set(r.build))} builds" if r.build else ""
        lines.append(f"A/A check ({name}): {1e3 * bias:.1f} ms [{1e3 * lo:.1f}, {1e3 * hi:.1f}] "
                     f"on a {1e3 * step:.0f} ms step (0 if the method has no bias; its interval "
                     f"is what {len(r.cost_s)} pairs{builds} can resolve)")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
