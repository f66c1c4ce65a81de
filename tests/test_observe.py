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
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.metrics import read_log, read_metrics, tensorboard_missing
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
    rows = read_metrics(out / "metrics.jsonl")
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


def _write_jsonl(path, records: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_read_metrics_keeps_each_steps_record_written_after_the_newest_restart(tmp_path):
    """Killed at step 6 with a checkpoint at 4, restarted from 4, killed again at 5 and
    restarted from 4 once more, which ran to step 5 and was cut off mid-line: each step's
    record is the last attempt's, and step 6 of the first attempt is gone (the last restart
    went on from step 4; nothing after it wrote step 6)."""
    first = [{"step": s, "loss": 10.0 - s} for s in range(7)]
    second = [{"step": 5, "loss": 1.5}]
    third = [{"step": 5, "loss": 1.25}]
    marker = {"event": "restart", "from_step": 4, "restart": 1}
    path = tmp_path / "metrics.jsonl"
    _write_jsonl(path, [*first, marker, *second, {**marker, "restart": 2}, *third],
                 tail='{"step": 6, "lo')
    got, events = read_log(path)
    assert got == [*first[:5], *third]
    assert events == [marker, {**marker, "restart": 2}]
    assert read_metrics(path) == got
    # A restart from an earlier step than the newest record drops all records after it.
    _write_jsonl(path, [*first, {"event": "restart", "from_step": 2, "restart": 0},
                        {"step": 3, "loss": 0.5}])
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(0, 10.0), (1, 9.0),
                                                                    (2, 8.0), (3, 0.5)]


@pytest.mark.slow
def test_a_resumed_run_marks_the_restart_and_each_step_is_read_once(tiny_data, tmp_path):
    """A run to step 4 (checkpoints at 2 and 4), then resumed from step 2 into the same
    directory: metrics.jsonl holds the marker, then steps 3 and 4 again; read_metrics and
    TensorBoard (purge_step) give each step once, with the resumed run's values."""
    out = tmp_path / "run"
    tensorboard = tensorboard_missing() is None
    common = [*TINY, "--data", tiny_data, "--steps", "4", "--checkpoint-interval", "2",
              "--out", str(out), *(["--tensorboard"] if tensorboard else [])]
    assert CliRunner().invoke(app, ["train", *common]).exit_code == 0
    resume = out / "checkpoints" / "step-0000002"
    result = CliRunner().invoke(app, ["train", *common, "--resume", str(resume)])
    assert result.exit_code == 0, result.output

    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    at = next(i for i, r in enumerate(lines) if "event" in r)
    assert {k: v for k, v in lines[at].items() if k != "time"} == {
        "event": "restart", "from_step": 2, "restart": 0, "checkpoint": str(resume)}
    assert [r["step"] for r in lines[:at]] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in lines[at + 1:]] == [3, 4]
    rows = read_metrics(out / "metrics.jsonl")
    assert rows == [*lines[:3], *lines[at + 1:]]  # the resumed run's records of steps 3, 4
    assert read_log(out / "metrics.jsonl")[1] == [lines[at]]

    if not tensorboard:
        pytest.skip("the TensorBoard half needs the tensorboard package (the dev extras)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for tag in ("loss", "step_s", "val_loss"):
        want = [(r["step"], float(np.float32(r[tag]))) for r in rows if tag in r]
        assert [(e.step, e.value) for e in events.Scalars(tag)] == want, tag
