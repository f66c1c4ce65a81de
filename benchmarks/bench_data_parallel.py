"""Data-parallel training step: tessera's candidates against PyTorch's own, on CPU/gloo.

    python benchmarks/bench_data_parallel.py                   # 2 and 4 ranks
    python benchmarks/bench_data_parallel.py --worlds 2 --pairs 9 --out results.txt

Every candidate trains the same model (same seed, global batch, fp32, one gradient
synchronization per step, AdamW) on `world` forked gloo ranks with one thread each. A candidate
and its PyTorch-native peer are built side by side in the same ranks (each with its own copy of
the model) and run alternately, `pairs` blocks of `steps` steps each, the order flipping every
block (ABBA), after `warmup` steps each; alternating inside one session keeps other jobs' load
on this shared machine from landing on one side only. Recorded per candidate:

- step time: per block, the median over its steps of the slowest rank's time; the table gives
  the median over blocks and the range;
- CPU time per step summed over ranks (user+sys, all threads): with more ranks than cores, wall
  time hides how much work each candidate does;
- peak RSS of fresh ranks that run only this candidate (max over ranks), and its growth over
  the RSS before the candidate was built: model, gradients, optimizer, buckets, activations;
- the global batch's loss at the last step, which must agree between candidate and peer;
- peak model state per rank (max over ranks, fresh ranks): bytes of parameters, gradients and
  optimizer state counted from the tensors themselves (each storage once, a DTensor by its
  local shard), sampled whenever autograd saves or unpacks a tensor during one more step, and
  after it. For ZeRO-3 and FSDP2 this includes gathered (unsharded) parameters and gradients
  waiting for their reduce-scatter (our wrapper's live tensors; FSDP2's all-gather outputs and
  retained reduce-scatter inputs). DDP bucket buffers are not counted (torch's are not
  visible); activations are not model state.

The ratio of a pair of blocks is candidate/peer; the summary gives the median ratio and its
range. To add a candidate, register its setup function in CANDIDATES and its peer in PAIRS.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ModelConfig, TrainConfig
from tessera.model import build_model, cross_entropy, param_count
from tessera.optim import adamw
from tessera.parallel.ddp import DataParallel
from tessera.parallel.zero import ZeroModel
from tessera.parallel.zero_state import ShardedAdamW
from tessera.testing import run_ranks

StepFn = Callable[[torch.Tensor, torch.Tensor], float]
"""One optimizer step on this rank's (x, y); returns the local loss."""
Setup = Callable[[nn.Module, dist.ProcessGroup, TrainConfig, argparse.Namespace], StepFn]
"""Returns the step function, whose `model_state()` attribute lists the model-state tensors
the candidate holds at the moment it is called."""


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct allocated storages behind `tensors` (DTensors: the local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def module_state(model: nn.Module | None, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Registered parameters, their gradients, and the optimizer's parameters and state."""
    params = list(model.parameters()) if model is not None else []
    return [*params, *(p.grad for p in params),
            *(p for g in opt.param_groups for p in g["params"]),
            *(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))]


def setup_ours_ddp(model: nn.Module, group: dist.ProcessGroup, train: TrainConfig,
                   args: argparse.Namespace) -> StepFn:
    ddp = DataParallel(model, group, bucket_mb=args.bucket_mb, algorithm=args.algorithm)
    opt = adamw(model.parameters(), train)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(ddp(x), y)
        loss.backward()
        ddp.finish_gradient_sync()
        opt.step()
        return float(loss.detach())

    step.model_state = lambda: module_state(model, opt)
    return step


def setup_torch_ddp(model: nn.Module, group: dist.ProcessGroup, train: TrainConfig,
                    args: argparse.Namespace) -> StepFn:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=args.bucket_mb)
    opt = adamw(model.parameters(), train)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(ddp(x), y)
        loss.backward()  # torch DDP's reducer has synchronized the gradients when this returns
        opt.step()
        return float(loss.detach())

    step.model_state = lambda: module_state(model, opt)
    return step


def setup_ours_zero3(model: nn.Module, group: dist.ProcessGroup, train: TrainConfig,
                     args: argparse.Namespace) -> StepFn:
    zero = ZeroModel(model, group, stage=3)  # units: the embedding, each block, the head
    opt = ShardedAdamW(zero, train)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = cross_entropy(zero(x), y)
        loss.backward()
        zero.finish_gradient_sync()
        opt.step()
        return float(loss.detach())

    step.model_state = lambda: [*zero.live_tensors(), *module_state(None, opt)]
    return step


def fsdp2_internal_tensors(model: nn.Module) -> list[torch.Tensor]:
    """FSDP2's all-gather outputs (flat and per parameter) and retained reduce-scatter inputs.

    Private attributes of torch.distributed.fsdp as of torch 2.13; where one is missing the
    count falls back to the registered parameters, their gradients and the optimizer state."""
    from torch.distributed.fsdp import FSDPModule

    out: list[torch.Tensor] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        if group is None:
            continue
        result = getattr(group, "_all_gather_result", None)
        if result is not None:
            out.append(result.all_gather_output)
        for fsdp_param in group.fsdp_params:
            out += list(getattr(fsdp_param, "all_gather_outputs", []))
        for rs in getattr(getattr(group, "comm_ctx", None), "reduce_scatter_states", []):
            out.append(rs.reduce_scatter_input)
    return out


def setup_torch_fsdp2(model: nn.Module, group: dist.ProcessGroup, train: TrainConfig,
                      args: argparse.Namespace) -> StepFn:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.layers:  # one FSDP unit per block, the rest at the root: as ours
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters(), train)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    step.model_state = lambda: [*module_state(model, opt), *fsdp2_internal_tensors(model)]
    return step


CANDIDATES: dict[str, Setup] = {
    "ours-ddp": setup_ours_ddp,
    "torch-ddp": setup_torch_ddp,
    "ours-zero3": setup_ours_zero3,
    "torch-fsdp2": setup_torch_fsdp2,
}
PAIRS: list[tuple[str, str]] = [("ours-ddp", "torch-ddp"), ("ours-zero3", "torch-fsdp2")]
"""(candidate, PyTorch-native peer) pairs compared head to head."""


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def print_and_write(lines: list[str], summary: list[str], out: str | None) -> None:
    """Print the summary (the table's lines were printed as they came) and write both to
    `out` when given."""
    print("\n".join(summary), flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines + summary) + "\n")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def batch(step: int, model_cfg: ModelConfig, args: argparse.Namespace, rank: int, world: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, model_cfg.vocab_size, (args.global_batch, args.seq + 1), generator=g)
    per = args.global_batch // world
    local = tokens[rank * per:(rank + 1) * per]  # (B/N, T+1)
    return local[:, :-1], local[:, 1:]


def rank_timing(names: list[str], model_cfg: ModelConfig, args: argparse.Namespace) -> dict:
    """Build every candidate in these ranks, then alternate blocks of `steps` timed steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train = TrainConfig(lr=1e-3, warmup_steps=0)
    steps = {name: CANDIDATES[name](build_model(model_cfg, seed=0), dist.group.WORLD, train, args)
             for name in names}
    done = dict.fromkeys(names, 0)
    loss = dict.fromkeys(names, float("nan"))

    def run(name: str, n: int) -> tuple[list[float], float]:
        times = []
        dist.barrier()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(n):
            x, y = batch(done[name], model_cfg, args, rank, world)
            t0 = time.perf_counter()
            loss[name] = steps[name](x, y)
            times.append(time.perf_counter() - t0)
            done[name] += 1
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        return times, cpu / n

    for name in names:
        run(name, args.warmup)
    blocks: dict[str, list] = {name: [] for name in names}
    for i in range(args.pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            blocks[name].append(run(name, args.steps))
    return dict(blocks=blocks, loss=loss)


def rank_memory(name: str, model_cfg: ModelConfig, args: argparse.Namespace) -> dict:
    """Peak RSS of fresh ranks running one candidate for warm-up + 1 steps; then the peak
    model state over one more step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_before = rss_mib()
    step = CANDIDATES[name](build_model(model_cfg, seed=0), dist.group.WORLD,
                            TrainConfig(lr=1e-3, warmup_steps=0), args)
    for i in range(args.warmup + 1):
        step(*batch(i, model_cfg, args, rank, world))
    peak, growth = peak_rss_mib(), peak_rss_mib() - rss_before
    state = peak_model_state(step, *batch(args.warmup + 1, model_cfg, args, rank, world))
    return dict(peak=peak, growth=growth, state=state)


def peak_model_state(step: StepFn, x: torch.Tensor, y: torch.Tensor) -> int:
    """The most model-state bytes held at once during one step (sampled, untimed)."""
    peak = 0

    def sample(t: torch.Tensor) -> torch.Tensor:
        nonlocal peak
        peak = max(peak, storage_bytes(step.model_state()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(sample, sample):
        step(x, y)
    sample(x)
    return peak


def compare(cand: str, peer: str, world: int, model_cfg: ModelConfig, args: argparse.Namespace
            ) -> tuple[list[str], str]:
    res = run_ranks(rank_timing, world, args=([cand, peer], model_cfg, args), timeout=900)
    block_ms, cpu, rows = {}, {}, []
    for name in (cand, peer):
        # Each block: the median over its steps of the slowest rank's step time.
        block_ms[name] = [
            1e3 * statistics.median(max(r["blocks"][name][b][0][i] for r in res)
                                    for i in range(args.steps))
            for b in range(args.pairs)]
        cpu[name] = statistics.median(sum(r["blocks"][name][b][1] for r in res)
                                      for b in range(args.pairs))
    ratios = [a / b for a, b in zip(block_ms[cand], block_ms[peer], strict=True)]
    finals = {n: sum(r["loss"][n] for r in res) / world for n in (cand, peer)}  # global loss
    state = {}
    for name in (cand, peer):
        mem = run_ranks(rank_memory, world, args=(name, model_cfg, args), timeout=600)
        ms = block_ms[name]
        state[name] = max(m["state"] for m in mem) / 2**20
        rows.append(f"{world:>5} {name:<12} {statistics.median(ms):>8.1f} "
                    f"{f'{min(ms):.0f}-{max(ms):.0f}':>15} {cpu[name]:>10.3f} "
                    f"{max(m['peak'] for m in mem):>12.0f} {max(m['growth'] for m in mem):>10.0f} "
                    f"{state[name]:>9.2f} {finals[name]:>10.5f}")
    summary = (f"world {world}: {cand}/{peer} step time ratio {statistics.median(ratios):.3f} "
               f"(median of {len(ratios)} alternating pairs, range {min(ratios):.3f}-"
               f"{max(ratios):.3f}); CPU time ratio {cpu[cand] / cpu[peer]:.3f}; model-state "
               f"ratio {state[cand] / state[peer]:.3f}; final loss {finals[cand]:.5f} vs "
               f"{finals[peer]:.5f}")
    return rows, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pairs", type=int, default=7, help="alternating blocks of each candidate")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="both DDPs' bucket size")
    ap.add_argument("--algorithm", default="backend", help="our DDP's all-reduce algorithm")
    ap.add_argument("--only", nargs="*", default=None, help="pairs whose candidate is named")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()

    model_cfg = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                            n_heads=args.heads, max_seq_len=args.seq)
    pairs = [p for p in PAIRS if args.only is None or p[0] in args.only]
    torch.set_num_threads(1)
    adamw(nn.Linear(1, 1).parameters(), TrainConfig())  # import torch.optim's lazy parts once

    lines = [
        f"# bench_data_parallel  {datetime.date.today()}  {platform.node()}  torch "
        f"{torch.__version__}  {torch.get_num_threads()} thread per rank, gloo, CPU",
        f"# model: {param_count(model_cfg) / 1e6:.2f}M params (d_model {args.d_model}, "
        f"{args.layers} layers), global batch {args.global_batch}x{args.seq}, fp32 AdamW, "
        f"bucket {args.bucket_mb} MiB, our all-reduce '{args.algorithm}'",
        f"# {args.pairs} alternating blocks of {args.steps} steps per candidate in the same "
        f"ranks after {args.warmup} warm-up steps; memory from fresh ranks per candidate",
        f"# load average at start {load_average()} on {os.cpu_count()} cores (other jobs share "
        "this machine when it exceeds the ranks running here)",
        f"{'world':>5} {'candidate':<12} {'step ms':>8} {'blocks min-max':>15} "
        f"{'cpu s/step':>10} {'peak RSS MiB':>12} {'growth MiB':>10} {'state MiB':>9} "
        f"{'final loss':>10}",
    ]
    for line in lines:
        print(line, flush=True)
    summary = []
    for world in args.worlds:
        for cand, peer in pairs:
            rows, line = compare(cand, peer, world, model_cfg, args)
            lines += rows
            summary.append(line)
            print("\n".join(rows), flush=True)
    summary.append(f"# load average at end {load_average()}")
    print_and_write(lines, summary, args.out)


if __name__ == "__main__":
    main()
