"""Activation recomputation (`parallel.recompute`): same numbers, fewer stored activations.

Recomputation runs the same kernels on the same inputs a second time, so on a CPU the loss and
every gradient are bitwise equal to the run without it (tolerance 0). Proofs:

- one process: reference model with none / selective / full: equal loss and gradients; the
  attention core runs twice per step under both modes; full keeps less than a third of the
  bytes for backward (measured 0.29 of none: at this size the logits and the embedding
  output, which no block recomputes, are much of what is left); selective keeps no more than
  none (0.97: the fused CPU attention kernel stores no s² tensors to drop);
- data parallelism, 2 ranks: loss, every gradient and the parameters over 10 steps against the
  single-device model (tests/dp_parity.py, its tolerances);
- tensor parallelism (with and without SP), 1F1B pipeline and ZeRO-3 on 2 ranks: every step's
  loss, every local gradient (TP/PP: each parameter shard's; ZeRO-3: the rank's gradient shard
  of each unit) and the parameters after 3 steps equal the same layout without recomputation,
  which tests/test_tensor_parallel.py, test_pipeline_runtime.py and test_zero.py prove equal
  to the single-device model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from cli_errors import cli_error
from dp_parity import (
    assert_matches_reference,
    distributed_run,
    global_batch,
    tiny_config,
)
from tessera.cli import app
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.metrics import read_metrics
from tessera.model import build_model, cross_entropy
from tessera.parallel.recompute import apply_recompute
from tessera.testing import run_ranks


@contextlib.contextmanager
def count_attention() -> Iterator[list[int]]:
    """Count calls of the attention kernel (forward and recomputation) in this process."""
    calls: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = sdpa


def _one_step(mode: str) -> dict[str, Any]:
    cfg = tiny_config()
    model = build_model(cfg.model, seed=0)
    wrapped = apply_recompute(model, mode)
    x, y = global_batch(0)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            saved.append(t.numel() * t.element_size())
        return t

    with count_attention() as calls:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = cross_entropy(model(x), y)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(loss=loss.detach(), grads=grads, saved=sum(saved), attention=len(calls),
                wrapped=wrapped)


def test_single_process_same_numbers_less_memory():
    layers = tiny_config().model.n_layers
    none, sel, full = (_one_step(mode) for mode in ("none", "selective", "full"))
    assert (none["wrapped"], sel["wrapped"], full["wrapped"]) == (0, layers, layers)
    for run in (sel, full):
        torch.testing.assert_close(run["loss"], none["loss"], rtol=0, atol=0)
        assert run["grads"].keys() == none["grads"].keys()
        for name, g in none["grads"].items():
            torch.testing.assert_close(run["grads"][name], g, rtol=0, atol=0, msg=name)
    # The attention core runs in the forward, and again in backward when recomputed.
    assert none["attention"] == layers
    assert sel["attention"] == full["attention"] == 2 * layers
    assert sel["saved"] <= none["saved"]
    assert full["saved"] < none["saved"] / 3


def test_bad_mode_and_double_application_are_refused():
    model = build_model(tiny_config().model, seed=0)
    with pytest.raises(ValueError, match="recompute='some': must be one of none, selective"):
        apply_recompute(model, "some")
    apply_recompute(model, "full")
    with pytest.raises(ValueError, match="Block already recomputes"):
        apply_recompute(model, "full")
    with pytest.raises(ConfigError, match="parallel.recompute='some': must be one of none"):
        make_config("tiny", parallel=dict(recompute="some"))


# -- multi-process --------------------------------------------------------------------------


def _dp_rank() -> dict:
    return distributed_run(tiny_config(dp=2, recompute="full"), shadow=True)[1]


@pytest.mark.multiprocess
def test_data_parallel_with_full_recompute_matches_single_device():
    for rank, run in enumerate(run_ranks(_dp_rank, 2)):
        assert_matches_reference(run, f"dp=2 recompute=full rank {rank}")


LAYOUTS = {
    "tp=2": dict(tp=2, dp=1),
    "tp=2 sp": dict(tp=2, dp=1, sequence_parallel=True),
    "pp=2 1f1b": dict(pp=2, dp=1, schedule="1f1b"),
    "zero-3 dp=2": dict(dp=2, zero_stage=3),
}


def _local_grads(engine) -> list[torch.Tensor]:
    if engine.model.sharded:
        return [u.grad.clone() for z in engine.model.zeros for u in z.units]
    return [p.grad.clone() for p in engine.parameters() if p.grad is not None]


def _trajectory(parallel: dict, recompute: str, steps: int = 3) -> dict[str, Any]:
    cfg = tiny_config(accum=2, recompute=recompute, **parallel)
    with count_attention() as calls:
        _, run = distributed_run(cfg, steps, grads=_local_grads,
                                 params=lambda engine: engine.full_state_dict())
    return dict(run, attention=len(calls))


def _layout_rank(parallel: dict, modes: tuple[str, ...]) -> dict[str, Any]:
    return {mode: _trajectory(parallel, mode) for mode in ("none", *modes)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", LAYOUTS)
def test_recompute_changes_no_number_in_parallel_layouts(name):
    modes = ("selective", "full") if name.startswith("tp") else ("full",)
    for rank, runs in enumerate(run_ranks(_layout_rank, 2, args=(LAYOUTS[name], modes))):
        base = runs["none"]
        assert base["attention"] > 0
        for mode in modes:
            got, label = runs[mode], f"{name} rank {rank} recompute={mode}"
            # The recomputed attention runs once more in every backward.
            assert got["attention"] == 2 * base["attention"], label
            assert got["losses"] == base["losses"], label
            for step, (g, b) in enumerate(zip(got["grads"], base["grads"], strict=True)):
                assert len(g) == len(b) > 0, label
                for i, (gi, bi) in enumerate(zip(g, b, strict=True)):
                    torch.testing.assert_close(gi, bi, rtol=0, atol=0,
                                               msg=f"{label} step {step} grad {i}")
            assert got["params"].keys() == base["params"].keys()
            for key, value in base["params"].items():
                torch.testing.assert_close(got["params"][key], value, rtol=0, atol=0,
                                           msg=f"{label} {key}")


def test_cli_recompute_reaches_the_run_and_changes_no_loss(tiny_data, tmp_path):
    """In-process, one rank: the flag lands in the run's config and the loss curve is bitwise
    the same as without it (same seed, same data)."""
    curves = {}
    for mode in ("none", "full"):
        out = tmp_path / mode
        result = CliRunner().invoke(app, [
            "train", "--preset", "tiny", "--data", tiny_data, "--dp", "1", "--recompute", mode,
            "--steps", "3", "--out", str(out), "--no-progress", "--set", "data.seq_len=16",
            "--set", "data.val_tokens=256", "--set", "train.sample_tokens=0"])
        assert result.exit_code == 0, result.output
        assert json.loads((out / "config.json").read_text())["parallel"]["recompute"] == mode
        curves[mode] = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(curves["none"]) == 3 and curves["full"] == curves["none"]
    assert "parallel.recompute='most'" in cli_error(["train", "--preset", "tiny", "--data",
                                                     tiny_data, "--recompute", "most"])
