"""`tessera generate` and `tessera eval` read a checkpoint's consolidated weights: eval by
default reproduces the trainer's own validation loss, generate continues a prompt with top-k /
top-p / greedy."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.checkpoint import step_dir
from tessera.cli import app
from tessera.config_io import make_config
from tessera.data.loader import TokenDataset
from tessera.data.prepare import prepare
from tessera.data.tokenizer import ByteTokenizer
from tessera.evaluate import evaluate, trained_validation
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


def test_eval_defaults_to_the_trainers_validation(trained, tiny_data):
    # `tessera eval --checkpoint RUN` alone scores what the run's last validation scored: its
    # data set's val split, windows of data.seq_len=16 (not the model's 64), the 256 targets
    # of data.val_tokens, in batches of 4 micro-batches (32 windows).
    summary = json.loads((trained / "summary.json").read_text())
    step, val = summary["val_losses"][-1]
    result = runner.invoke(app, ["eval", "--checkpoint", str(trained)])
    assert result.exit_code == 0, result.output
    assert f"step-{step:07d}" in result.output
    assert f"(256 tokens of {tiny_data}, 16 windows of 16)" in result.output
    assert "note:" not in result.output  # nothing fell back
    assert f"loss {val:.4f} nats/token, perplexity {math.exp(val):.2f}" in result.output
    # Tolerance 0: the same fp32 weights, windows and batches through the same kernels, each
    # batch's mean loss times its targets added in fp32 in the same order as the trainer's
    # validation adds them; the same arithmetic, so the same number.
    ckpt = step_dir(trained / "checkpoints", step)
    defaults = trained_validation(ckpt)
    assert defaults == {"data": tiny_data, "seq_len": 16, "tokens": 256, "batch_size": 32}
    cfg, state = load_weights(trained)
    model = Transformer(cfg)
    model.load_state_dict(state)
    got = evaluate(model, TokenDataset(tiny_data), 16, 256, 32)
    assert got.loss == val and (got.tokens, got.windows) == (256, 16)


def test_eval_with_other_windows_says_what_it_scored(trained, tiny_data):
    # Windows of the model's 64 tokens: other targets scored, so another (close) loss; the
    # printed loss is the API's result, rounded for print.
    result = runner.invoke(app, ["eval", "--checkpoint", str(trained), "--data", tiny_data,
                                 "--seq-len", "64", "--tokens", "512", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    cfg, state = load_weights(trained)
    model = Transformer(cfg)
    model.load_state_dict(state)
    got = evaluate(model, TokenDataset(tiny_data), 64, 512, 4)
    assert f"loss {got.loss:.4f} nats/token" in result.output
    assert f"(512 tokens of {tiny_data}, 8 windows of 64)" in result.output


def _small_val_data(root: Path, val_tokens: int) -> str:
    """A prepared byte-level data set whose val split holds about `val_tokens` tokens."""
    text = "def add(a, b):\n    return a + b\n\n" * 300
    src = root / "src"
    src.mkdir()
    (src / "a.py").write_text(text)
    out = root / "data"
    prepare([str(src)], out, ByteTokenizer(), val_percent=100 * val_tokens / len(text))
    return str(out)


def test_eval_on_a_small_val_split_scores_what_it_holds(trained, tmp_path):
    data = _small_val_data(tmp_path, 50)
    held = len(TokenDataset(data).val)
    assert 17 <= held < 64 + 1  # some windows of 16 (of the trainer's 16), none of 64
    windows = (held - 1) // 16
    result = runner.invoke(app, ["eval", "--checkpoint", str(trained), "--data", data])
    assert result.exit_code == 0, result.output
    assert (f"note: the val split holds {windows} windows of 16 ({windows * 16:,} targets), "
            "fewer than --tokens=256: scoring all of them") in result.output
    assert f"({windows * 16} tokens of {data}, {windows} windows of 16)" in result.output
    # Windows longer than the split: nothing to score, said with eval's own flag.
    line = cli_error(["eval", "--checkpoint", str(trained), "--data", data, "--seq-len", "64"])
    assert line.startswith(f"error: --seq-len=64: the val split of {data} holds {held} tokens, "
                           "fewer than one window of --seq-len + 1"), line


def test_eval_of_an_older_checkpoint_or_hugging_face_weights(trained, tiny_data, tmp_path):
    # A checkpoint that records no validation: --data is required, and the targets fall back
    # to 65,536, more than the tiny val split holds: it scores all its windows, saying so.
    old = tmp_path / "old"
    shutil.copytree(step_dir(trained / "checkpoints", 6), old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["validation"]
    (old / "meta.json").write_text(json.dumps(meta))
    line = cli_error(["eval", "--checkpoint", str(old)])
    assert line == (f"error: --data=None: required: {old} does not record the data set its run "
                    "trained on"), line
    result = runner.invoke(app, ["eval", "--checkpoint", str(old), "--data", tiny_data])
    assert result.exit_code == 0, result.output
    held = (len(TokenDataset(tiny_data).val) - 1) // 16
    assert f"note: 65,536 targets: {old} does not record" in result.output
    assert "fewer than --tokens=65,536: scoring all of them" in result.output
    assert f"{held} windows of 16)" in result.output  # the manifest's seq_len still applies
    # Hugging Face weights record no windows: the model's max_seq_len, said.
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export-hf", "--checkpoint", str(trained), "--out",
                               str(hf)]).exit_code == 0
    result = runner.invoke(app, ["eval", "--checkpoint", str(hf), "--data", tiny_data,
                                 "--tokens", "256"])
    assert result.exit_code == 0, result.output
    assert f"note: windows of the model's max_seq_len=64: {hf} records no training" in (
        result.output)
    assert f"(256 tokens of {tiny_data}, 4 windows of 64)" in result.output
    # The recorded data set gone: --data names it.
    gone = tmp_path / "gone"
    shutil.copytree(step_dir(trained / "checkpoints", 6), gone)
    meta["validation"] = {"data": str(tmp_path / "moved"), "tokens": 256, "batch_size": 32}
    (gone / "meta.json").write_text(json.dumps(meta))
    assert cli_error(["eval", "--checkpoint", str(gone)]) == (
        f"error: --data=None: required: the data set {gone} trained on, {tmp_path / 'moved'}, "
        "is not there")


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
    for flag in ("--tokens", "--seq-len", "--batch-size"):
        assert cli_error(["eval", "--checkpoint", str(trained), flag, "0"]) == (
            f"error: {flag}=0: must be >= 1")


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


def test_eval_and_generate_compiled(trained, tiny_data, monkeypatch):
    """--compile: the model's blocks and final norm compiled for inference (with the aot_eager
    backend, as tests/test_compile.py's layouts: dynamo's graphs without code generation).
    eval's loss is the eager one's up to the order of its sums (each token's log-sum-exp over
    V = 256 logits, the mean over 256 targets: the summation bound over 256 terms); greedy
    generation (20 contexts of growing length: one recompile, then dynamic shapes) writes the
    same text."""
    import torch._dynamo

    import tessera.parallel.compile as compile_module
    from tessera.weights_cli import load_checkpoint_model

    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    eager, _ = load_checkpoint_model(str(trained), "cpu")
    compiled, _ = load_checkpoint_model(str(trained), "cpu", compile=True)
    assert sum(getattr(m, "compiled", False) for m in compiled.modules()) == 3
    data = TokenDataset(tiny_data)
    want, got = evaluate(eager, data, 16, 256, 32), evaluate(compiled, data, 16, 256, 32)
    assert_close_summed(got.loss, want.loss, terms=256, msg="compiled eval loss")
    args = ["generate", "--checkpoint", str(trained), "--prompt", "def ", "--tokens", "20",
            "--temperature", "0"]
    plain, fast = runner.invoke(app, args), runner.invoke(app, args + ["--compile"])
    assert fast.exit_code == 0, fast.output
    assert fast.output == plain.output
    result = runner.invoke(app, ["eval", "--checkpoint", str(trained), "--compile"])
    assert result.exit_code == 0 and f"loss {want.loss:.4f}" in result.output, result.output
