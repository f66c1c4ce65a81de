"""Observing a run: TensorBoard scalars (`--tensorboard`) and, on CUDA, an allocator memory
snapshot (`--memory-snapshot`; on a CPU a one-line refusal that says it needs CUDA)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.cli import app
from tessera.config import ConfigError, make_config
from tessera.preflight import check_options

TINY = ["--preset", "tiny", "--no-progress", "--set", "data.seq_len=16",
        "--set", "data.val_tokens=64", "--set", "train.sample_tokens=0"]


@pytest.mark.slow
def test_tensorboard_event_file_holds_the_loss_scalars(tiny_data, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *TINY, "--data", tiny_data, "--steps", "3",
                                      "--out", str(out), "--tensorboard"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    # TensorBoard stores scalars as float32: each equals the logged value rounded once.
    for tag in ("loss", "val_loss", "lr", "grad_norm"):
        want = [(r["step"], float(np.float32(r[tag]))) for r in rows if tag in r]
        assert [(e.step, e.value) for e in events.Scalars(tag)] == want, tag
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


def test_tensorboard_missing_is_refused_at_start_up(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails
    cfg = make_config("tiny", overrides=["train.tensorboard=true"])
    with pytest.raises(ConfigError, match=r"train.tensorboard=True: needs the tensorboard "
                                          r"package \(pip install"):
        check_options(cfg, "cpu")


def test_memory_snapshot_on_cpu_says_it_needs_cuda(tiny_data):
    line = cli_error(["train", *TINY, "--data", tiny_data, "--memory-snapshot"])
    assert line == ("error: train.memory_snapshot=True: needs CUDA (torch.cuda.memory records "
                    "the GPU caching allocator's history); this run's device is cpu")
    check_options(make_config("tiny", overrides=["train.memory_snapshot=true"]), "cuda")
