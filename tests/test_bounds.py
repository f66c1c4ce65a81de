"""Sizes refused before launch, `train --dry-run`, `config --check`, and the warnings for
options that do nothing in the chosen layout.

Each refusal is one line and exit 2 (``cli_errors.cli_error``), in this process: nothing here
starts a rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from typer.testing import CliRunner

import tessera.launch
import tessera.preflight
import tessera.trainer
from cli_errors import cli_error
from tessera.cli import app, resolve_config
from tessera.config import INT64_MAX, LIMITS
from tessera.config_io import make_config
from tessera.config_warnings import config_warnings, ignored_options
from tessera.errors import ConfigError
from tessera.layout import MAX_PIPELINE_PAIRS, validate
from tessera.presets import PRESETS

runner = CliRunner()


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything would start ranks or train."""

    def boom(*args, **kwargs):
        raise AssertionError("a process or a run was started")

    monkeypatch.setattr(tessera.launch, "launch", boom)
    monkeypatch.setattr(tessera.trainer, "run", boom)
    monkeypatch.delenv("TESSERA_RELAUNCHED", raising=False)


def _train(data: str, tmp_path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--data", data, "--out", str(tmp_path / "out"),
            *extra]


# ---------------------------------------------------------------------------------------------
# The tester's findings, each one line and exit 2


def test_ten_million_microbatches_refused_without_building_a_schedule(tiny_data, tmp_path,
                                                                       no_launch, monkeypatch):
    import tessera.pipeline.schedules as schedules
    import tessera.planner.pipeline as planner_pipeline

    def boom(*args, **kwargs):
        raise AssertionError("a schedule was generated")

    for name, spec in list(schedules.SCHEDULES.items()):  # every generator, however reached
        monkeypatch.setitem(schedules.SCHEDULES, name, dataclasses.replace(spec, generate=boom))
    monkeypatch.setattr(planner_pipeline, "build", boom)
    line = cli_error(_train(tiny_data, tmp_path, "--nproc", "2", "--pp", "2",
                            "--microbatches", "10000000"))
    assert line.startswith("error: train.grad_accum=10000000: grad_accum*pp*virtual_stages="
                           "20,000,000 (micro-batch, chunk) pairs exceed 65,536")
    assert not (tmp_path / "out").exists()


def test_pipeline_pairs_bound_is_the_product_of_microbatches_stages_and_chunks():
    at_bound = make_config("tiny", overrides=[
        "parallel.pp=2", f"train.grad_accum={MAX_PIPELINE_PAIRS // 2}"])
    validate(at_bound)  # exactly the bound: allowed (checked without generating it)
    over = make_config("tiny", overrides=["parallel.pp=2", "parallel.virtual_stages=1",
                                          f"train.grad_accum={MAX_PIPELINE_PAIRS // 2 + 1}"])
    with pytest.raises(ConfigError, match="train.grad_accum"):
        validate(over)
    one_rank = make_config("tiny", overrides=[f"train.grad_accum={MAX_PIPELINE_PAIRS + 1}"])
    with pytest.raises(ConfigError, match="pairs exceed"):  # pp 1 runs them all too
        validate(one_rank)


def test_global_batch_larger_than_the_train_split_is_refused(tiny_data, tmp_path, no_launch):
    line = cli_error(_train(tiny_data, tmp_path, "--micro-batch-size", "1000000"))
    assert line.startswith("error: train.micro_batch_size=1000000: a step's global batch, "
                           "dp*grad_accum*micro_batch_size*seq_len = 32,000,000 tokens, "
                           f"exceeds the train split of {tiny_data}")
    # The largest factor is named: here the data-parallel degree --nproc fills.
    line = cli_error(_train(tiny_data, tmp_path, "--nproc", "100000"))
    assert line.startswith("error: parallel.dp=100000: a step's global batch")


def test_global_batch_equal_to_the_train_split_passes(tiny_data):
    from tessera.data.loader import TokenDataset

    train_tokens = len(TokenDataset(tiny_data, verify=False).train)
    seq = 32
    fits = make_config("tiny", overrides=[f"data.path={tiny_data}", f"data.seq_len={seq}",
                                          f"train.micro_batch_size={train_tokens // seq}"])
    tessera.preflight.check_data(fits)
    over = make_config("tiny", overrides=[f"data.path={tiny_data}", f"data.seq_len={seq}",
                                          f"train.micro_batch_size={train_tokens // seq + 1}"])
    with pytest.raises(ConfigError, match="exceeds the train split"):
        tessera.preflight.check_data(over)


def test_train_split_shorter_than_a_window_is_refused(tmp_path):
    from tessera.data.prepare import prepare
    from tessera.data.tokenizer import ByteTokenizer

    (tmp_path / "a.txt").write_text("x" * 60)
    prepare([str(tmp_path / "a.txt")], tmp_path / "d", ByteTokenizer(), val_percent=50)
    cfg = make_config("tiny", overrides=[f"data.path={tmp_path / 'd'}", "data.val_tokens=1"])
    with pytest.raises(ConfigError, match=r"data.seq_len=32: the train split .* holds \d+ "
                                          r"tokens, fewer than one training window needs"):
        tessera.preflight.check_data(cfg)


def test_micro_batch_size_beyond_int64_is_refused(tiny_data, tmp_path, no_launch):
    line = cli_error(_train(tiny_data, tmp_path, "--micro-batch-size", "99999999999999999999"))
    assert line == ("error: train.micro_batch_size=99999999999999999999: must fit in a 64-bit "
                    f"integer (|value| <= {INT64_MAX})")


def test_validation_batches_take_any_batch_size(tiny_data):
    # The trainer asks for micro_batch_size*4 windows a batch: one batch of all, never a split
    # size torch cannot hold.
    from tessera.data.loader import TokenDataset, val_windows

    split = TokenDataset(tiny_data).val
    batches = val_windows(split, 32, 320, 4 * INT64_MAX)
    assert len(batches) == 1 and tuple(batches[0][0].shape) == (10, 32)


@pytest.mark.parametrize("how", ["--set", "--steps"])
def test_steps_of_76_digits_is_refused(tiny_data, tmp_path, no_launch, how):
    digits = "1" * 76
    extra = ["--set", f"train.steps={digits}"] if how == "--set" else ["--steps", digits]
    line = cli_error(_train(tiny_data, tmp_path, *extra))
    assert line.startswith("error: train.steps=<integer of 76 digits>: must fit in a 64-bit")


def test_fields_above_their_maximum_are_refused():
    for name, (limit, _) in LIMITS.items():
        with pytest.raises(ConfigError, match=f"must be at most {limit:,}"):
            make_config("tiny", overrides=[f"{name}={limit + 1}"])
    ok = make_config("tiny", overrides=[f"train.steps={LIMITS['train.steps'][0]}"])
    assert ok.train.steps == 10**9


@pytest.mark.parametrize("channel", ["yaml", "toml", "set"])
def test_5000_digit_integer_is_one_line(tmp_path, channel):
    digits = "7" * 5000
    if channel == "set":
        line = cli_error(["config", "--preset", "tiny", "--set", f"train.steps={digits}"])
        assert line.startswith("error: train.steps=<integer of 5000 digits>: must fit in a "
                               "64-bit integer")
        return
    path = tmp_path / f"run.{channel}"
    path.write_text(f"[train]\nsteps = {digits}\n" if channel == "toml"
                    else f"train:\n  steps: {digits}\n")
    line = cli_error(["config", "--preset", "tiny", "--config", str(path)])
    assert line == (f"error: --config='{path}': holds an integer of more than 4300 digits; "
                    f"every field must fit in a 64-bit integer (|value| <= {INT64_MAX})")
    assert len(line) < 300


def test_an_error_shows_a_huge_value_by_its_digit_count():
    assert str(ConfigError("x", 10**5000, "r")) == "x=<integer of more than 4300 digits>: r"
    assert str(ConfigError("x", 10**75, "r")) == "x=<integer of 76 digits>: r"
    assert str(ConfigError("x", 2**63, "r")) == f"x={2**63}: r"  # short enough to show
    assert len(str(ConfigError("x", "y" * 10_000, "r"))) < 300


def test_huge_integer_in_a_float_field_is_not_finite():
    with pytest.raises(ConfigError, match=r"train.lr=<integer of 400 digits>: must be finite"):
        make_config("tiny", overrides=["train.lr=" + "9" * 400])


FORMATS = ["txt", "jsonl", "jsonl-blank-records", "parquet", "directory", "hf-dataset"]


@pytest.mark.parametrize("kind", FORMATS)
def test_empty_source_is_refused_and_nothing_written(tmp_path, kind):
    source = tmp_path / "src"
    if kind == "txt":
        source = tmp_path / "empty.txt"
        source.write_text("")
    elif kind == "jsonl":
        source = tmp_path / "empty.jsonl"
        source.write_text("")
    elif kind == "jsonl-blank-records":
        source = tmp_path / "blank.jsonl"
        source.write_text('{"text": ""}\n\n{"text": ""}\n')
    elif kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        source = tmp_path / "empty.parquet"
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), source)
    elif kind == "directory":
        source.mkdir()
        (source / "a.txt").write_text("")
        (source / "b.jsonl").write_text("")
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({"text": [""]}).save_to_disk(str(source))
    out = tmp_path / "out"
    line = cli_error(["data", "prepare", "--source", str(source), "--out", str(out)])
    assert line.startswith(f"error: {source}: empty source (")
    assert not out.exists()


def test_a_source_with_text_beside_an_empty_one_is_still_refused(tmp_path):
    (tmp_path / "full.txt").write_text("hello\n")
    (tmp_path / "empty.txt").write_text("")
    line = cli_error(["data", "prepare", "--source", str(tmp_path / "full.txt"), "--source",
                      str(tmp_path / "empty.txt"), "--out", str(tmp_path / "out")])
    assert f"{tmp_path / 'empty.txt'}: empty source" in line


# ---------------------------------------------------------------------------------------------
# --dry-run and config --check


def test_dry_run_prints_config_memory_and_warnings_and_starts_nothing(tiny_data, tmp_path,
                                                                      no_launch):
    args = _train(tiny_data, tmp_path, "--nproc", "4", "--pp", "2", "--microbatches", "8",
                  "--max-staleness", "5", "--dry-run")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("# tessera train --dry-run: valid for 4 ranks (dp=2 tp=1 pp=2 cp=1)")
    resolved = yaml.safe_load(out)  # comment lines aside, the output is the resolved config
    assert resolved["parallel"]["dp"] == 2 and resolved["train"]["grad_accum"] == 8
    assert resolved["data"]["path"] == tiny_data
    assert f"# data: checked {tiny_data}" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("#   ") and
            ln.split()[1].isdigit()]
    assert [r[1] for r in rows] == ["0", "1"]  # one row per pipeline rank
    # The rows are the planner's bytes (MiB) for this layout.
    cfg = resolve_config("tiny", None, None, {"parallel": {"pp": 2},
                                              "train": {"grad_accum": 8}}, nproc=4)
    want = tessera.preflight.memory_per_rank(cfg)
    assert [float(r[2]) for r in rows] == [round(m.params / 2**20, 2) for m in want]
    assert [float(r[5]) for r in rows] == [round(m.activations / 2**20, 2) for m in want]
    assert ("# warning: parallel.max_staleness=5: no effect, only dp_mode='ps-async' reads it"
            in out)
    assert result.stderr == ""
    assert not (tmp_path / "out").exists()


def test_dry_run_refuses_in_one_line(tiny_data, tmp_path, no_launch):
    line = cli_error(_train(tiny_data, tmp_path, "--tp", "3", "--dry-run"))
    assert line == "error: parallel.tp=3: must divide model.n_heads=4"
    line = cli_error(_train(tiny_data, tmp_path, "--resume", str(tmp_path / "none"),
                            "--dry-run"))
    assert str(tmp_path / "none") in line


def test_dry_run_refuses_what_does_not_fit_in_memory(tiny_data, tmp_path, no_launch,
                                                     monkeypatch):
    monkeypatch.setattr(tessera.preflight, "process_baseline", lambda: 0)
    monkeypatch.setattr(tessera.preflight, "machine_memory",
                        lambda device_type: (2**20, "a test's 1 MiB"))
    line = cli_error(_train(tiny_data, tmp_path, "--dry-run"))
    assert line.startswith("error: memory=5.1 MiB: the planner's estimate for the rank")
    assert "exceeds the 1.0 MiB this machine has (a test's 1 MiB)" in line
    line = cli_error(_train(tiny_data, tmp_path))  # a real launch is refused the same way
    assert line.startswith("error: memory=")


def test_cpu_ranks_share_the_machine_and_gpu_ranks_have_their_own(monkeypatch):
    rows = [tessera.preflight.RankMemory(0, 1, 1, 2, 10, 0),
            tessera.preflight.RankMemory(1, 1, 1, 2, 20, 0)]
    monkeypatch.setattr(tessera.preflight, "memory_per_rank", lambda cfg: rows)
    monkeypatch.setattr(tessera.preflight, "process_baseline", lambda: 0)
    monkeypatch.setattr(tessera.preflight, "machine_memory", lambda device: (10**6, "test"))
    cfg = make_config("tiny", overrides=["parallel.pp=2", "parallel.dp=2"])
    _, note = tessera.preflight.check_memory(cfg, 4, "cpu", 4)
    assert note.startswith("4 ranks together: 0.0 MiB")  # 2 * (14 + 24) bytes
    monkeypatch.setattr(tessera.preflight, "machine_memory", lambda device: (75, "test"))
    with pytest.raises(ConfigError, match="memory="):
        tessera.preflight.check_memory(cfg, 4, "cpu", 4)  # 76 bytes > 75
    tessera.preflight.check_memory(cfg, 4, "cpu", 2)  # half the ranks elsewhere: 38 bytes


def test_each_cpu_rank_counts_its_own_process(monkeypatch):
    # 64 ranks of a tiny model: the planner's bytes are nothing, the processes are not (each
    # holds at least what this torch-importing process holds). Found by the flag fuzz's
    # --nproc 64, which the planner's bytes alone let through on a 24 GiB machine.
    baseline = tessera.preflight.process_baseline()
    assert baseline > 50 * 2**20  # this process has imported torch
    monkeypatch.setattr(tessera.preflight, "machine_memory",
                        lambda device: (40 * baseline, "test"))
    cfg = make_config("tiny", overrides=["parallel.dp=64"])
    with pytest.raises(ConfigError, match="64 ranks together"):
        tessera.preflight.check_memory(cfg, 64, "cpu", 64)
    _, note = tessera.preflight.check_memory(cfg, 32, "cpu", 32)
    assert "a process beside the model" in note


def test_gpu_ranks_need_a_gpu_each_and_fit_the_smallest(monkeypatch):
    import torch

    rows = [tessera.preflight.RankMemory(0, 1, 1, 2, 10, 0),
            tessera.preflight.RankMemory(1, 1, 1, 2, 20, 0)]
    monkeypatch.setattr(tessera.preflight, "memory_per_rank", lambda cfg: rows)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    sizes = {0: 100, 1: 23}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("Props", (), {"total_memory": sizes[i]}))
    cfg = make_config("tiny", overrides=["parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"--nproc=3: more ranks than this machine's 2 GPUs"):
        tessera.preflight.check_memory(cfg, 3, "cuda", 3)
    with pytest.raises(ConfigError, match="memory="):  # the fullest rank, 24 B > 23 B
        tessera.preflight.check_memory(cfg, 2, "cuda", 2)
    sizes[1] = 24
    _, note = tessera.preflight.check_memory(cfg, 2, "cuda", 2)
    assert note.startswith("the fullest rank: 0.0 MiB of 0.0 MiB available (the smallest of "
                           "this machine's 2 GPUs)")


def test_launcher_numbers_beyond_int64_are_one_line(tiny_data, tmp_path, no_launch):
    line = cli_error(_train(tiny_data, tmp_path, "--nproc", "2", "--max-restarts", str(2**64)))
    assert line == f"error: --max-restarts={2**64}: must be >= 0 and <= {INT64_MAX}"
    line = cli_error(_train(tiny_data, tmp_path, "--nproc", str(10**40)))
    assert line.startswith("error: parallel.dp=<integer of 41 digits>: must fit in a 64-bit")


def test_stage_layout_expanding_past_a_million_chunks_is_one_line():
    line = cli_error(["config", "--preset", "tiny", "--check", "--set",
                      "parallel.stage_layout=1*99999999999"])
    assert line == ("error: parallel.stage_layout='1*99999999999': gives more than 1,000,000 "
                    "chunks")


def test_config_check_refuses_a_bad_layout():
    line = cli_error(["config", "--preset", "tiny", "--set", "parallel.tp=3", "--check"])
    assert line == "error: parallel.tp=3: must divide model.n_heads=4"
    # Without --check the resolved config is printed as before.
    assert runner.invoke(app, ["config", "--preset", "tiny", "--set",
                               "parallel.tp=3"]).exit_code == 0


def test_config_check_checks_the_data_only_where_it_exists(tiny_data, tmp_path):
    result = runner.invoke(app, ["config", "--preset", "tiny", "--check", "--set",
                                 f"data.path={tmp_path / 'none'}"])
    assert result.exit_code == 0, result.output
    assert f"# data: not checked: {tmp_path / 'none'} does not exist" in result.stdout
    assert "# memory per rank" in result.stdout
    result = runner.invoke(app, ["config", "--preset", "tiny", "--check", "--set",
                                 f"data.path={tiny_data}"])
    assert f"# data: checked {tiny_data}" in result.stdout
    line = cli_error(["config", "--preset", "tiny", "--check", "--set",
                      f"data.path={tiny_data}", "--set", "train.micro_batch_size=1000000"])
    assert "exceeds the train split" in line


# ---------------------------------------------------------------------------------------------
# Options without effect


NO_EFFECT = [
    (["parallel.cp_ulysses=4"], "parallel.cp_ulysses=4: no effect, no context parallelism"),
    (["parallel.cp=2", "parallel.cp_ulysses=4"],
     "parallel.cp_ulysses=4: no effect, only cp_method='hybrid' reads it, not 'ring'"),
    (["parallel.cp_method=allgather"], "parallel.cp_method='allgather': no effect, no context"),
    (["parallel.max_staleness=5"], "parallel.max_staleness=5: no effect, only dp_mode="),
    (["model.moe_top_k=1", "model.moe_capacity_factor=1.5"],
     "model.moe_top_k=1, model.moe_capacity_factor=1.5: no effect, the model is dense"),
    (["model.moe_shared_expert=true"], "model.moe_shared_expert=True: no effect, the model is "
                                       "dense"),
    (["model.moe_experts=4", "model.moe_every=3"],
     "model.moe_every=3 > model.n_layers=2: no block is a mixture of experts"),
    (["parallel.schedule=interleaved-lean"],
     "parallel.schedule='interleaved-lean': no effect, one pipeline stage"),
    (["parallel.schedule=interleaved", "parallel.microbatch_group=2"],
     "parallel.schedule='interleaved', parallel.microbatch_group=2: no effect, one pipeline "
     "stage"),
    (["parallel.virtual_stages=2", "parallel.schedule=interleaved", "train.grad_accum=2"],
     "parallel.virtual_stages=2: no effect, one pipeline rank"),
    (["parallel.bucket_mb=50"], "parallel.bucket_mb=50.0: no effect, one data-parallel rank"),
    (["parallel.allreduce_algorithm=ring", "parallel.dp=2", "parallel.zero_stage=2"],
     "parallel.allreduce_algorithm='ring': no effect, only the all-reduce data parallelism "
     "(DDP) reads it, not ZeRO"),
    (["parallel.bucket_mb=10", "parallel.dp=2", "train.precision=bf16"],
     "parallel.bucket_mb=10.0: no effect, only the all-reduce"),
    (["parallel.zero_stage=1"], "parallel.zero_stage=1: no effect, one data-parallel rank"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=True: no effect, no "
                                          "tensor parallelism"),
    (["parallel.ep_alltoall=pairwise"], "parallel.ep_alltoall='pairwise': no effect, no expert"),
    (["model.rope_low_freq_factor=2.0"], "model.rope_low_freq_factor=2.0: no effect, RoPE is "
                                         "not scaled"),
    (["train.keep_checkpoints=5", "train.async_checkpoint=true"],
     "train.keep_checkpoints=5, train.async_checkpoint=True: no effect, no checkpoints"),
    (["train.checkpoint_dir=/tmp/x"], "train.checkpoint_dir='/tmp/x': no effect, no checkpoints "
                                      "are saved or resumed"),
    (["train.sample_tokens=0", "train.sample_prompt=x"],
     "train.sample_prompt='x': no effect, no sample is generated"),
    (["parallel.stage_layout='2'"], "parallel.stage_layout='2': no effect, one pipeline "
                                    "stage"),
]


@pytest.mark.parametrize("sets,warning", NO_EFFECT, ids=[" ".join(s) for s, _ in NO_EFFECT])
def test_an_option_without_effect_warns(sets, warning):
    cfg = make_config("tiny", overrides=sets)
    validate(cfg)
    assert any(w.startswith(warning) for w in config_warnings(cfg)), config_warnings(cfg)


@pytest.mark.parametrize("sets", [
    ["parallel.cp=2", "parallel.cp_method=hybrid", "parallel.cp_ulysses=2"],
    ["parallel.dp=2", "parallel.dp_mode=ps-async", "parallel.max_staleness=5"],
    ["model.moe_experts=4", "model.moe_top_k=1"],
    ["parallel.pp=2", "parallel.schedule=gpipe", "train.grad_accum=8"],
    ["parallel.dp=2", "parallel.bucket_mb=50", "parallel.allreduce_algorithm=ring"],
    ["parallel.tp=2", "parallel.sequence_parallel=true"],
    ["parallel.dp=2", "parallel.zero_stage=1"],
    ["parallel.virtual_stages=2", "parallel.schedule=bfs", "parallel.zero_stage=3",
     "parallel.dp=2"],
    ["train.checkpoint_interval=5", "train.keep_checkpoints=5"],
    ["parallel.pp=2", "parallel.stage_layout=1,1", "train.grad_accum=8"],
], ids=lambda s: " ".join(s))
def test_the_same_option_where_it_acts_does_not_warn(sets):
    cfg = make_config("tiny", overrides=sets)
    validate(cfg)
    assert ignored_options(cfg) == []


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_warn_of_nothing(preset):
    assert ignored_options(make_config(preset)) == []


def test_a_short_run_of_a_preset_warns_of_nothing_the_user_did_not_set():
    # The presets' intervals differ from the defaults; a short run does not make them warn.
    cfg = make_config("tiny", overrides=["train.steps=2", "train.warmup_steps=0"])
    assert config_warnings(cfg) == []


def test_make_demo_layout_warns_of_nothing():
    # The Makefile's DEMO_LAYOUT on the demo preset.
    cfg = resolve_config("demo", None, None, {
        "parallel": {"dp": 1, "tp": 2, "pp": 2, "schedule": "1f1b"},
        "train": {"grad_accum": 4, "micro_batch_size": 8}}, nproc=4)
    assert config_warnings(validate(cfg, 4)) == []


def test_a_no_effect_warning_is_printed_at_start(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setattr(tessera.launch, "launch", lambda n, argv, restarts=0: 0)
    monkeypatch.delenv("TESSERA_RELAUNCHED", raising=False)
    args = _train(tiny_data, tmp_path, "--nproc", "2", "--cp-ulysses", "4")
    monkeypatch.setattr("sys.argv", ["tessera", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "warning: parallel.cp_ulysses=4: no effect, no context parallelism (parallel.cp=1)"]


def test_dry_run_verifies_the_checkpoint_it_would_resume(tiny_data, tmp_path):
    common = ["--steps", "2", "--set", "data.seq_len=16", "--set", "data.val_tokens=256",
              "--set", "train.sample_tokens=0", "--no-progress"]
    run = runner.invoke(app, _train(tiny_data, tmp_path / "run", "--checkpoint-interval", "2",
                                    *common))
    assert run.exit_code == 0, run.output
    step = tmp_path / "run" / "out" / "checkpoints" / "step-0000002"
    result = runner.invoke(app, _train(tiny_data, tmp_path, "--resume", str(step), "--dry-run",
                                       *common))
    assert result.exit_code == 0, result.output
    assert f"# resume: {step} (checkpoint verified)" in result.stdout
    # Another global batch cannot resume it: refused by the dry run as by a real start.
    line = cli_error(_train(tiny_data, tmp_path, "--resume", str(step), "--dry-run",
                            "--micro-batch-size", "4", *common))
    assert str(step) in line
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    line = cli_error(_train(tiny_data, tmp_path, "--resume", str(step), "--dry-run", *common))
    assert str(step) in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Paths the kernel refuses by their length (found by benchmarks/flag_fuzz.py: a 5,000-byte
# train.checkpoint_dir was a traceback, ENAMETOOLONG from the first Path.is_dir())

LONG_NAME = "x" * 256  # one component over NAME_MAX (255)


@pytest.mark.parametrize("field", ["train.out_dir", "train.checkpoint_dir", "train.resume",
                                   "train.init_from", "data.path"])
def test_a_path_field_with_a_component_over_name_max_is_named(field, tiny_data, tmp_path,
                                                               no_launch):
    line = cli_error([*_train(tiny_data, tmp_path), "--set", f"{field}={tmp_path}/{LONG_NAME}",
                      "--dry-run"])
    assert line.startswith(f"error: {field}=") and "at most 255" in line


def test_a_path_at_name_max_is_a_path_like_any_other(tmp_path):
    # The bound is NAME_MAX itself, not one below: 255 bytes is a legal name.
    cfg = make_config("tiny", overrides=[f"train.out_dir={tmp_path}/{'x' * 255}"])
    assert cfg.train.out_dir.endswith("x" * 255)
    with pytest.raises(ConfigError, match="at most 4096"):
        make_config("tiny", overrides=["train.out_dir=" + "/".join(["y" * 200] * 21)])


def test_a_too_long_path_to_any_command_is_one_line(tmp_path, capsys):
    # The CLI's fallback for commands whose paths are not config fields.
    from tessera.cli import main

    for args in (["eval", "--checkpoint", f"{tmp_path}/{LONG_NAME}"],
                 ["generate", "--checkpoint", f"{tmp_path}/{LONG_NAME}"],
                 ["train", "--config", f"{tmp_path}/{LONG_NAME}.yaml"]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
