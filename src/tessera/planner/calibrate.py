"""Measure this machine and describe it as a :class:`~tessera.planner.hardware.Hardware`.

What is measured, all with one thread per process (as each rank of ``tessera train`` runs on
this 2-core machine) and in fp32 (what ``tessera train`` computes in on a CPU):

- the matrix-multiply rate at the model's shapes: every forward and backward GEMM of one block
  (x·Wᵀ, dY·W, dYᵀ·x for Q, K, V, O and the MLP) on b·s tokens, total FLOPs over total time;
  stored as ``peak_tflops`` with ``matmul_efficiency = 1``;
- the attention rate: ``scaled_dot_product_attention`` forward and backward with the model's
  heads, causal, converted to the rate that makes the cost model's attention term (half the
  4·b·s²·h FLOPs for a causal kernel, backward twice the forward) reproduce the time;
- memory bandwidth: a fused multiply-add over tensors the size of one block's activations;
- the per-kernel overhead: the time of an elementwise op on a one-element tensor with autograd
  recording (dispatch, allocation, graph bookkeeping);
- collective α and β over gloo: :func:`tessera.collectives.measure_alpha_beta` on ``ranks``
  processes started with :func:`tessera.testing.run_ranks` (ping-pong between two ranks, fit
  of ``t = α + n·β``); the same numbers serve as intra- and inter-node link, since every rank
  lives on this machine; ``gamma`` (the local reduction) is folded into β;
- memory: the machine's RAM divided among its cores (one rank per core).

Data-parallel overlap: gloo runs its collectives on a thread that competes with the ranks'
compute for the same cores, and tessera's data parallelism reduces after the backward, so the
file says ``dp_overlap = 0``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera.planner.hardware import Hardware
from tessera.planner.models import ModelSpec


def _median_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    samples = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def matmul_rate(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """FLOP/s of one block's forward and backward GEMMs at the model's shapes."""
    tokens = micro_batch * seq
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

        total_s += _median_time(run)
        total_flops += flops
    return total_flops / total_s


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

    seconds = _median_time(run)
    return 1.5 * 4 * micro_batch * seq * seq * spec.hidden / seconds


def memory_bandwidth(spec: ModelSpec, seq: int, micro_batch: int) -> float:
    """Bytes/s of an elementwise multiply-add (reads two tensors, writes one) the size of the
    block's largest activation."""
    n = micro_batch * seq * max(spec.hidden, spec.ffn_hidden)
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    seconds = _median_time(lambda: torch.add(a, b, alpha=0.5, out=out), repeats=15)
    return 3 * 4 * n / seconds


def op_overhead() -> float:
    """Seconds of one tiny recorded op: the fixed cost every kernel pays."""
    x = torch.ones(1, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(200):
            y = y * 1.0
    return _median_time(run, repeats=9) / 200


def _collective_worker() -> tuple[float, float, float]:
    from tessera.collectives import measure_alpha_beta

    model = measure_alpha_beta(None, sizes=tuple(4 ** k for k in range(2, 12)))
    return model.alpha, model.beta, model.gamma


def collective_alpha_beta(ranks: int = 2) -> tuple[float, float, float]:
    """(α seconds, β seconds per byte, γ seconds per byte) over gloo between local processes."""
    from tessera.testing import run_ranks

    results = run_ranks(_collective_worker, ranks, timeout=120)
    return results[0]


def physical_memory_bytes() -> float:
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return float(pages * page)


def calibrate(spec: ModelSpec, seq: int, micro_batch: int, ranks: int = 2,
              name: str = "local-cpu") -> Hardware:
    """Measure this machine at `spec`'s shapes (see module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mm = matmul_rate(spec, seq, micro_batch)
        attn = attention_rate(spec, seq, micro_batch)
        bw = memory_bandwidth(spec, seq, micro_batch)
        overhead = op_overhead()
    finally:
        torch.set_num_threads(threads)
    alpha, beta, gamma = collective_alpha_beta(ranks)
    cores = os.cpu_count() or 1
    link_gbs = 1.0 / (beta + gamma) / 1e9
    return Hardware(
        name=name, peak_tflops=mm / 1e12, matmul_efficiency=1.0,
        attention_tflops=attn / 1e12, memory_gb=physical_memory_bytes() / cores / 1e9,
        memory_bw_gbs=bw / 1e9, intra_node_gbs=link_gbs, inter_node_gbs=link_gbs,
        gpus_per_node=cores, intra_node_alpha_us=alpha * 1e6, inter_node_alpha_us=alpha * 1e6,
        link_efficiency=1.0, op_overhead_us=overhead * 1e6, dp_overlap=0.0,
        source=f"tessera plan calibrate: {spec.name} shapes, b={micro_batch}, s={seq}, "
               f"1 thread per rank, fp32, gloo over {ranks} local ranks, "
               f"{time.strftime('%Y-%m-%d')}")
