"""`tessera generate` and `tessera eval` read a checkpoint's consolidated weights: eval
reproduces the trainer's own validation loss, generate continues a prompt with top-k / top-p /
greedy."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.cli import app
from tessera.config import make_config
from tessera.data.loader import TokenDataset
from tessera.evaluate import evaluate
from tessera.generate import filter_logits
from tessera.metrics import read_metrics
from tessera.model import Transformer
from tessera.testing import assert_close_summed
from tessera.weights import load_weights

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = runner.invoke(app, [
        "train", "--preset", "tiny", "--data", tiny_data, "--steps", "6", "--out", str(out),
        "--checkpoint-interval", "6", "--no-progress", "--set", "data.seq_len=16",
        "--set", "data.val_tokens=256", "--set", "train.sample_tokens=0"])
    assert result.exit_code == 0, result.output
    return out


def test_eval_reproduces_the_trainers_validation_loss(trained, tiny_data):
    summary = json.loads((trained / "summary.json").read_text())
    step, val = summary["val_losses"][-1]
    result = runner.invoke(app, ["eval", "--checkpoint", str(trained), "--data", tiny_data,
                                 "--seq-len", "16", "--tokens", "256"])
    assert result.exit_code == 0, result.output
    assert f"step-{step:07d}" in result.output
    # What the command printed is the API's result, rounded for print (an exact check).
    cfg, state = load_weights(trained)
    model = Transformer(cfg)
    model.load_state_dict(state)
    got = evaluate(model, TokenDataset(tiny_data), 16, 256)
    assert f"loss {got.loss:.4f} nats/token, perplexity {math.exp(got.loss):.2f}" in result.output
    # The same windows through the same fp32 model; only the batching differs, so the mean
    # over the 256 targets (and the per-row sums of each window's 16 positions and 256 logits)
    # is added in another order: the summation bound over those terms.
    assert_close_summed(got.loss, val, terms=256 + 16 + 256, msg="eval vs trainer val loss")


def test_generate_from_a_checkpoint(trained):
    args = ["generate", "--checkpoint", str(trained / "checkpoints"), "--prompt", "def ",
            "--tokens", "20"]
    a, b = runner.invoke(app, args), runner.invoke(app, args)
    assert a.exit_code == 0, a.output
    assert a.output == b.output and a.output.startswith("def ")  # seeded: repeatable
    greedy = runner.invoke(app, args + ["--temperature", "0"])
    assert greedy.exit_code == 0 and greedy.output.startswith("def ")
    nucleus = runner.invoke(app, args + ["--top-p", "0.5", "--top-k", "0", "--seed", "3"])
    assert nucleus.exit_code == 0 and nucleus.output.startswith("def ")


def test_generate_and_eval_bad_input(trained, tmp_path, tiny_data):
    assert "--top-p=0.0: must be in (0, 1]" in cli_error(
        ["generate", "--checkpoint", str(trained), "--top-p", "0"])
    assert "no meta.json there" in cli_error(["generate", "--checkpoint", str(tmp_path)])
    assert "--seq-len=999: must be <= the model's max_seq_len=64" in cli_error(
        ["eval", "--checkpoint", str(trained), "--data", tiny_data, "--seq-len", "999"])


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.1, 0.3, 0.1]))
    kept = lambda t: torch.isfinite(t).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 2, None)) == [0, 2]
    # p values sit away from the cumulative sums (0.5, 0.8, 0.9, 1.0): softmax of these logits
    # is exact only to a few ulps, and a kernel set may round 0.5 to 0.49999997.
    assert kept(filter_logits(logits, None, 0.45)) == [0]  # 0.5 alone reaches p
    assert kept(filter_logits(logits, None, 0.7)) == [0, 2]  # 0.5 + 0.3 >= 0.7
    assert kept(filter_logits(logits, None, 0.85)) in ([0, 1, 2], [0, 2, 3])  # a 0.1 joins
    assert kept(filter_logits(logits, None, 1.0)) == [0, 1, 2, 3]


def test_init_from_a_checkpoint_starts_where_it_ended(trained, tiny_data, tmp_path):
    # The new run's step-0 validation scores the loaded weights on the same windows: it equals
    # the first run's last validation loss (same fp32 model, same windows, same batching).
    summary = json.loads((trained / "summary.json").read_text())
    out = tmp_path / "second"
    result = runner.invoke(app, [
        "train", "--preset", "demo", "--data", tiny_data, "--steps", "1", "--dp", "1",
        "--init-from", str(trained), "--out", str(out), "--no-progress", "--set",
        "data.seq_len=16", "--set", "data.val_tokens=256", "--set", "train.sample_tokens=0",
        "--set", "train.micro_batch_size=8"])
    assert result.exit_code == 0, result.output
    first = read_metrics(out / "metrics.jsonl")[0]
    assert first["step"] == 0
    # Same weights, windows, batching and kernels: the same arithmetic, so exactly equal.
    assert first["val_loss"] == summary["val_losses"][-1][1]
    # The model's shape came from the weights (tiny's), not from the demo preset.
    assert json.loads((out / "config.json").read_text())["model"]["d_model"] == 64
    assert "no meta.json there" in cli_error(["train", "--preset", "tiny", "--data", tiny_data,
                                              "--init-from", str(tmp_path / "none")])


@pytest.mark.slow
def test_init_from_under_tensor_parallelism(trained, tiny_data, tmp_path):
    # Each tp rank cuts its shards from the loaded full tensors, as from the initializer.
    import subprocess
    import sys

    summary = json.loads((trained / "summary.json").read_text())
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--preset", "tiny",
                           "--data", tiny_data, "--nproc", "2", "--tp", "2", "--steps", "1",
                           "--init-from", str(trained), "--out", str(tmp_path / "tp"),
                           "--no-progress", "--set", "data.seq_len=16", "--set",
                           "data.val_tokens=256", "--set", "train.sample_tokens=0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = read_metrics(tmp_path / "tp" / "metrics.jsonl")[0]
    # tp splits the contractions over heads and the MLP's inner size across ranks and adds the
    # partial sums, and the loss is a mean over 256 targets of a softmax over 256 logits: the
    # summation bound over those terms, per layer for the contractions.
    cfg = make_config("tiny").model
    terms = 256 + 256 + cfg.n_layers * (cfg.d_model + cfg.ffn_hidden)
    assert_close_summed(first["val_loss"], summary["val_losses"][-1][1], terms=terms,
                        msg="val loss under tp=2")
