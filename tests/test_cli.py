"""The command line: bad input gives one clear line and exit code 2, before anything runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.cli import app

runner = CliRunner()


def test_layout_not_matching_world(tiny_data):
    line = cli_error(["train", "--preset", "tiny", "--data", tiny_data, "--nproc", "4",
                      "--dp", "3"])
    assert "dp*tp*pp*cp=3 must equal the world size 4" in line


def test_heads_not_divisible(tiny_data):
    line = cli_error(["train", "--preset", "tiny", "--data", tiny_data, "--tp", "3"])
    assert "parallel.tp=3: must divide model.n_heads=4" in line


def test_missing_data_path(tmp_path):
    line = cli_error(["train", "--preset", "tiny", "--data", str(tmp_path / "nothing")])
    assert f"{tmp_path / 'nothing'}: data directory not found" in line


def test_unknown_preset(tiny_data):
    line = cli_error(["train", "--preset", "huge", "--data", tiny_data])
    assert "preset='huge': unknown; known: tiny, demo, gpt2-124m, llama-1b" in line


def test_bad_override(tiny_data):
    assert "train.lr=-1.0: must be > 0" in cli_error(["train", "--data", tiny_data, "--set",
                                                  "train.lr=-1"])


def test_config_prints_resolved_yaml():
    result = runner.invoke(app, ["config", "--preset", "tiny", "--set", "model.n_layers=3"])
    assert result.exit_code == 0 and "n_layers: 3" in result.output


def test_data_prepare_from_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"m{i}.py").write_text("print('hello')\n" * 30)
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "prepare", "--source", str(src), "--out", str(out),
                                 "--val-percent", "30"])
    assert result.exit_code == 0, result.output
    assert "train and" in result.output and (out / "manifest.json").is_file()
    again = runner.invoke(app, ["data", "prepare", "--source", str(src), "--out", str(out),
                                "--if-missing"])
    assert "already prepared" in again.output


@pytest.mark.slow
def test_real_process_bad_layout_exit_code(tiny_data):
    # The installed entry point, in a real process: one line on stderr, exit 2, no traceback.
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--preset", "tiny",
                           "--data", tiny_data, "--nproc", "2", "--tp", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: parallel.tp=3: must divide model.n_heads=4"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_launched_training_run(tiny_data, tmp_path):
    # `tessera train --nproc 2` goes through torch's elastic launcher and trains on two ranks.
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--preset", "tiny",
                           "--data", tiny_data, "--nproc", "2", "--steps", "4",
                           "--out", str(tmp_path), "--no-progress", "--set", "data.seq_len=16",
                           "--set", "data.val_tokens=256"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world=2" in proc.stdout and "dp=2" in proc.stdout
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 5  # step 0 + 4
