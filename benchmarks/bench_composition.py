"""Composition: tessera's layouts against PyTorch's own composition, same model and ranks.

    python benchmarks/bench_composition.py [--pairs 5] [--layouts tp2pp2 dp2tp2pp2]

For each layout (dp × tp × pp ranks) both sides train the same Llama-style model
(``tessera.model``, same seed, fp32) on the same global batch, cut into the same m micro-batches
per data-parallel rank and run through the same schedule (1F1B), with AdamW
(``tessera.optim.adamw``: the same hyper-parameters, weight decay on matrices only), constant
learning rate and no gradient clipping on either side:

- ours: ``tessera.step.build_executor``: the pipeline split (``pipeline.partition``), Megatron
  TP with vocabulary-parallel embedding, head and loss, ZeRO over dp (``--zero-stage``, 2 by
  default, see below), the pipeline runtime;
- peer: the torchtitan recipe on a DeviceMesh (pp, dp, tp), the same ranks at the same
  coordinates: the same chunks (``partition`` + ``Chunk``, the reference initial weights);
  DTensor TP by ``parallelize_module`` (ColwiseParallel on wq, wk, wv, w1, w3, RowwiseParallel on
  wo, w2, a RowwiseParallel embedding, a ColwiseParallel head whose logits stay split, the loss
  under ``loss_parallel``; PrepareModuleInput makes the attention and MLP inputs one replicated
  DTensor so wq, wk, wv (w1, w3) share one backward all-reduce, Megatron's f); FSDP2
  ``fully_shard`` over dp on each block and on the chunk, ``reshard_after_forward=False`` as
  torchtitan does under pipelining; ``PipelineStage`` + ``Schedule1F1B`` over pp.

Why ZeRO-2 by default: under pipelining FSDP2 gathers each parameter once per step (the first
micro-batch's forward; no reshard after forward) and reduce-scatters each gradient once (the
stage syncs gradients on the last micro-batch's backward only): ZeRO-2's communication (one
reduce-scatter of the gradients and one all-gather of the parameters per step). Our ZeRO-3
gathers per micro-batch, which is FSDP2 with reshard_after_forward=True.

Our Attention reshapes to (B, T, -1, head_dim), so a ColwiseParallel shard (local tensors, fewer
output rows) runs the same code on its own heads; n_kv_heads is a multiple of tp so that DTensor's
contiguous row shards of wk/wv hold the key/value heads that the rank's query heads read.

Both sides run in the same rank processes, alternating blocks of ``--steps`` steps (``--pairs``
pairs, ours first in even pairs, the peer first in odd ones) after ``--warmup`` steps each. Per
step: wall time of the slowest rank (every rank enters the step from a barrier) and CPU time
(user + sys of the process, all its threads) summed over ranks, and the part of it spent in the
optimizer step. Printed per layout: median of each, the median of the per-pair ratios ours/peer
with its spread, both losses at the first and the last step with their largest difference over
all steps, and both gradient norms of the last step (the same model on the same data: they
must agree to fp32 noise; ``LOSS_TOLERANCE``).

PyTorch's composition runs on gloo/CPU in torch 2.13 at both layouts. Were a piece to fail, the
layout's row says which exception a rank raised (the issue's fallback, comparing with the sum of
PyTorch's single-mechanism runs, is then the other benchmarks in this directory).

Threads: one per rank (printed). At 8 ranks on a 2-core machine the ranks oversubscribe the
cores: wall time then measures the machine, and summed CPU time is the headline.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from tessera.layout import validate
from tessera.model import cross_entropy
from tessera.optim import adamw
from tessera.pipeline.partition import Chunk, partition
from tessera.step import build_executor
from tessera.testing import RankFailure, run_ranks
from tessera.topology import Topology

LAYOUTS = {"tp2pp2": (1, 2, 2), "dp2tp2pp2": (2, 2, 2)}  # name -> (dp, tp, pp)
# The two sides sum the same fp32 numbers in different orders (TP all-reduces, dp reductions,
# gradient accumulation), ~1e-7 relative per step; Adam's normalized updates carry such
# differences forward without growing them much over tens of steps. A wrong scale (1/m, 1/dp)
# A different initialization, data split or missing reduction moves the loss by far more. Adam
# hides a uniform gradient scale (a wrong 1/m or 1/dp), so the gradient norm of the last step
# is compared as well.
LOSS_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Setup:
    """What both sides share: model, batch, schedule, optimizer."""

    d_model: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    global_batch: int
    microbatches: int
    lr: float
    zero_stage: int

    def model(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab, d_model=self.d_model, n_layers=self.layers,
                           n_heads=self.heads, n_kv_heads=self.kv_heads, max_seq_len=self.seq)

    def train(self, dp: int) -> TrainConfig:
        return TrainConfig(lr=self.lr, warmup_steps=0, grad_clip=0.0, seed=0,
                           micro_batch_size=self.global_batch // (dp * self.microbatches),
                           grad_accum=self.microbatches)

    def config(self, dp: int, tp: int, pp: int) -> Config:
        return Config(model=self.model(), train=self.train(dp),
                      parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, schedule="1f1b",
                                              zero_stage=self.zero_stage if dp > 1 else 0),
                      data=DataConfig(path="unused", seq_len=self.seq))


def global_batch(s: Setup, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s tokens and targets, (global_batch, seq) each, the same on every rank.
    Each row counts from a random start by a random stride (mod vocab): learnable from the
    context, so the loss falls and the two sides' curves can be compared over the steps."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, s.vocab, (s.global_batch, 1), generator=g)
    stride = torch.randint(1, 8, (s.global_batch, 1), generator=g)
    tokens = (start + stride * torch.arange(s.seq + 1)) % s.vocab  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------------------------------------
# The two sides. Each has forward_backward(x, y) -> the step's loss, on this rank's
# data-parallel slice (B/dp, T), leaving synchronized gradients; then optimizer_step().


class Ours:
    name = "ours"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.executor = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
        self.optimizer = self.executor.optimizer(cfg.train)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        m = self.cfg.train.grad_accum
        micro_batches = list(zip(x.tensor_split(m), y.tensor_split(m), strict=True))
        self.optimizer.zero_grad(set_to_none=True)
        return self.executor.forward_backward(micro_batches)

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def grad_norm(self) -> float:
        return self.executor.grad_norm()


def dtensor_tp(chunk: Chunk, tp_mesh) -> None:
    """Megatron TP with DTensor: the torchtitan plan without sequence parallelism."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    replicated = Replicate()
    for block in chunk.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention": PrepareModuleInput(input_layouts=(replicated, None, None),
                                            desired_input_layouts=(replicated, None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(replicated,),
                                               desired_input_layouts=(replicated,)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    plan = {}
    if chunk.spec.has_embedding:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=replicated)
    if chunk.spec.has_head:  # logits stay split by vocabulary: the loss runs in loss_parallel
        plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(chunk, tp_mesh, plan)


def fsdp2(chunk: Chunk, dp_mesh) -> None:
    """FSDP2 per block and the rest with the chunk, no reshard after forward (torchtitan
    under pipelining: a stage runs m forwards before their backwards)."""
    from torch.distributed.fsdp import fully_shard

    for block in chunk.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=False)


class Peer:
    name = "peer"

    def __init__(self, cfg: Config):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        p = cfg.parallel
        self.cfg = cfg
        self.mesh = init_device_mesh("cpu", (p.pp, p.dp, p.tp), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank = self.mesh.get_local_rank("pp")
        specs = partition(cfg.model, p.pp, cfg.data.seq_len)
        chunk = Chunk(cfg.model, specs[pp_rank], seed=cfg.train.seed)
        if p.tp > 1:
            dtensor_tp(chunk, self.mesh["tp"])
        if p.dp > 1:
            fsdp2(chunk, self.mesh["dp"])
        self.first, self.last = chunk.spec.has_embedding, chunk.spec.has_head
        stage = PipelineStage(chunk, pp_rank, p.pp, torch.device("cpu"),
                              group=self.mesh.get_group("pp"))
        self.schedule = Schedule1F1B(stage, n_microbatches=cfg.train.grad_accum,
                                     loss_fn=cross_entropy)
        self.optimizer = adamw(chunk.parameters(), cfg.train)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The step's mean loss on the last stage's ranks (nan elsewhere)."""
        from torch.distributed.tensor.parallel import loss_parallel

        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = dict(target=y, losses=losses) if self.last else {}
        with loss_parallel():  # the split logits' cross-entropy, forward and backward
            self.schedule.step(*args, **kwargs)
        if not self.last:
            return float("nan")
        total = sum(loss.detach().full_tensor() if hasattr(loss, "full_tensor")
                    else loss.detach() for loss in losses)
        return float(total) / len(losses)

    def optimizer_step(self) -> None:
        self.optimizer.step()

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The whole model's gradient norm: each stage's full gradients (DTensors gathered),
        summed over pp."""
        # Gathering a (dp, tp)-sharded tensor takes two all-gathers; torch warns each time.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.schedule._stage.submod.parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            sq += grad.double().pow(2).sum()
        dist.all_reduce(sq, group=self.mesh.get_group("pp"))
        return float(sq.sqrt())


# ---------------------------------------------------------------------------------------------
# One rank's run: both sides built, warmed up, then alternating timed blocks.


def timed_block(runner, steps: int, first_step: int, s: Setup, dp: int, dp_rank: int) -> dict:
    """Per step: wall and CPU seconds of the whole step, CPU seconds of its optimizer step,
    the loss."""
    walls, cpus, opt_cpus, losses = [], [], [], []
    for step in range(first_step, first_step + steps):
        x, y = global_batch(s, step)
        rows = slice(dp_rank * s.global_batch // dp, (dp_rank + 1) * s.global_batch // dp)
        x, y = x[rows].contiguous(), y[rows].contiguous()
        dist.barrier()
        c0, t0 = cpu_seconds(), time.perf_counter()
        losses.append(runner.forward_backward(x, y))
        c1 = cpu_seconds()
        runner.optimizer_step()
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_seconds() - c0)
        opt_cpus.append(cpu_seconds() - c1)
    return dict(wall=walls, cpu=cpus, opt_cpu=opt_cpus, loss=losses)


def bench_rank(s: Setup, layout: tuple[int, int, int], pairs: int, steps: int,
               warmup: int) -> dict:
    dp, tp, pp = layout
    cfg = s.config(dp, tp, pp)
    validate(cfg, dist.get_world_size())
    runners = {"ours": Ours(cfg), "peer": Peer(cfg)}
    coords = runners["ours"].executor.topo.coords()
    dp_rank = coords["dp"]
    blocks: dict[str, list[dict]] = {"ours": [], "peer": []}
    warm = {k: timed_block(r, warmup, 0, s, dp, dp_rank) for k, r in runners.items()}
    step = warmup
    for pair in range(pairs):
        order = ("ours", "peer") if pair % 2 == 0 else ("peer", "ours")
        for key in order:
            blocks[key].append(timed_block(runners[key], steps, step, s, dp, dp_rank))
        step += steps
    norms = {k: r.grad_norm() for k, r in runners.items()}  # of each side's last step
    return dict(coords=coords, threads=torch.get_num_threads(), warm=warm, blocks=blocks,
                grad_norm=norms)


# ---------------------------------------------------------------------------------------------
# Summary over ranks (parent).


def loss_curve(per_rank: list[dict], key: str, pp: int, tp: int) -> list[float]:
    """The step losses of one side, in step order: ours is the same on every rank; the peer's
    is on the last stage's ranks, averaged here over dp (their tp ranks agree)."""
    def steps_of(r: dict) -> list[float]:
        return r["warm"][key]["loss"] + [x for b in r["blocks"][key] for x in b["loss"]]

    if key == "ours":
        return steps_of(per_rank[0])
    holders = [r for r in per_rank if r["coords"]["pp"] == pp - 1 and r["coords"]["tp"] == 0]
    curves = [steps_of(r) for r in holders]
    return [statistics.fmean(v) for v in zip(*curves, strict=True)]


def summarize(name: str, layout: tuple[int, int, int], per_rank: list[dict]) -> dict:
    dp, tp, pp = layout
    pairs = len(per_rank[0]["blocks"]["ours"])
    reduce = {"wall": max, "cpu": sum, "opt_cpu": sum}  # over ranks, per step
    out: dict = {"name": name, "ranks": dp * tp * pp}
    pair_medians: dict[tuple[str, str], list[float]] = {}
    for key in ("ours", "peer"):
        for metric, over_ranks in reduce.items():
            every, per_pair = [], []
            for i in range(pairs):
                values = zip(*(r["blocks"][key][i][metric] for r in per_rank), strict=True)
                steps = [over_ranks(v) for v in values]
                every += steps
                per_pair.append(statistics.median(steps))
            out[f"{key}_{metric}"] = statistics.median(every)
            pair_medians[key, metric] = per_pair
    for metric in ("wall", "cpu"):
        ratios = [o / p for o, p in zip(pair_medians["ours", metric],
                                        pair_medians["peer", metric], strict=True)]
        out[f"{metric}_ratio"] = statistics.median(ratios)
        out[f"{metric}_spread"] = (min(ratios), max(ratios))
    ours, peer = loss_curve(per_rank, "ours", pp, tp), loss_curve(per_rank, "peer", pp, tp)
    out["loss_first"] = (ours[0], peer[0])
    out["loss_last"] = (ours[-1], peer[-1])
    out["loss_maxdiff"] = max(abs(a - b) for a, b in zip(ours, peer, strict=True))
    out["steps"] = len(ours)
    out["grad_norm"] = (per_rank[0]["grad_norm"]["ours"], per_rank[0]["grad_norm"]["peer"])
    out["threads"] = sorted({r["threads"] for r in per_rank})
    return out


def row(r: dict) -> str:
    return (f"{r['name']:<10} {r['ranks']:>5} | {r['ours_wall'] * 1e3:8.0f} "
            f"{r['peer_wall'] * 1e3:8.0f} {r['wall_ratio']:6.2f} "
            f"({r['wall_spread'][0]:.2f}-{r['wall_spread'][1]:.2f}) | "
            f"{r['ours_cpu'] * 1e3:8.0f} {r['peer_cpu'] * 1e3:8.0f} {r['cpu_ratio']:6.2f} "
            f"({r['cpu_spread'][0]:.2f}-{r['cpu_spread'][1]:.2f}) | "
            f"{r['ours_opt_cpu'] * 1e3:5.0f} {r['peer_opt_cpu'] * 1e3:5.0f} | "
            f"{r['loss_first'][0]:.5f}/{r['loss_first'][1]:.5f} "
            f"{r['loss_last'][0]:.5f}/{r['loss_last'][1]:.5f} {r['loss_maxdiff']:.1e} | "
            f"{r['grad_norm'][0]:.5f}/{r['grad_norm'][1]:.5f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--pairs", type=int, default=5, help="alternating (ours, peer) blocks")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each side first")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--microbatches", type=int, default=4, help="m per data-parallel rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3),
                    help="ours over dp (FSDP2 under pipelining communicates like ZeRO-2)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    a = ap.parse_args()
    s = Setup(d_model=a.d_model, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
              vocab=a.vocab, seq=a.seq, global_batch=a.global_batch,
              microbatches=a.microbatches, lr=a.lr, zero_stage=a.zero_stage)
    torch.set_num_threads(1)

    header = [
        f"# bench_composition {date.today()}: tessera build_executor vs PyTorch's composition "
        f"(FSDP2 fully_shard + DTensor TP parallelize_module + pipelining Schedule1F1B), "
        f"torch {torch.__version__}, CPU/gloo",
        f"# machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
        "(before these ranks started)",
        f"# model: {s.layers} layers, d_model {s.d_model}, {s.heads} heads ({s.kv_heads} kv), "
        f"vocab {s.vocab}, fp32; global batch {s.global_batch} x {s.seq} tokens, "
        f"{s.microbatches} micro-batches per dp rank, 1F1B; AdamW lr {s.lr}, no clipping; "
        f"ours ZeRO-{s.zero_stage} where dp > 1, peer FSDP2 (reshard_after_forward=False)",
        f"# {a.pairs} alternating pairs x {a.steps} timed steps after {a.warmup} warm-up steps "
        "per side; wall = median step of the slowest rank; CPU = median user+sys per step summed "
        "over ranks (opt: of it, the optimizer step's, ours/peer); ratio = median over pairs "
        "of ours/peer (min-max); ms throughout",
        f"{'layout':<10} {'ranks':>5} | {'ours ms':>8} {'peer ms':>8} {'wall':>6} {'':11} | "
        f"{'ours cpu':>8} {'peer cpu':>8} {'cpu':>6} {'':11} | {'opt':>5} {'opt':>5} | "
        "loss first ours/peer, last ours/peer, max |diff| over steps | last grad norm "
        "ours/peer",
    ]
    print("\n".join(header), flush=True)
    lines = list(header)
    for name in a.layouts:
        layout = LAYOUTS[name]
        dp, tp, pp = layout
        try:
            per_rank = run_ranks(bench_rank, dp * tp * pp, timeout=900,
                                 args=(s, layout, a.pairs, a.steps, a.warmup))
        except RankFailure as e:
            print(f"{name}: failed\n{e}", file=sys.stderr, flush=True)
            lines.append(f"{name:<10} {dp * tp * pp:>5} | failed: {str(e).splitlines()[-1]}")
            continue
        r = summarize(name, layout, per_rank)
        note = f"# {name}: torch threads per rank {r['threads']}; {r['steps']} steps per side"
        if r["loss_maxdiff"] > LOSS_TOLERANCE:
            note += f"; LOSSES DISAGREE (max |diff| {r['loss_maxdiff']:.1e} > {LOSS_TOLERANCE})"
        print(note, row(r), sep="\n", flush=True)
        lines += [note, row(r)]
    lines.append(f"# load average {os.getloadavg()[0]:.1f} at the end")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(lines) + "\n")
        print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
