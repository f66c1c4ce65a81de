"""`tessera schedule`, `tessera train --pp`, and bad pipeline input (one line, exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.cli import app
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.testing import run_ranks
from tessera.trainer import train

runner = CliRunner()


def test_schedule_command_prints_grid_bubble_inflight_and_writes_pictures(tmp_path):
    result = runner.invoke(app, ["schedule", "--schedule", "1f1b", "--pp", "4",
                                 "--microbatches", "8", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "rank 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1" in out
    assert "bubble fraction: 0.3750 simulated" in out and "closed form 0.3750" in out
    assert "activation sets per rank: 4 3 2 1" in out
    png = tmp_path / "1f1b_pp4_v1_m8.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "1f1b_pp4_v1_m8.trace.json").read_text())
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == 2 * 4 * 8  # a forward and a backward per micro-batch per stage


def test_schedule_command_interleaved_closed_form():
    result = runner.invoke(app, ["schedule", "--schedule", "interleaved", "--pp", "2",
                                 "--microbatches", "4", "--virtual", "2"])
    assert result.exit_code == 0, result.output
    assert "bubble fraction: 0.1250 simulated" in result.output
    assert "closed form 0.1250" in result.output


def test_schedule_command_bad_input():
    assert "microbatches=3: interleaved 1F1B needs micro-batches a multiple of pp=2" in cli_error(
        ["schedule", "--schedule", "interleaved", "--pp", "2", "--microbatches", "3",
         "--virtual", "2"])
    assert "schedule='zb'" in cli_error(["schedule", "--schedule", "zb"])
    assert "virtual=2" in cli_error(["schedule", "--schedule", "gpipe", "--virtual", "2"])


def test_custom_schedule_file(tmp_path):
    good = tmp_path / "mine.txt"
    good.write_text("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n")
    result = runner.invoke(app, ["schedule", "--file", str(good)])
    assert result.exit_code == 0, result.output
    assert "schedule mine: pp=2" in result.output
    bad = tmp_path / "bad.txt"
    bad.write_text("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1F0 1B0 1B1\n")
    assert "deadlocks" in cli_error(["schedule", "--file", str(bad)])
    # Rank 0 takes the gradients in the other order than rank 1 sends them: the lowering
    # receives micro-batch 0's first (FIFO, as NCCL matches), so the schedule runs.
    swapped = tmp_path / "swapped.txt"
    swapped.write_text("rank 0: 0F0 0F1 0B1 0B0\nrank 1: 1F0 1B0 1F1 1B1\n")
    result = runner.invoke(app, ["schedule", "--file", str(swapped)])
    assert result.exit_code == 0, result.output
    # Written out by hand in the wrong order, the sends and receives are refused.
    bad.write_text("rank 0: 0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1\n"
                   "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1\n")
    assert "must come in the same order" in cli_error(["schedule", "--file", str(bad)])
    bad.write_text("rank 0: 0F0 0X1\n")
    assert "action '0X1'" in cli_error(["schedule", "--file", str(bad)])


def test_train_refuses_bad_pipeline_input_before_launch(tiny_data):
    base = ["train", "--preset", "tiny", "--data", tiny_data]
    line = cli_error(base + ["--pp", "4", "--set", "model.n_layers=2"])
    assert "parallel.pp=4: pp*virtual_stages=4 stages exceed model.n_layers=2" in line
    line = cli_error(base + ["--pp", "2", "--schedule", "interleaved", "--microbatches", "3",
                         "--virtual", "2", "--set", "model.n_layers=4"])
    assert "train.grad_accum=3" in line and "multiple of parallel.pp=2" in line
    line = cli_error(base + ["--pp", "2", "--cp", "3"])
    assert line == ("error: data.seq_len=32: must split into 2*parallel.cp zig-zag chunks "
                    "(parallel.cp=3: a multiple of 6)")
    line = cli_error(base + ["--cp", "4", "--cp-method", "ulysses", "--tp", "2"])
    assert line == ("error: parallel.cp=4: ulysses: query heads per tp rank (model.n_heads/tp=2) "
                    "must be divisible by the Ulysses degree 4")
    line = cli_error(base + ["--cp", "2", "--cp-method", "tree"])
    assert line == "error: parallel.cp_method='tree': must be one of ring, allgather, ulysses, " \
                   "hybrid"
    line = cli_error(base + ["--pp", "2", "--schedule", "1f1b", "--virtual", "2"])
    assert "parallel.virtual_stages=2" in line


def test_check_layout_names_the_config_field():
    cfg = make_config("tiny", model=dict(n_layers=4),
                      parallel=dict(pp=2, schedule="interleaved", virtual_stages=2),
                      train=dict(grad_accum=2))
    validate(cfg)
    cfg.train.grad_accum = 3
    with pytest.raises(ConfigError, match=r"train.grad_accum=3: interleaved needs"):
        validate(cfg)


def _train_pp2_dp2(data: str, out: str):
    cfg = make_config("tiny", model=dict(n_layers=4, tie_embeddings=True),
                      parallel=dict(pp=2, dp=2, schedule="interleaved", virtual_stages=2),
                      train=dict(steps=4, grad_accum=2, micro_batch_size=2, out_dir=out,
                                 sample_tokens=8, log_interval=2),
                      data=dict(path=data, seq_len=16, val_tokens=1024))
    result = train(cfg, progress=False)
    return result.final_loss, result.val_losses


@pytest.mark.multiprocess
@pytest.mark.slow
def test_trainer_runs_pipeline_with_data_parallel(tiny_data, tmp_path):
    results = run_ranks(_train_pp2_dp2, 4, args=(tiny_data, str(tmp_path)))
    losses = {r[0] for r in results}
    assert len(losses) == 1  # the engine returns the same mean loss on every rank
    (loss,) = losses
    assert 0 < loss < 6
    assert all(r[1] == results[0][1] and r[1][-1][0] == 4 for r in results)  # eval at the end
    summary = json.loads((tmp_path / "pipeline.json").read_text())
    assert summary["schedule"] == "interleaved" and summary["measured_bubble"] >= 0
    assert (tmp_path / "pipeline_timeline.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((tmp_path / "pipeline_trace.json").read_text())
    computes = [e for e in trace["traceEvents"] if e.get("cat") in ("F", "B")]
    assert len(computes) == 2 * 4 * 2  # F and B of 2 micro-batches on 4 chunks


def test_timeline_legend_names_what_hatching_means():
    # Before: hatching marked the second chunk but the legend did not say so (and the README
    # said it marked backward).
    from tessera.pipeline.timeline import legend_handles

    labels = [h.get_label() for h in legend_handles({"F", "B"}, 2)]
    assert labels == ["forward (light)", "backward (dark)", "chunk 0", "chunk 1 (')",
                      "blank = bubble"]
    assert "chunk 0" not in [h.get_label() for h in legend_handles({"F", "B"}, 1)]
