"""The command line: bad input gives one clear line and exit code 2, before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.cli import app
from tessera.metrics import read_metrics

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


def test_relaunch_keeps_arguments_equal_to_train(tiny_data, monkeypatch):
    # Before: every argument equal to "train" was dropped, so `--out train --no-progress`
    # wrote the run to ./--no-progress.
    import tessera.launch

    seen = []
    monkeypatch.setattr(tessera.launch, "launch",
                        lambda n, argv, restarts=0: seen.append((n, argv)) or 0)
    args = ["train", "--preset", "tiny", "--data", tiny_data, "--nproc", "2", "--out", "train",
            "--no-progress"]
    monkeypatch.setattr(sys, "argv", ["tessera", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == [(2, ["--preset", "tiny", "--data", tiny_data, "--out", "train",
                         "--no-progress"])]


def test_preset_flag_beats_config_file_and_file_beats_default(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\n')
    shown = runner.invoke(app, ["config", "--config", str(toml)]).output
    assert "d_model: 64" in shown  # the file's preset over the default (demo, 192)
    toml.write_text('preset = "demo"\n')
    shown = runner.invoke(app, ["config", "--config", str(toml), "--preset", "tiny"]).output
    assert "d_model: 64" in shown  # --preset over the file's
    assert "d_model: 192" in runner.invoke(app, ["config"]).output


def test_pipeline_with_one_microbatch_warns_once(tiny_data, monkeypatch):
    import tessera.launch

    monkeypatch.setattr(tessera.launch, "launch", lambda n, argv, restarts=0: 0)
    monkeypatch.delenv("TESSERA_RELAUNCHED", raising=False)
    args = ["train", "--preset", "tiny", "--data", tiny_data, "--nproc", "2", "--pp", "2",
            "--steps", "2"]
    monkeypatch.setattr(sys, "argv", ["tessera", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "warning: train.grad_accum=1 micro-batches with parallel.pp=2: pipeline ranks idle about "
        "50% of each step; use --microbatches 8 (4*pp) or more",
        "warning: train.warmup_steps=3 > train.steps=2: the learning rate never reaches "
        "train.lr=0.003"]


def test_interleaved_needs_two_chunks(tiny_data):
    line = cli_error(["train", "--preset", "tiny", "--data", tiny_data, "--pp", "2",
                      "--schedule", "interleaved", "--microbatches", "2"])
    assert "parallel.virtual_stages=1: interleaved needs virtual_stages >= 2" in line
    line = cli_error(["schedule", "--schedule", "interleaved", "--pp", "2"])
    assert "--virtual=1: interleaved needs --virtual >= 2" in line
    line = cli_error(["schedule", "--schedule", "interleaved-lean", "--pp", "2"])
    assert "--virtual=1: interleaved-lean needs --virtual >= 2" in line


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


@pytest.mark.parametrize("val_percent", ["2", "50"])
def test_data_prepare_one_file(tmp_path, val_percent):
    # Before: one file gave `split 'val' would be empty` (and at 50%, 'train').
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("It was the best of times, it was the worst of times.\n" * 100)
    result = runner.invoke(app, ["data", "prepare", "--source", str(corpus), "--out",
                                 str(tmp_path / "out"), "--val-percent", val_percent])
    assert result.exit_code == 0, result.output
    assert "train and" in result.output


def test_data_prepare_jsonl_directory_with_text_field(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("\n".join(f'{{"content": "record {i}"}}' for i in range(99)))
    result = runner.invoke(app, ["data", "prepare", "--source", str(src), "--out",
                                 str(tmp_path / "out"), "--text-field", "content"])
    assert result.exit_code == 0, result.output
    line = cli_error(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "o2")])
    assert "a.jsonl:1: no string field 'text' (choose it with --text-field)" in line


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
    # `--out train` (a value equal to the command word) survives the relaunch.
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--preset", "tiny",
                           "--data", tiny_data, "--nproc", "2", "--steps", "4",
                           "--set", "data.seq_len=16", "--set", "data.val_tokens=256",
                           "--out", "train", "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world=2" in proc.stdout and "dp=2" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "train" / "metrics.jsonl")] == [
        0, 1, 2, 3, 4]
    assert not (tmp_path / "--no-progress").exists()


def _bpe_data(tmp_path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("def add(a, b):\n    return a + b\n" * 400)
    out = tmp_path / "data"
    result = runner.invoke(app, ["data", "prepare", "--source", str(tmp_path / "corpus.txt"),
                                 "--tokenizer", str(tmp_path / "tokenizer.json"),
                                 "--out", str(out), "--val-percent", "10"])
    assert result.exit_code == 0, result.output
    return str(out)


def test_vocab_size_comes_from_the_datas_tokenizer(tmp_path):
    # Before: `model.vocab_size=256: must be >= the data's vocabulary 26x` unless set by hand.
    data = _bpe_data(tmp_path)
    vocab = json.loads((Path(data) / "manifest.json").read_text())["vocab_size"]
    assert vocab > 256
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--preset", "tiny", "--data", data, "--steps", "1",
                                 "--out", str(out), "--no-progress", "--set",
                                 "data.val_tokens=64", "--set", "data.seq_len=16"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["model"]["vocab_size"] == vocab
    # A vocabulary named by hand is kept, and must fit the data.
    line = cli_error(["train", "--preset", "tiny", "--data", data, "--set",
                      "model.vocab_size=256"])
    assert f"model.vocab_size=256: must be >= the data's vocabulary {vocab}" in line


def test_profile_steps_write_a_trace(tiny_data, tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--preset", "tiny", "--data", tiny_data, "--steps",
                                 "3", "--profile-steps", "2:3", "--out", str(out),
                                 "--no-progress", "--set", "data.seq_len=16", "--set",
                                 "data.val_tokens=64", "--set", "train.sample_tokens=0"])
    assert result.exit_code == 0, result.output
    trace = json.loads((out / "profile" / "rank-00000.trace.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r.get("profiled", False) for r in rows if r["step"] > 0] == [False, True, True]
    assert "train.profile_steps='2:9': needs 1 <= A <= B <= train.steps=3" in cli_error(
        ["train", "--preset", "tiny", "--data", tiny_data, "--steps", "3", "--profile-steps",
         "2:9"])
    assert "must look like A:B" in cli_error(["train", "--preset", "tiny", "--data", tiny_data,
                                              "--profile-steps", "5"])


def test_small_val_split_refused_at_start(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abcdefgh" * 500)  # 4,002 tokens, 2% (80) held out
    data = tmp_path / "data"
    assert runner.invoke(app, ["data", "prepare", "--source", str(corpus), "--out",
                               str(data)]).exit_code == 0
    line = cli_error(["train", "--preset", "tiny", "--data", str(data)])
    assert f"data.val_tokens=4096: the val split of {data} holds 80 tokens" in line


@pytest.mark.slow
def test_launched_run_warns_once(tiny_data, tmp_path):
    # The parent warns before the relaunch; the ranks it starts do not warn again.
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--preset", "tiny",
                           "--data", tiny_data, "--nproc", "2", "--pp", "2", "--steps", "2",
                           "--out", str(tmp_path), "--no-progress", "--set", "data.seq_len=16",
                           "--set", "data.val_tokens=256", "--set", "train.sample_tokens=0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == 2 and "pipeline ranks idle" in warnings[0]


@pytest.mark.parametrize("command", ["train", "schedule"])
def test_schedule_help_names_every_registered_schedule(command):
    # Before: the help listed five names by hand and left interleaved-lean out.
    import re

    from tessera.pipeline.schedules import SCHEDULES

    r = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    # train's help gives the field's docstring, then the registry's names after "Choices:".
    listed = re.search(r"--schedule <str> .*?(?:Pipeline schedule|Choices): ([^.]*)\.",
                       " ".join(r.output.split()))
    assert listed is not None, r.output
    assert set(listed[1].split(", ")) == set(SCHEDULES)


@pytest.mark.parametrize("command", ["train", "config"])
def test_preset_help_names_every_preset(command):
    # Before: the help listed tiny, demo, gpt2-124m and llama-1b, four of the seven.
    import re

    from tessera.presets import PRESETS

    r = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    listed = re.search(r"Named preset: ([^.]*)\. Default", " ".join(r.output.split()))
    assert listed is not None, r.output
    assert listed[1].split(", ") == list(PRESETS)


def test_each_config_flag_sets_its_field_and_an_absent_flag_sets_nothing(monkeypatch):
    # The flags come from tessera.cli.TRAIN_FLAGS: each value reaches the field the table names,
    # typed as the field is; a flag not given is None, so a config file's value stands.
    import dataclasses
    import typing

    import tessera.cli as cli
    from tessera.config import Config
    from tessera.errors import ConfigError

    seen = {}

    def capture(preset, config_file, sets, flags, nproc=None):
        seen.update(flags)
        raise ConfigError("stop", 0, "captured")

    monkeypatch.setattr(cli, "resolve_config", capture)
    assert runner.invoke(app, ["train"]).exit_code == 2
    assert seen and all(v is None for section in seen.values() for v in section.values())
    argv, expected = ["train"], {}
    for i, (flag, dotted) in enumerate(cli.TRAIN_FLAGS.items()):
        section, name = dotted.split(".")
        fields = dataclasses.fields(typing.get_type_hints(Config)[section])
        kind = next(f.type for f in fields if f.name == name)
        value = {"bool": True, "int": i + 2, "float": i + 0.5, "str": f"v{i}"}[
            next(k for k in ("bool", "int", "float", "str") if k in kind)]
        argv += [f"--{flag}"] if value is True else [f"--{flag}", str(value)]
        expected.setdefault(section, {})[name] = value
    seen.clear()
    r = runner.invoke(app, argv)
    assert r.exit_code == 2 and r.output.strip() == "error: stop=0: captured", r.output
    assert seen == expected


def test_config_flag_help_is_the_fields_docstring():
    r = runner.invoke(app, ["train", "--help"], terminal_width=1000)
    text = " ".join(r.output.split())
    assert ("--microbatches <int> Micro-batches per optimizer step on each data-parallel rank "
            "(the pipeline's m under PP). (train.grad_accum)") in text
    # The first sentence only; a bool field's flag has its --no- form, --overwrite has none.
    assert "--collective-timeout <float> Seconds a collective may wait" in text
    assert "Not torch's 30-minute default" not in text
    assert "--tensorboard / --no-tensorboard Also write" in text
    assert "--overwrite Let a run start" in text and "--no-overwrite" not in text
    assert "Choices: allreduce, ps, ps-async. (parallel.dp_mode)" in text


def test_every_error_for_the_user_is_a_user_error_the_cli_prints_in_one_line(tmp_path):
    from tessera.checkpoint import CheckpointError
    from tessera.data.loader import DataError
    from tessera.errors import ConfigError, UserError
    from tessera.hf import HFError
    from tessera.pipeline.schedule import ScheduleError
    from tessera.planner.estimate import PlanError

    for cls in (ConfigError, CheckpointError, DataError, HFError, ScheduleError, PlanError):
        assert issubclass(cls, UserError), cls
    # A CheckpointError raised inside a command (no try of its own): one line, exit 2.
    r = CliRunner().invoke(app, ["checkpoint", "inspect", str(tmp_path / "none")])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert r.output.startswith("error: ") and "none" in r.output
