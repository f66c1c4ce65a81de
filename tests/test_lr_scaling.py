"""train.lr_scaling: lr and warm-up scaled with the global batch against train.reference_batch
(none, linear after Goyal et al. 2017, sqrt after Malladi et al. 2022), used by the optimizer,
printed at start-up and written in the step-0 metrics record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.cli import app
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.metrics import read_metrics
from tessera.optim import lr_lambda, scaled
from tessera.trainer import run


def _train(**train):
    t = dict(steps=180, warmup_steps=4, lr=1e-3, min_lr_ratio=0.1) | train
    return make_config("tiny", train=t).train


@pytest.mark.parametrize("rule", ["none", "linear", "sqrt"])
@pytest.mark.parametrize("global_batch, reference", [(64, 16), (8, 16), (16, 16)])
def test_schedule_follows_rule(rule, global_batch, reference):
    cfg = _train(lr_scaling=rule, reference_batch=reference)
    got, note = scaled(cfg, global_batch)
    k = global_batch / reference
    scale = {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[rule]
    # Goyal's 5 of 90 epochs: ceil(180 / 18) = 10 steps, only for linear with k > 1.
    warmup = 10 if rule == "linear" and k > 1 else 4
    assert got.lr == pytest.approx(1e-3 * scale) and got.warmup_steps == warmup
    if scale == 1.0:
        assert note is None and got == cfg
    else:
        assert note == {"lr_scale": pytest.approx(scale), "scaled_lr": pytest.approx(1e-3 * scale),
                        "scaled_warmup_steps": warmup}
    f = lr_lambda(got)
    peak = got.lr
    assert peak * f(0) == pytest.approx(peak / warmup)  # first warm-up step
    assert peak * f(warmup - 1) == pytest.approx(peak)  # end of warm-up: the scaled peak
    assert peak * f(warmup - 2) < peak
    assert f(warmup) == 1.0  # the cosine's first step: cos 0, the peak itself, not above it
    # The last step before the end: one cosine step above the floor, its exact value.
    last = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (179 - warmup) / (180 - warmup)))
    assert peak * f(179) == pytest.approx(1e-3 * scale * last)
    assert peak * f(180) == pytest.approx(0.1 * 1e-3 * scale)
    assert f(200) == f(180)  # past the last step the rate stays at the floor


def test_reference_zero_and_warmup_kept_when_longer():
    assert scaled(_train(lr_scaling="linear", reference_batch=0), 64) == (
        _train(lr_scaling="linear", reference_batch=0), None)
    got, _ = scaled(_train(lr_scaling="linear", reference_batch=16, warmup_steps=30), 64)
    assert got.warmup_steps == 30  # already longer than ceil(180 / 18)
    # 5 of 90 epochs rounds up: 181 / 18 = 10.06 steps warm up over 11.
    got, note = scaled(_train(steps=181, lr_scaling="linear", reference_batch=16), 64)
    assert got.warmup_steps == note["scaled_warmup_steps"] == 11


@pytest.mark.parametrize("field, value", [("lr_scaling", "cubic"), ("reference_batch", -1)])
def test_bad_values_refused(field, value):
    with pytest.raises(ConfigError, match=f"train.{field}"):
        make_config("tiny", train={field: value})


def test_bad_flags_one_line(tiny_data, tmp_path):
    base = ["train", "--preset", "tiny", "--data", tiny_data, "--out", str(tmp_path / "o")]
    assert cli_error(base + ["--lr-scaling", "cubic"]) == (
        "error: train.lr_scaling='cubic': must be one of none, linear, sqrt")
    assert cli_error(base + ["--reference-batch", "-1"]) == (
        "error: train.reference_batch=-1: must be >= 0")


def test_flags_in_help():
    out = CliRunner().invoke(app, ["train", "--help"], terminal_width=200).output
    assert "--lr-scaling" in out and "--reference-batch" in out


def _run(data, out, **train):
    t = dict(steps=4, warmup_steps=2, lr=1e-3, eval_interval=0, sample_tokens=0,
             micro_batch_size=4, grad_accum=1, out_dir=str(out)) | train
    cfg = make_config("tiny", overrides=[f"data.path={data}", "data.seq_len=16",
                                         "data.val_tokens=512"], train=t)
    run(cfg, progress=False)
    return read_metrics(Path(out) / "metrics.jsonl")


def test_run_prints_and_logs_scaling(tiny_data, tmp_path, capsys):
    rows = _run(tiny_data, tmp_path, lr_scaling="linear", reference_batch=1)  # k = 4
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("lr scaling")]
    assert line == ["lr scaling: linear, global batch 4 vs reference 1: lr 0.001 x 4 = 0.004, "
                    "warm-up 2 steps"]
    assert rows[0]["step"] == 0 and rows[0]["lr_scale"] == 4
    assert rows[0]["scaled_lr"] == pytest.approx(4e-3) and rows[0]["scaled_warmup_steps"] == 2
    assert rows[1]["lr"] == pytest.approx(4e-3)  # the optimizer's rate after warm-up step 2


def test_run_without_scaling_says_nothing(tiny_data, tmp_path, capsys):
    rows = _run(tiny_data, tmp_path, lr_scaling="none", reference_batch=1)
    assert "lr scaling" not in capsys.readouterr().out
    assert "lr_scale" not in rows[0] and rows[1]["lr"] == pytest.approx(1e-3)


def test_resume_keeps_scaled_schedule(tiny_data, tmp_path):
    """A run resumed from its step-2 checkpoint logs the scaled rates of the whole run."""
    from tessera.checkpoint import step_dir

    extra = dict(steps=4, checkpoint_interval=2, keep_checkpoints=0, warmup_steps=3,
                 lr_scaling="sqrt", reference_batch=16)  # k = 1/4: half the rate
    a = [r for r in _run(tiny_data, tmp_path / "a", **extra) if "loss" in r]
    b = _run(tiny_data, tmp_path / "b", resume=str(step_dir(tmp_path / "a" / "checkpoints", 2)),
             **extra)
    b = [r for r in b if "loss" in r]
    assert [r["lr"] for r in a] == pytest.approx([5e-4 * 2 / 3, 5e-4, 5e-4, 5e-5])
    assert [(r["step"], r["lr"], r["loss"]) for r in b] == [
        (r["step"], r["lr"], r["loss"]) for r in a[2:]]
