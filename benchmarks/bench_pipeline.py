"""Pipeline runtime vs torch.distributed.pipelining, same model, same schedules, CPU/gloo.

    flock /tmp/tessera-bench.lock .venv/bin/python benchmarks/bench_pipeline.py

For pp in --pp and each schedule (gpipe, 1f1b, interleaved v=2, bfs v=2) both runtimes train
the same chunks (``tessera.pipeline.partition.Chunk``, identical initial weights) on the same
micro-batches with AdamW, alternating blocks of steps (--pairs pairs). Peers: ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS. Printed per schedule: median step time
of each, the median of the per-pair ratios (ours / torch) with its spread, the measured bubble
fraction of each (from the same timing marks in both: forward by module hooks, backward by
identity autograd functions at the chunk's output and input), the closed-form bubble, CPU
seconds per step summed over ranks, and the final loss of each (they train the same model on
the same data, so they must agree).

Threads: one per rank (tessera.testing.run_ranks). At pp=4 on a 2-core machine the ranks
oversubscribe the cores, so wall time hides bubbles (other ranks fill them); compare CPU time.

``--zero-bubble`` runs the split-backward schedules instead (zb-h1, zb-v, dualpipev) beside
1F1B at the same m, and appends their table to ``--out``: step time and CPU seconds relative to
our 1F1B, the measured bubble from the runtime's own records (its I and W events: torch's
timing marks sit on the input-gradient path and miss W), the simulated bubble at F = I = W
(F = 1, B = 2 for 1F1B), and torch's peer where it has one (Schedule1F1B,
ScheduleInterleavedZeroBubble with one stage per rank, ScheduleZBVZeroBubble,
ScheduleDualPipeV) with the ratio of step times.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from datetime import date

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ModelConfig, TrainConfig
from tessera.model import cross_entropy
from tessera.optim import adamw
from tessera.pipeline.partition import Chunk, partition
from tessera.pipeline.runtime import PipelineRuntime
from tessera.pipeline.schedules import build_schedule, closed_form_bubble
from tessera.testing import run_ranks

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("bfs", 2))
ZB_SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2))


def _zb_peers() -> dict:
    from torch.distributed.pipelining.schedules import (
        ScheduleDualPipeV,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    return {"zb-h1": ScheduleInterleavedZeroBubble, "zb-v": ScheduleZBVZeroBubble,
            "dualpipev": ScheduleDualPipeV}


ZB_PEERS = _zb_peers()


class _Mark(torch.autograd.Function):
    """Identity whose backward records the time: marks where a chunk's backward starts/ends."""

    @staticmethod
    def forward(ctx, x, log, key, copy=False):
        ctx.log, ctx.key = log, key
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.key, time.perf_counter()))
        return grad, None, None, None


class Timed(nn.Module):
    """A chunk with timing marks: forward duration, backward start (grad reaches the output)
    and end (grad reaches the input, or the embedding output on chunk 0)."""

    def __init__(self, chunk: Chunk, log: list, copy_out: bool = False):
        """`copy_out`: the output is a copy, not a view (torch's split backward detaches the
        stage output in place, which a view refuses)."""
        super().__init__()
        self.chunk, self.log, self.copy_out = chunk, log, copy_out
        if chunk.spec.has_embedding:
            chunk.tok_embeddings.register_forward_hook(
                lambda m, i, out: _Mark.apply(out, self.log, "b_end"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if x.is_floating_point():
            x = _Mark.apply(x, self.log, "b_end")
        y = _Mark.apply(self.chunk(x), self.log, "b_start", self.copy_out)
        self.log.append(("f", time.perf_counter() - t0))
        return y


def busy_seconds(log: list) -> float:
    forward = sum(v for k, v in log if k == "f")
    backward = sum(v for k, v in log if k == "b_end") - sum(v for k, v in log if k == "b_start")
    return forward + backward


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_chunks(cfg: ModelConfig, pp: int, v: int, rank: int, seq: int, log: list,
                chunks: list[int] | None = None, copy_out: bool = False):
    """This rank's chunks: `chunks`, or looping placement (c on rank c % pp)."""
    specs = partition(cfg, pp * v, seq)
    mine = range(rank, pp * v, pp) if chunks is None else chunks
    return {c: Timed(Chunk(cfg, specs[c], seed=0), log, copy_out) for c in mine}


def batches(step: int, m: int, mbs: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (m * mbs, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class Ours:
    def __init__(self, cfg, pp, v, m, rank, seq, tcfg, schedule_name, copy_out=False):
        self.log: list = []
        self.schedule = build_schedule(schedule_name, pp, m, v)
        self.chunks = make_chunks(cfg, pp, v, rank, seq, self.log,
                                  self.schedule.chunks_of(rank), copy_out)
        self.records: list = []
        self.runtime = PipelineRuntime(self.chunks, rank, list(range(pp)), None,
                                       torch.device("cpu"), cfg.d_model)
        self.opt = adamw([p for c in self.chunks.values() for p in c.parameters()], tcfg)
        self.m, self.last_loss = m, float("nan")

    def pipeline_step(self, x, y):
        mbs = list(zip(x.tensor_split(self.m), y.tensor_split(self.m), strict=True))
        record = self.runtime.run(self.schedule, mbs, cross_entropy, scale=1.0 / self.m)
        self.records.append((record.start, record.end, record.busy))
        self.last_loss = float(record.loss)


class Torch:
    def __init__(self, cfg, pp, v, m, rank, seq, tcfg, schedule_name, copy_out=False):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        self.log: list = []
        placement = build_schedule(schedule_name, pp, m, v).chunks_of(rank)
        self.chunks = make_chunks(cfg, pp, v, rank, seq, self.log, placement, copy_out)
        stages = [PipelineStage(mod, c, pp * v, torch.device("cpu"))
                  for c, mod in sorted(self.chunks.items())]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
               "interleaved": ScheduleInterleaved1F1B, "bfs": ScheduleLoopedBFS,
               **ZB_PEERS}[schedule_name]
        single = v == 1 and schedule_name != "zb-h1"
        self.schedule = cls(stages[0] if single else stages, n_microbatches=m,
                            loss_fn=cross_entropy)
        self.first = 0 in self.chunks
        self.last = (pp * v - 1) in self.chunks
        self.opt = adamw([p for c in self.chunks.values() for p in c.parameters()], tcfg)
        self.m, self.last_loss = m, float("nan")

    def pipeline_step(self, x, y):
        losses: list = []
        args = (x,) if self.first else ()
        kwargs = dict(target=y, losses=losses) if self.last else {}
        self.schedule.step(*args, **kwargs)
        if self.last:
            self.last_loss = float(sum(loss.detach() for loss in losses)) / self.m


def timed_steps(runner, steps: int, first_step: int, a) -> tuple[list[float], list[float],
                                                                 list[float], list[float]]:
    """Per step: wall time, pipeline-part time, busy compute, CPU seconds (this rank)."""
    walls, pipes, busy, cpus = [], [], [], []
    for step in range(first_step, first_step + steps):
        x, y = batches(step, a.microbatches, a.micro_batch_size, a.seq, a.vocab)
        dist.barrier()
        runner.log.clear()
        c0, t0 = cpu_seconds(), time.perf_counter()
        runner.pipeline_step(x, y)
        t1 = time.perf_counter()
        runner.opt.step()
        runner.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        pipes.append(t1 - t0)
        busy.append(busy_seconds(runner.log))
        cpus.append(cpu_seconds() - c0)
    return walls, pipes, busy, cpus


def bench_rank(a, pp: int):
    rank = dist.get_rank()
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers,
                      n_heads=a.heads, max_seq_len=a.seq)
    tcfg = TrainConfig(lr=1e-3)
    out = []
    for name, v in ZB_SCHEDULES if a.zero_bubble else SCHEDULES:
        ours = Ours(cfg, pp, v, a.microbatches, rank, a.seq, tcfg, name, a.zero_bubble)
        peer = Torch(cfg, pp, v, a.microbatches, rank, a.seq, tcfg, name, a.zero_bubble)
        for runner in (ours, peer):  # warm-up (torch infers shapes on its first step)
            timed_steps(runner, 1, 0, a)
        ours.records.clear()
        rows = {"ours": [], "torch": []}
        step = 1
        for pair in range(a.pairs):
            order = (("ours", ours), ("torch", peer)) if pair % 2 == 0 else \
                (("torch", peer), ("ours", ours))
            for key, runner in order:
                rows[key].append(timed_steps(runner, a.steps, step, a))
            step += a.steps
        out.append(dict(schedule=name, v=v, rows=rows, loss_ours=ours.last_loss,
                        loss_torch=peer.last_loss, records=ours.records))
    return out


def summarize(pp: int, per_rank: list, a) -> list[str]:
    lines = []
    for i, (name, v) in enumerate(SCHEDULES):
        def per_step(key, field, i=i):
            """[pair][step] -> the values of every rank."""
            blocks = [r[i]["rows"][key] for r in per_rank]
            result = []
            for pair in range(a.pairs):
                values = [[blocks[r][pair][field][s] for r in range(pp)] for s in range(a.steps)]
                result.append(values)
            return result

        stats = {}
        for key in ("ours", "torch"):
            wall = [[max(vs) for vs in pair] for pair in per_step(key, 0)]
            pipe = [[max(vs) for vs in pair] for pair in per_step(key, 1)]
            busy = [[max(vs) for vs in pair] for pair in per_step(key, 2)]
            cpu = [[sum(vs) for vs in pair] for pair in per_step(key, 3)]
            flat = lambda xs: [x for block in xs for x in block]  # noqa: E731
            bubbles = [(p - b) / b for p, b in zip(flat(pipe), flat(busy), strict=True)]
            stats[key] = dict(wall=statistics.median(flat(wall)), pairs=[statistics.median(w)
                                                                       for w in wall],
                              bubble=statistics.median(bubbles),
                              cpu=statistics.median(flat(cpu)))
        ratios = [o / t for o, t in zip(stats["ours"]["pairs"], stats["torch"]["pairs"],
                                        strict=True)]
        closed = closed_form_bubble(name, pp, a.microbatches, v)
        last = per_rank[pp - 1][i]  # the rank holding the last chunk has the losses
        lines.append(
            f"{pp:>2} {name:<11} {v:>1} {stats['ours']['wall'] * 1e3:9.1f} "
            f"{stats['torch']['wall'] * 1e3:9.1f} {statistics.median(ratios):6.3f} "
            f"[{min(ratios):.3f}-{max(ratios):.3f}] {stats['ours']['bubble']:7.3f} "
            f"{stats['torch']['bubble']:7.3f} {closed:7.3f} {stats['ours']['cpu']:7.2f} "
            f"{stats['torch']['cpu']:7.2f} {last['loss_ours']:.4f}/{last['loss_torch']:.4f}")
    return lines


def summarize_zero_bubble(pp: int, per_rank: list, a) -> list[str]:
    """One row per schedule of ZB_SCHEDULES (see the module doc); ratios to the first (1F1B)."""
    from tessera.pipeline.simulator import StageCosts, simulate

    rows, base = [], None
    for i, (name, v) in enumerate(ZB_SCHEDULES):
        wall, cpu, pairs = {}, {}, {}
        for key in ("ours", "torch"):
            blocks = [r[i]["rows"][key] for r in per_rank]  # [rank][pair] -> fields
            steps = [(max(blocks[r][p][0][s] for r in range(pp)),
                      sum(blocks[r][p][3][s] for r in range(pp)))
                     for p in range(a.pairs) for s in range(a.steps)]
            wall[key] = statistics.median(w for w, _ in steps)
            cpu[key] = statistics.median(c for _, c in steps)
            pairs[key] = [statistics.median(max(blocks[r][p][0][s] for r in range(pp))
                                            for s in range(a.steps)) for p in range(a.pairs)]
        records = [r[i]["records"] for r in per_rank]  # [rank][step] -> (start, end, busy)
        bubbles = []
        for k in range(len(records[0])):
            start = min(rec[k][0] for rec in records)
            end = max(rec[k][1] for rec in records)
            busy = max(rec[k][2] for rec in records)
            bubbles.append((end - start - busy) / busy)
        schedule = build_schedule(name, pp, a.microbatches, v)
        simulated = simulate(schedule, StageCosts.units(schedule)).bubble_fraction
        base = base or (wall["ours"], cpu["ours"])
        ratios = [o / t for o, t in zip(pairs["ours"], pairs["torch"], strict=True)]
        last = per_rank[schedule.chunk_rank[-1]][i]  # the rank holding the last chunk
        rows.append(
            f"{pp:>2} {name:<10} {v:>1} {a.microbatches:>2} {wall['ours'] * 1e3:8.1f} "
            f"{wall['ours'] / base[0]:6.3f} {cpu['ours']:6.2f} {cpu['ours'] / base[1]:6.3f} "
            f"{statistics.median(bubbles):7.3f} {simulated:7.3f} {wall['torch'] * 1e3:9.1f} "
            f"{statistics.median(ratios):6.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
            f"{last['loss_ours']:.4f}/{last['loss_torch']:.4f}")
    return rows


def zero_bubble_header(a) -> list[str]:
    return [
        "",
        f"# ---- zero-bubble schedules, bench_pipeline --zero-bubble {date.today()} ----",
        f"# model as above: {a.layers} layers, d_model {a.d_model}; {a.microbatches} "
        f"micro-batches x {a.micro_batch_size} x {a.seq} tokens; {a.pairs} alternating pairs "
        f"x {a.steps} steps; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at "
        "start (other jobs shared the machine)",
        "# ours ms / cpu s: our step time and CPU seconds per step summed over ranks, with their "
        "ratio to our 1F1B at the same m; bubble meas: from our runtime's F/B/I/W records "
        "(max over ranks of busy); sim: simulator at F = I = W (1F1B: F = 1, B = 2); torch ms: "
        "the peer's step time, ratio = median over pairs of ours/torch [spread]",
        f"{'pp':>2} {'schedule':<10} v {'m':>2} {'ours ms':>8} {'x1f1b':>6} {'cpu s':>6} "
        f"{'x1f1b':>6} {'bub me':>7} {'bub sim':>7} {'torch ms':>9} {'ratio':>6} "
        f"{'[spread]':<13} loss ours/torch",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=5, help="alternating (ours, torch) blocks")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--zero-bubble", action="store_true",
                    help="the split-backward schedules beside 1F1B; appends to --out")
    a = ap.parse_args()
    if a.zero_bubble:
        lines = zero_bubble_header(a)
        print("\n".join(lines), flush=True)
        for pp in a.pp:
            rows = summarize_zero_bubble(pp, run_ranks(bench_rank, pp, args=(a, pp),
                                                       timeout=900), a)
            print("\n".join(rows), flush=True)
            lines += rows
        if a.out:
            with open(a.out, "a") as f:
                f.write("\n".join(lines) + "\n")
        return

    header = [
        f"# bench_pipeline {date.today()}: ours (tessera.pipeline.runtime) vs "
        f"torch.distributed.pipelining {torch.__version__}, CPU/gloo, 1 thread per rank",
        f"# model: {a.layers} layers, d_model {a.d_model}, {a.heads} heads, vocab {a.vocab}; "
        f"batch {a.microbatches} micro-batches x {a.micro_batch_size} x {a.seq} tokens; "
        f"AdamW; {a.pairs} alternating pairs x {a.steps} steps",
        f"# machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
        f"(above the ranks running here: other jobs shared it); times are medians, "
        f"ratio = median over pairs of ours/torch [spread]",
        "# bubble = (pipeline wall - busy compute) / busy compute, measured with the same "
        "timing marks in both; CPU = user+sys seconds per step summed over ranks",
        f"{'pp':>2} {'schedule':<11} v {'ours ms':>9} {'torch ms':>9} {'ratio':>6} "
        f"{'[spread]':<13} {'bub us':>7} {'bub pt':>7} {'closed':>7} {'cpu us':>7} "
        f"{'cpu pt':>7} loss ours/torch",
    ]
    print("\n".join(header), flush=True)
    lines = list(header)
    for pp in a.pp:
        results = run_ranks(bench_rank, pp, args=(a, pp), timeout=600)
        rows = summarize(pp, results, a)
        print("\n".join(rows), flush=True)
        lines += rows
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
