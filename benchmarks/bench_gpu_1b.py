"""One GPU, the llama-1b preset (Llama 3.2 1B's shape) at sequence 2048 in bf16: tessera eager,
compiled, compiled + chunked cross-entropy, and the peer, a compiled plain PyTorch loop.

    python benchmarks/bench_gpu_1b.py [--steps 10] [--warmup 3] [--guess B] [--chunk 1024]
    python benchmarks/bench_gpu_1b.py --dry        # tiny model on CPU: the code paths only

Variants, all on the same batches (random tokens) and the same micro-batch:

- eager: ``parallelize`` + ``Executor`` on a one-rank process group (bf16 parameters and
  gradients in ZeRO's flat units, fp32 masters);
- compiled: the same with ``train.compile`` (regional torch.compile of each block);
- compiled+chunked: and ``train.loss_chunk_tokens`` = ``--chunk``;
- peer: the reference ``Transformer`` under ``torch.compile(model)``, ``torch.optim.AdamW(fused=
  True)`` and ``torch.autocast`` bf16 (fp32 parameters), as nanoGPT trains;
- float8 (only where ``torchao`` imports): the peer with torchao's float8 linear layers,
  ``--curve-steps`` steps beside the bf16 peer's, both loss curves printed.

The micro-batch: the largest that fits both eager paths (tessera's and the peer's uncompiled
loop, which hold the most), searched downward from ``--guess`` (default: the largest the
planner's memory estimate puts under 80% of the GPU) with one step per try, an out-of-memory
error meaning "smaller".

Printed per variant: median step (``--steps`` timed steps after ``--warmup``), tokens/s, MFU
with causal and with full attention FLOPs, HFU (the hardware's FLOPs: the chunked loss runs the
head's GEMM again in backward), peak memory; then the planner's predicted step for the 1B and the
demo model on this GPU's catalog entry with this GPU's launch cost and compiled memory-bound
rate measured here (``planner.local.rates.launch_cost``, ``compiled_passes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.config_io import make_config
from tessera.model import build_model, cross_entropy, flops_per_token, param_count
from tessera.optim import adamw

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs of one training step."""

    model_full: float
    """6·N_matmul + 12·L·H·Q·T per token: every attention score computed (PaLM, Megatron)."""
    model_causal: float
    """The same with half the attention term: a causal kernel skips the masked half (Llama 3)."""
    hardware: float
    """What the step computes: model_full plus the work it does twice (the chunked loss's
    head GEMM again in backward: 2·h·V per token)."""


def step_flops(cfg, tokens: int, loss_chunked: bool = False) -> Flops:
    """FLOPs of a step over `tokens` tokens of cfg's model at cfg.data.seq_len
    (``tessera.model.flops_per_token``: 6·N_matmul + 12·L·H·Q·T per token)."""
    m, s = cfg.model, cfg.data.seq_len
    full = flops_per_token(m, s) * tokens
    causal = full - 6 * m.n_layers * m.n_heads * m.head_dim * s * tokens
    redone = 2 * m.d_model * m.vocab_size * tokens if loss_chunked else 0
    return Flops(model_full=full, model_causal=causal, hardware=full + redone)


@dataclasses.dataclass
class Result:
    name: str
    step_s: float
    tokens_s: float
    mfu_causal: float | None
    mfu_full: float | None
    hfu: float | None
    peak_bytes: int
    losses: list[float]

    def line(self) -> str:
        def pct(x: float | None) -> str:
            return f"{100 * x:5.1f}%" if x is not None else "  n/a"

        return (f"{self.name:17s} step {1e3 * self.step_s:9.2f} ms | {self.tokens_s:11,.0f} "
                f"tokens/s | MFU causal {pct(self.mfu_causal)} full {pct(self.mfu_full)} | "
                f"HFU {pct(self.hfu)} | peak {self.peak_bytes / 2**30:6.2f} GiB | "
                f"loss {self.losses[-1]:.4f}")


def utilization(flops: Flops, seconds: float, peak_tflops: float | None
                ) -> tuple[float | None, float | None, float | None]:
    """(MFU causal, MFU full, HFU) of a step of `flops` in `seconds` on a device of
    `peak_tflops` dense bf16 TFLOP/s (None: unknown peak)."""
    if not peak_tflops:
        return None, None, None
    peak = peak_tflops * 1e12 * seconds
    return flops.model_causal / peak, flops.model_full / peak, flops.hardware / peak


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, step: Callable[[Batch], float], data: list[Batch], warmup: int,
            flops: Flops, peak: float | None, device: torch.device) -> Result:
    """`warmup` untimed steps (compilation, allocator), then one timed step per batch."""
    for x, y in data[:warmup]:
        step((x, y))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for batch in data:
        sync(device)
        start = time.perf_counter()
        losses.append(step(batch))
        sync(device)
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    tokens = data[0][0].numel()
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return Result(name, t, tokens / t, *utilization(flops, t, peak), peak_bytes, losses)


def tessera_step(cfg, device: torch.device) -> Callable[[Batch], float]:
    """One training step of tessera's executor on a one-rank group (the trainer's path)."""
    from tessera.step import build_executor
    from tessera.topology import Topology

    ex = build_executor(cfg, Topology.build(cfg.parallel, device.type), device)
    opt = ex.optimizer(cfg.train)
    return lambda batch: ex.train_step([batch], opt, grad_clip=cfg.train.grad_clip).loss


def peer_step(cfg, device: torch.device, compile_backend: str | None = "inductor",
              float8: bool = False) -> Callable[[Batch], float]:
    """nanoGPT's recipe: the reference model in fp32 under torch.compile, bf16 autocast,
    AdamW fused where the device has it, gradient clipping; `float8`: torchao's float8
    linears (the LM head kept in bf16, as torchao advises for the output layer)."""
    model = build_model(cfg.model, cfg.train.seed, device)
    if float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "output")
    t = cfg.train
    opt = adamw(model.parameters(), t)  # fused on CUDA
    run = torch.compile(model, backend=compile_backend) if compile_backend else model

    def step(batch: Batch) -> float:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = cross_entropy(run(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        return float(loss.detach())

    return step


def batches(n: int, b: int, seq: int, vocab: int, device: torch.device) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (b, seq + 1), generator=g).to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def fits(make_step: Callable[[], Callable[[Batch], float]], batch: Batch,
         device: torch.device) -> bool:
    """One step at this micro-batch runs without running out of device memory."""
    try:
        make_step()(batch)
        sync(device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:  # the try's model and optimizer are gone: give their memory back
        release(device)


def release(device: torch.device, compiled: bool = False) -> None:
    """Collect the models just dropped (tessera's hooks hold cycles; with `compiled`,
    torch.compile's in-memory graphs, which hold their parameters: the on-disk cache stays)
    and return their memory to the device."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def largest_micro_batch(cfg, guess: int, device: torch.device,
                        fits_at: Callable[[int], bool] | None = None) -> int:
    """The largest micro-batch ≤ `guess` at which both eager paths take a step: halving
    from `guess` to the first that fits, then bisecting between it and the one that failed
    (each try builds the models afresh: a step that ran out of memory halfway leaves
    tessera's gradient hooks mid-count)."""
    if fits_at is None:
        def fits_at(b: int) -> bool:
            c = with_train(cfg, micro_batch_size=b)
            (batch,) = batches(1, b, c.data.seq_len, c.model.vocab_size, device)
            return (fits(lambda: tessera_step(c, device), batch, device)
                    and fits(lambda: peer_step(c, device, None), batch, device))
    failed, b = None, guess
    while b >= 1 and not fits_at(b):
        failed, b = b, b // 2
    if b < 1:
        raise SystemExit("micro-batch 1 does not fit on this device")
    while failed is not None and failed - b > 1:
        mid = (b + failed) // 2
        b, failed = (mid, failed) if fits_at(mid) else (b, mid)
    return b


def planned_micro_batch(cfg, total: float, limit: int = 64, share: float = 0.8) -> int:
    """The largest micro-batch ≤ `limit` whose step the planner predicts to need at most
    `share` of `total` bytes, the GPU's memory (tessera's eager bf16 step: its saved
    activations and the fp32 logits): where the search starts."""
    from tessera.planner.estimate import estimate
    from tessera.report import planner_workload

    best = 1
    for b in range(1, limit + 1):
        w, layout = planner_workload(with_train(cfg, micro_batch_size=b), 1, "H100")
        if estimate(w, layout, simulate=False).memory.total > share * total:
            break
        best = b
    return best


def with_train(cfg, **train):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def predictions(cfg, device: torch.device, measure_compiled: bool = True) -> list[str]:
    """The planner's step for cfg's variants and the demo model, on this GPU's catalog entry
    with the launch cost and compiled memory-bound rate measured here (the rate's bandwidth
    at micro-batch 1: tensors as large as a sequence's activations)."""
    from tessera.planner.estimate import estimate
    from tessera.planner.hardware import load_hardware, replace
    from tessera.planner.local.rates import compiled_passes, launch_cost, memory_bandwidth
    from tessera.planner.models import from_model_config
    from tessera.report import hardware_for, planner_workload

    name = hardware_for(device) if device.type == "cuda" else None
    hw = load_hardware(name or "H100")
    spec = from_model_config("1b", cfg.model, cfg.data.seq_len)
    with torch.device(device):
        launch = launch_cost()
        bw = memory_bandwidth(spec, cfg.data.seq_len, 1)
        compiled = (compiled_passes(spec, cfg.data.seq_len, cfg.train.micro_batch_size, bw)
                    if measure_compiled else None)
    here = replace(hw, launch_us=launch * 1e6, compiled_elementwise_passes=compiled)
    out = [f"this device: launch {launch * 1e6:.1f} µs per kernel, streaming "
           f"{bw / 1e9:.0f} GB/s, compiled passes {compiled} (catalog {hw.name}: launch "
           f"{hw.launch_us} µs, passes eager {hw.eager_elementwise_passes} fused "
           f"{hw.elementwise_passes})"]
    demo = make_config("demo", parallel=dict(dp=1), train=dict(precision="bf16"))
    cases = [("eager", cfg, "tessera"), ("compiled", cfg, "compiled"),
             ("compiled+chunked", with_train(cfg, loss_chunk_tokens=CHUNK), "compiled"),
             ("demo eager", demo, "tessera"), ("demo compiled", demo, "compiled")]
    for label, c, kernels in cases:
        figures = []
        for hardware in (hw, here):
            w, layout = planner_workload(c, 1, hardware)
            figures.append(estimate(dataclasses.replace(w, kernels=kernels), layout).step_time)
        model = f"{c.model.n_layers}-layer d={c.model.d_model}"
        out.append(f"planner {model} {label:17s} catalog {1e3 * figures[0]:9.2f} ms | with "
                   f"this device's launch and compiled rate {1e3 * figures[1]:9.2f} ms")
    return out


CHUNK = 1024


def main(argv: list[str] | None = None) -> list[Result]:
    global CHUNK
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--guess", type=int, default=0,
                    help="micro-batch the search starts at (0: the planner's memory estimate)")
    ap.add_argument("--chunk", type=int, default=CHUNK, help="train.loss_chunk_tokens")
    ap.add_argument("--curve-steps", type=int, default=100, help="float8 vs bf16 loss curves")
    ap.add_argument("--dry", action="store_true",
                    help="the tiny preset on CPU (gloo), compile backend 'eager': code paths")
    args = ap.parse_args(argv)
    CHUNK = args.chunk
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    preset, seq = ("tiny", 32) if args.dry else (args.preset, args.seq)
    backend = "eager" if args.dry else "inductor"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                rank=0, world_size=1, timeout=timedelta(minutes=5))
    cfg = make_config(preset, parallel=dict(dp=1),
                      data=dict(seq_len=seq),
                      train=dict(grad_accum=1, precision="bf16", warmup_steps=0))
    guess = args.guess or (2 if args.dry else planned_micro_batch(
        cfg, torch.cuda.get_device_properties(device).total_memory))
    b = 2 if args.dry else largest_micro_batch(cfg, guess, device)
    cfg = with_train(cfg, micro_batch_size=b)
    data = batches(args.warmup + args.steps, b, seq, cfg.model.vocab_size, device)
    from tessera.metrics import device_peak_tflops

    peak = device_peak_tflops(device)
    tokens = b * seq
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, {preset} ({param_count(cfg.model) / 1e9:.2f}B params), "
          f"seq {seq}, micro-batch {b} (largest that fits), bf16, peak {peak} TFLOP/s")
    has_compile = hasattr(cfg.train, "compile")
    variants: list[tuple[str, Callable[[], Callable[[Batch], float]], bool]] = [
        ("eager", lambda: tessera_step(cfg, device), False)]
    if has_compile:
        variants += [("compiled", lambda: tessera_step(with_train(cfg, compile=True), device),
                      False),
                     ("compiled+chunked", lambda: tessera_step(
                         with_train(cfg, compile=True, loss_chunk_tokens=CHUNK), device), True)]
    else:
        print("(train.compile is not in this tree: the compiled variants are skipped)")
    variants.append(("peer compiled", lambda: peer_step(cfg, device, backend), False))
    results = []
    for name, make, chunked in variants:
        start = time.perf_counter()
        result = measure(name, make(), data, args.warmup, step_flops(cfg, tokens, chunked),
                         peak, device)
        results.append(result)
        print(result.line(), f"| {time.perf_counter() - start:.0f} s with warm-up", flush=True)
        release(device, compiled=True)
    eager, peer = results[0], results[-1]
    best = min(results[:-1], key=lambda r: r.step_s)
    print(f"ours/peer step time: eager {eager.step_s / peer.step_s:.3f}, best ({best.name}) "
          f"{best.step_s / peer.step_s:.3f}")
    results += float8_curves(cfg, device, backend, args.curve_steps if not args.dry else 3)
    print("\n".join(predictions(cfg, device, measure_compiled=not args.dry)))
    return results


def float8_curves(cfg, device: torch.device, backend: str, steps: int) -> list[Result]:
    """The peer with torchao's float8 linears beside the bf16 peer, `steps` steps each on the
    same 8 batches repeated (so the loss falls), both curves printed; nothing where torchao
    is not installed."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        print("float8: torchao is not installed here, skipped")
        return []
    b, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    pool = batches(8, b, seq, cfg.model.vocab_size, device)
    data = [pool[i % len(pool)] for i in range(steps)]
    peak = None
    if device.type == "cuda":
        from tessera.metrics import device_peak_tflops

        peak = device_peak_tflops(device)
    out = []
    for name, f8 in (("peer bf16 curve", False), ("peer float8 curve", True)):
        out.append(measure(name, peer_step(cfg, device, backend, float8=f8), data, 0,
                           step_flops(cfg, b * seq), peak, device))
        print(out[-1].line())
        release(device, compiled=True)
    for i in range(0, steps, max(1, steps // 20)):
        print(f"step {i:4d} loss bf16 {out[0].losses[i]:.4f} float8 {out[1].losses[i]:.4f}")
    return out


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
    dist.destroy_process_group()
