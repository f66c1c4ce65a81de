"""The trainer: loss falls on the tiny preset, metrics are logged, and data parallelism over
two ranks reproduces the single-process run step for step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessera.config_io import make_config
from tessera.metrics import read_metrics
from tessera.model import build_model, cross_entropy
from tessera.optim import lr_lambda
from tessera.step import build_executor
from tessera.testing import assert_close_summed, assert_curves_close, run_ranks
from tessera.topology import Topology
from tessera.trainer import run, train


def _cfg(data, out, **train):
    t = dict(steps=12, eval_interval=6, sample_tokens=16, out_dir=str(out)) | train
    return make_config("tiny", overrides=[f"data.path={data}", "data.seq_len=16",
                                          "data.val_tokens=512"], train=t)


def _metrics(out) -> list[dict]:
    """Per-step records (the step-0 validation record left out)."""
    return [r for r in read_metrics(Path(out) / "metrics.jsonl") if r["step"] > 0]


def test_loss_decreases_and_metrics_logged(tiny_data, tmp_path):
    cfg = _cfg(tiny_data, tmp_path, steps=30, lr=1e-2)
    result = run(cfg, progress=False)
    rows = _metrics(tmp_path)
    assert len(rows) == 30
    # The tiny corpus is highly repetitive: 30 steps take the loss from ~5.5 well below 4.
    assert rows[0]["loss"] > 5.0 and rows[-1]["loss"] < 4.0
    assert result.val_losses[0][0] == 0 and result.val_losses[0][1] > 5.0  # ~ln 256 at start
    assert result.val_losses[0][1] > result.val_losses[-1][1]
    for key in ("lr", "grad_norm", "tokens_per_s", "model_flops_per_s", "peak_mem_bytes",
                "step_s"):
        assert rows[-1][key] > 0, key
    assert rows[-1]["mfu"] is None  # CPU: no peak known unless the user states one
    assert (tmp_path / "sample.txt").read_text() == result.sample and len(result.sample) > 0
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 30


def test_mfu_against_stated_peak(tiny_data, tmp_path):
    run(_cfg(tiny_data, tmp_path, steps=2, peak_tflops=1.0, sample_tokens=0), progress=False)
    row = _metrics(tmp_path)[-1]
    assert row["mfu"] == pytest.approx(row["model_flops_per_s"] / 1e12)


def test_warmup_cosine_schedule():
    cfg = make_config("tiny", train=dict(steps=110, warmup_steps=10, min_lr_ratio=0.1)).train
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)  # halfway through the cosine: (1 + 0.1) / 2
    assert f(110) == pytest.approx(0.1)


def _train_two_ranks(cfg):
    train(cfg, progress=False)


@pytest.mark.multiprocess
def test_two_rank_dp_matches_single_process(tiny_data, tmp_path):
    # Same global batch: one process accumulating 2 micro-batches of 4, or 2 ranks with 1 each.
    single = _cfg(tiny_data, tmp_path / "one", grad_accum=2, micro_batch_size=4)
    run(single, progress=False)
    dp = _cfg(tiny_data, tmp_path / "two", grad_accum=1, micro_batch_size=4)
    dp.parallel.dp = 2
    run_ranks(_train_two_ranks, 2, args=(dp,))
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    # fp32; the only difference is the order of summing the global batch's tokens (two
    # micro-batches, or two ranks' halves): the summation bound, growing step by step
    # (tessera.testing.assert_curves_close).
    tokens = 8 * 16
    for key in ("loss", "grad_norm"):
        assert_curves_close([r[key] for r in b], [r[key] for r in a], terms_per_step=tokens,
                            msg=key)
    assert_close_summed(b[-1]["val_loss"], a[-1]["val_loss"], terms=tokens * len(a),
                        msg="val_loss")


def _dp_grads(cfg, batch):
    topo = Topology.build(cfg.parallel)
    engine = build_executor(cfg, topo, torch.device("cpu"))
    rank, n = topo.coords()["dp"], topo.dp
    x, y = batch
    mine = slice(rank * x.shape[0] // n, (rank + 1) * x.shape[0] // n)
    loss = engine.forward_backward([(x[mine], y[mine])])
    return loss, {k: p.grad.clone() for _, k, p in engine.model.named_chunk_parameters()}


@pytest.mark.multiprocess
def test_dp_engine_gradients_equal_reference():
    cfg = make_config("tiny", parallel=dict(dp=2))
    x = torch.randint(0, 256, (8, 17))
    batch = (x[:, :-1], x[:, 1:])
    ref = build_model(cfg.model, cfg.train.seed)
    ref_loss = cross_entropy(ref(batch[0]), batch[1])
    ref_loss.backward()
    for loss, grads in run_ranks(_dp_grads, 2, args=(cfg, batch)):
        # fp32, two half-batch means averaged vs one full-batch mean, from the same
        # parameters: the summation bound over the batch's tokens.
        assert_close_summed(loss, ref_loss.item(), terms=batch[1].numel(), msg="loss")
        for name, p in ref.named_parameters():
            assert_close_summed(grads[name], p.grad, terms=batch[1].numel(), msg=name)
