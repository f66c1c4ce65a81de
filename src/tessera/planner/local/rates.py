"""Compute rates of one calibrating rank, each at the model's shapes, in one thread, fp32.

- the matrix-multiply rate: every forward and backward GEMM of one block (x·Wᵀ, dY·W, dYᵀ·x
  for Q, K, V, O and the MLP) on b·s tokens, total FLOPs over total time; timed again on
  b·s/8 tokens, the two totals give the shape dependence ``t = F/rate + n·tail`` (n GEMMs):
  the rate of large GEMMs (``peak_tflops``, with ``matmul_efficiency = 1``) and the fixed time
  per GEMM (``matmul_tail_us``). A tail that comes out negative (small GEMMs running faster
  per FLOP in cache) is stored as 0 with the rate at the model's shapes;
- the attention rate: ``scaled_dot_product_attention`` forward and backward with the model's
  heads, causal, converted to the rate that makes the cost model's attention term (half the
  4·b·s²·h FLOPs for a causal kernel, backward twice the forward) reproduce the time;
- memory bandwidth: a multiply-add streaming tensors as large as all the activations the model
  keeps for backward (out of cache, as the backward reads them);
- memory-bound passes: one block of tessera's reference model, forward and backward; what the
  matmul and attention rates and the per-kernel overhead do not explain is memory-bound
  traffic, expressed as passes over each stored activation byte (``elementwise_passes``);
- the per-kernel overhead: an elementwise op on a one-element tensor with autograd recording
  (dispatch, allocation, graph bookkeeping);
- the launch cost: a tiny block's eager forward and backward over its kernels (the host's
  cost per kernel, ``launch_us``), and the compiled memory-bound rate: torch.compile's fused
  residual add + RMSNorm against the streaming bandwidth (``compiled_elementwise_passes``);
- the optimizer's per-tensor cost: tessera's gradient norm, clipping and AdamW step over 256
  tiny parameters (``optimizer_tensor_us``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera.planner.compute import OPS_PER_LAYER_FORWARD
from tessera.planner.formulas import layer_activation_bytes, layer_forward_flops
from tessera.planner.local.timing import typical_time
from tessera.planner.models import ModelSpec


def matmul_rate(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """FLOP/s of one block's forward and backward GEMMs at the model's shapes."""
    flops, seconds = matmul_totals(spec, micro_batch * seq)
    return flops / seconds


def matmul_curve(spec: ModelSpec, seq: int, micro_batch: int) -> tuple[float, float]:
    """(large-GEMM FLOP/s, fixed seconds per GEMM) from the block's GEMMs on b·s and b·s/8
    tokens (module docstring); (rate at the model's shapes, 0) if the tail is not positive."""
    f1, t1 = matmul_totals(spec, micro_batch * seq)
    f2, t2 = matmul_totals(spec, max(1, micro_batch * seq // 8))
    # Per GEMM as the cost model counts them (cost.block_matmul_times: QKV as one GEMM, the
    # output projection, the MLP's matrices; forward and two backward each), so that the
    # model reproduces the measured total at the model's shapes.
    n = 3 * (2 + spec.mlp_matrices)
    if t1 > t2 and f1 > f2:
        rate = (f1 - f2) / (t1 - t2)
        tail = (t1 - f1 / rate) / n
        if tail > 0:
            return rate, tail
    return f1 / t1, 0.0


def matmul_totals(spec: ModelSpec, tokens: int) -> tuple[float, float]:
    """(FLOPs, seconds) of one block's forward and backward GEMMs on `tokens`."""
    h = spec.hidden
    shapes = [(h, h), (h, spec.kv_dim), (h, spec.kv_dim), (h, h)]
    shapes += [(h, spec.ffn_hidden)] * (spec.mlp_matrices - 1) + [(spec.ffn_hidden, h)]
    total_s = total_flops = 0.0
    for k, n in shapes:
        x = torch.randn(tokens, k)
        w = torch.randn(n, k)
        dy = torch.randn(tokens, n)
        flops = 3 * 2 * tokens * k * n  # forward, input gradient, weight gradient

        def run(x=x, w=w, dy=dy) -> None:
            x @ w.t()
            dy @ w
            dy.t() @ x

        total_s += typical_time(run)
        total_flops += flops
    return total_flops, total_s


def attention_rate(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """The rate r such that 1.5 · (4·b·s²·h) / r is the measured causal forward + backward."""
    d = spec.head_dim
    q = torch.randn(micro_batch, spec.heads, seq, d, requires_grad=True)
    k = torch.randn(micro_batch, spec.kv_heads, seq, d, requires_grad=True)
    v = torch.randn(micro_batch, spec.kv_heads, seq, d, requires_grad=True)
    grad = torch.randn(micro_batch, spec.heads, seq, d)

    def run() -> None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=spec.kv_heads != spec.heads)
        y.backward(grad)

    seconds = typical_time(run)
    return 1.5 * 4 * micro_batch * seq * seq * spec.hidden / seconds


def memory_bandwidth(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """Bytes/s of an elementwise multiply-add (reads two tensors, writes one) over tensors as
    large as all the activations the model keeps for its backward (at least 32 MiB each), so
    the measurement streams from memory as the backward does, not from cache."""
    act = spec.layers * layer_activation_bytes(spec, micro_batch, seq, e=4, flash=True)
    n = max(int(act / 3 / 4), 8 * 2**20)
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    seconds = typical_time(lambda: torch.add(a, b, alpha=0.5, out=out), repeats=9)
    return 3 * 4 * n / seconds


def block_config(spec: ModelSpec, seq: int):
    from tessera.config import ModelConfig

    return ModelConfig(vocab_size=spec.vocab_size, d_model=spec.hidden, n_layers=1,
                       n_heads=spec.heads, n_kv_heads=spec.kv_heads,
                       ffn_hidden=spec.ffn_hidden, max_seq_len=seq)


def block_step(spec: ModelSpec, seq: int, micro_batch: int) -> Callable[[], None]:
    """Forward + backward of one block of tessera's reference model at the model's shapes."""
    from tessera.model import Block, rope_tables

    cfg = block_config(spec, seq)
    block = Block(cfg)
    cos, sin = rope_tables(cfg.head_dim, seq, cfg.rope_theta)
    x = torch.randn(micro_batch, seq, spec.hidden, requires_grad=True)
    grad = torch.randn(micro_batch, seq, spec.hidden)

    def run() -> None:
        block(x, cos, sin).backward(grad)

    return run


def block_seconds(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """Seconds of one block's forward + backward (a typical repeat)."""
    return typical_time(block_step(spec, seq, micro_batch), repeats=9)

def elementwise_passes(spec: ModelSpec, seq: int, micro_batch: int, mm: float, attn: float,
                       bw: float, overhead: float) -> float:
    """Passes over each stored activation byte that make the cost model's block time (3x the
    forward: matmuls, attention, memory-bound kernels, per-kernel overhead) equal the measured
    block: what the matmul and attention rates do not explain is memory-bound work."""
    flops_mm, flops_attn = layer_forward_flops(spec, micro_batch, seq)
    explained = 3 * (flops_mm / mm + 0.5 * flops_attn / attn
                     + OPS_PER_LAYER_FORWARD * overhead)
    stored = layer_activation_bytes(spec, micro_batch, seq, e=4, flash=True)
    rest = block_seconds(spec, seq, micro_batch) - explained
    return max(0.5, rest / (3 * stored / bw))


def optimizer_tensor_seconds(tensors: int = 256, repeats: int = 15) -> float:
    """Seconds per parameter tensor of a step's gradient norm, clipping and AdamW update
    beyond their memory traffic: tessera's own code (``ParallelModel.local_grad_sq``'s fp64
    Σ g², one batched norm: ``tessera.optim.add_sums_of_squares``; the clipping's scale;
    ``tessera.optim.adamw``) over `tensors` parameters of 64
    elements, whose traffic is nothing, so the time is the loops' fixed cost (measured
    directly, not as a small difference of two large timings)."""
    from tessera.config import TrainConfig
    from tessera.optim import adamw, add_sums_of_squares

    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = adamw(params, TrainConfig())

    @torch.no_grad()
    def run() -> None:
        sq = torch.zeros((), dtype=torch.float64)
        add_sums_of_squares(sq, [p.grad for p in params])
        scale = 1.0 / (float(sq.sqrt()) + 1.0)  # clipped, as early in training
        for p in params:
            p.grad.mul_(scale)
        optimizer.step()

    return typical_time(run, repeats=repeats) / tensors

def op_overhead() -> float:
    """Seconds of one tiny recorded op: the fixed cost every kernel pays."""
    x = torch.ones(1, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(200):
            y = y * 1.0
    return typical_time(run, repeats=9) / 200


def launch_cost(calls: int = 10) -> float:
    """Seconds per kernel of a tiny block's eager forward + backward (64 wide, 8 tokens, fp32),
    over its kernel count (:func:`tessera.planner.kernels.eager_block`): what the host spends
    to issue each kernel of an eager step (the Python call, autograd, the dispatcher, the
    launch), the device's work being nil at that size (``Hardware.launch_us``)."""
    from tessera.config import ModelConfig
    from tessera.model import Block, rope_tables
    from tessera.planner.kernels import eager_block
    from tessera.planner.models import from_model_config

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=8)
    block = Block(cfg)
    cos, sin = rope_tables(cfg.head_dim, 8, cfg.rope_theta)
    x = torch.randn(1, 8, 64, requires_grad=True)
    grad = torch.randn(1, 8, 64)

    def run() -> None:
        for _ in range(calls):
            block(x, cos, sin).backward(grad)

    count = eager_block(from_model_config("launch", cfg, 8), "fp32")
    return typical_time(run, repeats=9) / calls / (count.forward + count.backward)


def compiled_passes(spec: ModelSpec, seq: int, micro_batch: int, bw: float) -> float | None:
    """Passes over the activation bytes of a compiled block's memory-bound kernels
    (``Hardware.compiled_elementwise_passes``): 2 (a fused run reads its inputs and writes its
    outputs once) at the rate torch.compile's kernel for one such run reaches, over the
    streaming bandwidth `bw`: the residual add with the RMSNorm after it, on the model's
    b·s × h activations in fp32 (reads x and r, writes the sum and the normalized output).
    None where torch.compile cannot build it (no compiler)."""
    n, h = micro_batch * seq, spec.hidden

    def add_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
        y = x + r
        return y, y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    x, r, w = torch.randn(n, h), torch.randn(n, h), torch.randn(h)
    try:
        fused = torch.compile(add_norm, dynamic=False)
        fused(x, r, w)
    except Exception:  # noqa: BLE001 - no compiler or backend here: not measured
        return None
    seconds = typical_time(lambda: fused(x, r, w), repeats=9)
    rate = 4 * n * h * 4 / seconds
    return 2.0 * bw / rate
