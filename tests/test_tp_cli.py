"""`tessera train --tp N [--sequence-parallel]` end to end, and its bad-input errors.

Every bad layout is refused with one line naming the numbers and exit code 2, before any rank
is launched or any collective runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_errors import cli_error
from tessera.config_io import make_config
from tessera.metrics import read_metrics
from tessera.testing import assert_close_summed, assert_curves_close
from tessera.trainer import run


def _fail(args: list[str]) -> str:
    return cli_error(["train", "--preset", "tiny", "--no-progress", *args])


def test_heads_not_divisible_by_tp(tiny_data):
    line = _fail(["--data", tiny_data, "--tp", "3"])
    assert line == "error: parallel.tp=3: must divide model.n_heads=4"


def test_kv_heads_neither_divisible_nor_multiple(tiny_data):
    # 12 query heads split 6 ways is fine, but 4 key/value heads can be neither split 6 ways
    # nor replicated evenly (rank 1's two query heads would read two different kv heads).
    line = _fail(["--data", tiny_data, "--tp", "6", "--set", "model.n_heads=12",
                  "--set", "model.d_model=96", "--set", "model.n_kv_heads=4"])
    assert line == "error: parallel.tp=6: must divide model.n_kv_heads=4 or be a multiple of it"


def test_mlp_hidden_size_not_divisible_by_tp(tiny_data):
    # (tp | n_heads and n_heads | d_model already imply tp | d_model; the MLP's hidden size is
    # the one that can still fail.)
    line = _fail(["--data", tiny_data, "--tp", "4", "--set", "model.ffn_hidden=90"])
    assert line == "error: parallel.tp=4: must divide model.ffn_hidden=90"


def test_sequence_parallel_needs_divisible_sequence(tiny_data):
    line = _fail(["--data", tiny_data, "--tp", "4", "--sequence-parallel",
                  "--set", "data.seq_len=30"])
    assert line == ("error: data.seq_len=30: must be divisible by parallel.tp=4 with sequence "
                    "parallelism")


def test_tp_refuses_what_it_does_not_compose_with(tiny_data):
    line = _fail(["--data", tiny_data, "--tp", "2", "--dp", "2", "--dp-mode", "ps"])
    assert line.startswith("error: parallel.tp=2: dp_mode='ps' composes only with data "
                           "parallelism (must be 1)")


def _losses(out: Path) -> list[float]:
    rows = read_metrics(out / "metrics.jsonl")
    return [r["loss"] for r in rows if r["step"] > 0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_train_tp_sp_with_dp_matches_single_process(tiny_data, tmp_path):
    """`--tp 2 --dp 2 --sequence-parallel` on 4 launched ranks reproduces, step for step, one
    process taking the same global batch as 2 micro-batches (fp32: the sums over the global
    batch's 2 x 8 x 16 tokens and over the vocabulary's 256 logits in another order)."""
    sets = ["data.seq_len=16", "data.val_tokens=512", "train.sample_tokens=8",
            "train.eval_interval=0", "train.log_interval=1"]
    out = tmp_path / "tp"
    cmd = [sys.executable, "-m", "tessera", "train", "--preset", "tiny", "--data", tiny_data,
           "--tp", "2", "--dp", "2", "--sequence-parallel", "--steps", "4", "--no-progress",
           "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp=2 cp=1 tp=2" in proc.stdout
    ref = make_config("tiny", overrides=[f"data.path={tiny_data}", *sets],
                      train=dict(steps=4, grad_accum=2, out_dir=str(tmp_path / "ref")))
    result = run(ref, progress=False)
    terms = 2 * 8 * 16 + 256
    assert_curves_close(_losses(out), _losses(tmp_path / "ref"), terms_per_step=terms,
                        msg="loss")
    summary = json.loads((out / "summary.json").read_text())
    assert_close_summed(summary["val_losses"][-1][1], result.val_losses[-1][1],
                        terms=4 * terms, msg="val_loss")
