"""`tessera train --cp N --cp-method M` end to end, and its bad-input errors.

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
from tessera.checkpoint import load_model
from tessera.config_io import make_config
from tessera.data.loader import TokenDataset
from tessera.evaluate import evaluate
from tessera.metrics import read_metrics
from tessera.model import Transformer
from tessera.testing import assert_close_summed, assert_curves_close
from tessera.trainer import run


def _fail(args: list[str]) -> str:
    return cli_error(["train", "--preset", "tiny", "--no-progress", *args])


def test_sequence_not_a_multiple_of_two_cp(tiny_data):
    line = _fail(["--data", tiny_data, "--cp", "2", "--set", "data.seq_len=30"])
    assert line == ("error: data.seq_len=30: must split into 2*parallel.cp zig-zag chunks "
                    "(parallel.cp=2: a multiple of 4)")


def test_ulysses_heads(tiny_data):
    line = _fail(["--data", tiny_data, "--cp", "8", "--cp-method", "ulysses"])
    assert line == ("error: parallel.cp=8: ulysses: query heads per tp rank (model.n_heads/tp=4) "
                    "must be divisible by the Ulysses degree 8")
    line = _fail(["--data", tiny_data, "--cp", "4", "--cp-method", "hybrid", "--cp-ulysses", "3"])
    assert line == "error: parallel.cp_ulysses=3: must be >= 2 and divide parallel.cp=4"


def test_cp_refuses_what_it_does_not_compose_with(tiny_data):
    line = _fail(["--data", tiny_data, "--cp", "2", "--tp", "4", "--sequence-parallel",
                  "--set", "data.seq_len=12"])
    assert line == ("error: data.seq_len=12: / parallel.cp=2 must be divisible by parallel.tp=4 "
                    "with sequence parallelism (each cp rank's tokens split over tp)")
    line = _fail(["--data", tiny_data, "--cp", "2", "--dp", "2", "--dp-mode", "ps"])
    assert line.startswith("error: parallel.dp_mode='ps': context parallelism reduces")


def _losses(out: Path) -> list[float]:
    rows = read_metrics(out / "metrics.jsonl")
    return [r["loss"] for r in rows if r["step"] > 0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_train_cp_with_dp_matches_single_process(tiny_data, tmp_path):
    """`--cp 2 --dp 2` (ring) on 4 launched ranks reproduces, step for step, one process taking
    the same global batch as 2 micro-batches: the loader cuts each rank's zig-zag tokens, the
    loss is averaged over dp × cp, and its validation of the final weights is the single-device
    model's on the same weights (the checkpoint it writes after its last step)."""
    sets = ["data.seq_len=16", "data.val_tokens=512", "train.sample_tokens=8",
            "train.eval_interval=0", "train.log_interval=1"]
    out = tmp_path / "cp"
    cmd = [sys.executable, "-m", "tessera", "train", "--preset", "tiny", "--data", tiny_data,
           "--cp", "2", "--dp", "2", "--cp-method", "ring", "--steps", "4", "--no-progress",
           "--out", str(out), "--set", "train.checkpoint_interval=4"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp=2 tp=1 pp=1 cp=2" in proc.stdout, proc.stdout[-2000:]
    ref = make_config("tiny", overrides=[f"data.path={tiny_data}", *sets],
                      train=dict(steps=4, grad_accum=2, out_dir=str(tmp_path / "ref")))
    result = run(ref, progress=False)
    # Each step sums the global batch's 2 x 8 x 16 tokens in another order (dp x cp ranks
    # against 2 micro-batches of one process); step k carries k such reorderings.
    assert_curves_close(_losses(out), _losses(tmp_path / "ref"), terms_per_step=2 * 8 * 16,
                        msg="cp2 x dp2 losses")
    assert len(result.val_losses) == 2  # the reference ran: step 0 and the last step
    # Validation of the final weights: the run's mean over the 512 validation targets (each
    # dp x cp rank sums its windows' zig-zag halves, the ring merging attention blocks), against
    # the single-device model on the run's own final weights (its checkpoint after step 4):
    # the same mean of 512 positive terms in another order, so the summation bound over 512
    # terms, the loss itself as the scale. How far the run's weights are from the single-
    # device run's is the trajectory's question, which the loss curve above answers.
    model_cfg, state, _ = load_model(out / "checkpoints")
    model = Transformer(model_cfg)
    model.load_state_dict(state)
    want = evaluate(model, TokenDataset(tiny_data), seq_len=16, n_tokens=512)
    summary = json.loads((out / "summary.json").read_text())
    step, got = summary["val_losses"][-1]
    assert step == 4 and want.tokens == 512
    assert_close_summed(got, want.loss, terms=want.tokens, msg="cp2 x dp2 final validation")
