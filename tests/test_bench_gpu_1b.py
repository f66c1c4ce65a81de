"""benchmarks/bench_gpu_1b.py (the GPU check's 1B benchmark) on CPU: its FLOP and utilization
arithmetic against hand-computed values, the micro-batch search, and the peer loop on the tiny
model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tessera.config_io import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_gpu_1b as bench  # noqa: E402


def test_flops_and_utilization_by_hand():
    # tiny: h 64, 2 layers, 4 heads of 16 (2 kv heads), SwiGLU 192, vocabulary 256, T 32.
    # N_matmul = 2 (64·(4 + 2·2)·16 + 4·16·64 + 3·64·192) + 256·64 = 114,688 (untied head);
    # per token 6N = 688,128, attention 12·2·4·16·32 = 49,152 (full) or half (causal);
    # the chunked loss's head GEMM again: 2·64·256 = 32,768 per token. 64 tokens a step.
    cfg = make_config("tiny")
    f = bench.step_flops(cfg, 64, loss_chunked=True)
    assert f.model_full == 64 * (688_128 + 49_152) == 47_185_920
    assert f.model_causal == 64 * (688_128 + 24_576) == 45_613_056
    assert f.hardware == 47_185_920 + 64 * 32_768 == 49_283_072
    assert bench.step_flops(cfg, 64).hardware == f.model_full
    # a step of 0.5 s on a device of 1 GFLOP/s peak (1e-3 TFLOP/s): 5e8 FLOPs of capacity
    causal, full, hfu = bench.utilization(f, 0.5, 1e-3)
    assert causal == pytest.approx(45_613_056 / 5e8)
    assert full == pytest.approx(47_185_920 / 5e8)
    assert hfu == pytest.approx(49_283_072 / 5e8)
    assert bench.utilization(f, 0.5, None) == (None, None, None)


def test_largest_micro_batch_halves_then_bisects():
    tried = []

    def fits_at(b: int) -> bool:
        tried.append(b)
        return b <= 5

    assert bench.largest_micro_batch(None, 16, torch.device("cpu"), fits_at) == 5
    assert tried == [16, 8, 4, 6, 5]
    assert bench.largest_micro_batch(None, 4, torch.device("cpu"), fits_at) == 4
    with pytest.raises(SystemExit):
        bench.largest_micro_batch(None, 4, torch.device("cpu"), lambda b: False)


def test_peer_loop_trains_and_is_measured():
    cfg = bench.with_train(make_config("tiny"), micro_batch_size=2, precision="bf16")
    device = torch.device("cpu")
    step = bench.peer_step(cfg, device, compile_backend=None)
    (batch,) = bench.batches(1, 2, cfg.data.seq_len, cfg.model.vocab_size, device)
    data = [batch] * 4  # the same batch: the loss must fall
    flops = bench.step_flops(cfg, 64)
    result = bench.measure("peer", step, data, 0, flops, 1e-3, device)
    assert result.losses[-1] < result.losses[0]
    assert result.tokens_s == pytest.approx(64 / result.step_s)
    assert result.mfu_full == pytest.approx(flops.model_full / (1e9 * result.step_s))
    assert "MFU causal" in result.line()


def test_the_search_starts_where_the_planner_puts_memory_under_80_percent():
    cfg = make_config("llama-1b", parallel=dict(dp=1),
                      train=dict(precision="bf16", grad_accum=1))
    h200 = 139 * 2**30
    b = bench.planned_micro_batch(cfg, h200)
    assert 1 <= b < 64
    assert bench.planned_micro_batch(cfg, h200 / 2) < b
