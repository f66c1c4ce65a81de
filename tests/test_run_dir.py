"""A run directory belongs to one run (``tessera.run_dir``, ``run_dir.run_start``).

The bug this guards: a second run trained into the same --out overwrote the first run's
checkpoint of the same step, pruning then deleted the second run's own checkpoints and kept the
first run's newer ones, and inspect, eval, --resume latest and a restart all took the first
run's weights. Now every manifest names its run; a new run where another run's checkpoints are
is refused (one line, exit 2) unless --overwrite, which deletes them; pruning, --resume latest
and a restart take only the run's own checkpoints; without --out each run gets a new
runs/<YYYYmmdd-HHMMSS>, linked from runs/latest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera import checkpoint, run_dir
from tessera.checkpoint import config_hash, latest, prune, run_id_of, step_dir
from tessera.cli import app
from tessera.config_io import make_config
from tessera.errors import ConfigError

SMALL = ["--preset", "tiny", "--no-progress", "--set", "data.seq_len=16", "--set",
         "data.val_tokens=256", "--set", "train.sample_tokens=0"]
STAMP = re.compile(r"\d{8}-\d{6}(-\d+)?")


def _train(data: str, *args: str) -> str:
    result = CliRunner().invoke(app, ["train", "--data", data, *SMALL, *args])
    assert result.exit_code == 0, result.output
    return result.output


def _steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def _ids(out: Path) -> set[str | None]:
    return {run_id_of(p) for p in (out / "checkpoints").iterdir()}


@pytest.fixture(autouse=True)
def _no_inherited_run(monkeypatch):
    """Neither a run id nor a restart count from whatever started the tests."""
    for name in (run_dir.RUN_ID_ENV, run_dir.ELASTIC_RUN_ID_ENV, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def first(tiny_data, tmp_path_factory) -> Path:
    """The first run: 4 steps into one --out, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("first") / "j1"
    _train(tiny_data, "--steps", "4", "--checkpoint-interval", "2", "--out", str(out))
    return out


def _copy(first: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(first, tmp_path / "j1", symlinks=True))


def test_manifest_names_the_run_and_its_config(first):
    ids = _ids(first)
    assert len(ids) == 1 and STAMP.fullmatch(next(iter(ids)).rsplit("-", 1)[0])
    hashes = {json.loads((p / "meta.json").read_text())["config_hash"]
              for p in (first / "checkpoints").iterdir()}
    assert len(hashes) == 1 and re.fullmatch(r"[0-9a-f]{16}", next(iter(hashes)))
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(first)])
    assert result.exit_code == 0, result.output
    assert f"run {next(iter(ids))}, config hash {next(iter(hashes))}" in result.output


def test_config_hash_leaves_out_where_the_run_writes():
    cfg = make_config("tiny")
    moved = make_config("tiny", overrides=["train.out_dir=elsewhere", "train.overwrite=true",
                                           "train.resume=latest", "train.checkpoint_dir=x"])
    assert config_hash(moved) == config_hash(cfg)
    assert config_hash(make_config("tiny", overrides=["train.seed=7"])) != config_hash(cfg)
    assert config_hash(make_config("tiny", overrides=["model.n_layers=3"])) != config_hash(cfg)


def test_a_second_run_into_the_same_out_is_refused_and_nothing_deleted(tiny_data, first,
                                                                      tmp_path):
    """The tester's scenario: another seed, another checkpoint interval, the same --out."""
    out = _copy(first, tmp_path)
    before = {p.name: (p / "meta.json").read_bytes() for p in (out / "checkpoints").iterdir()}
    metrics = (out / "metrics.jsonl").read_bytes()
    line = cli_error(["train", "--data", tiny_data, *SMALL, "--out", str(out), "--steps", "2",
                      "--checkpoint-interval", "1", "--set", "train.seed=7"])
    assert line.startswith(f"error: train.out_dir='{out}': holds another run's checkpoints "
                           "(step-0000002, step-0000004; run ")
    assert line.endswith("continue that run with --resume latest, delete them with "
                         "--overwrite, or train into a new --out")
    after = {p.name: (p / "meta.json").read_bytes() for p in (out / "checkpoints").iterdir()}
    assert after == before and (out / "metrics.jsonl").read_bytes() == metrics

    # Every rank refuses too, in trainer.train, before anything is written.
    from tessera.trainer import train

    cfg = make_config("tiny", overrides=[f"data.path={tiny_data}", "data.seq_len=16",
                                         "data.val_tokens=256", f"train.out_dir={out}",
                                         "train.checkpoint_interval=1", "train.seed=7"])
    with pytest.raises(ConfigError, match="holds another run's checkpoints"):
        train(cfg, progress=False)
    assert (out / "metrics.jsonl").read_bytes() == metrics
    # So does a run resuming another directory's checkpoint into this one.
    other = tmp_path / "other"
    _train(tiny_data, "--out", str(other), "--steps", "2", "--checkpoint-interval", "2")
    assert "holds another run's checkpoints" in cli_error(
        ["train", "--data", tiny_data, *SMALL, "--out", str(out), "--steps", "4",
         "--resume", str(step_dir(other / "checkpoints", 2))])


def test_overwrite_replaces_the_old_run_and_resume_latest_continues_the_new_one(
        tiny_data, first, tmp_path):
    out = _copy(first, tmp_path)
    (old_id,) = _ids(out)
    printed = _train(tiny_data, "--out", str(out), "--steps", "2", "--checkpoint-interval", "1",
                     "--set", "train.seed=7", "--overwrite")
    assert f"overwrite: deleted 2 checkpoint(s) of another run from {out / 'checkpoints'}" in (
        printed)
    # Only the new run's checkpoints: its step 2 (not the old run's) and its step 1 (pruning,
    # keep 2, kept its own rather than the old run's step 4).
    assert _steps(out) == ["step-0000001", "step-0000002"]
    (new_id,) = _ids(out)
    assert new_id != old_id
    inspect = CliRunner().invoke(app, ["checkpoint", "inspect", str(out)]).output
    assert f"checkpoint {step_dir(out / 'checkpoints', 2)}" in inspect
    assert f"run {new_id}," in inspect and "step 2," in inspect
    # --resume latest continues this run under its id; pruning keeps its newest two.
    printed = _train(tiny_data, "--out", str(out), "--steps", "4", "--checkpoint-interval",
                     "1", "--set", "train.seed=7", "--resume", "latest")
    assert f"resumed from {step_dir(out / 'checkpoints', 2)} at step 2" in printed
    assert _steps(out) == ["step-0000003", "step-0000004"] and _ids(out) == {new_id}
    # The directory now belongs to the new run: yet another new run is refused.
    assert "holds another run's checkpoints" in cli_error(
        ["train", "--data", tiny_data, *SMALL, "--out", str(out), "--steps", "2"])


def _fake(root: Path, step: int, run_id: str | None) -> Path:
    """A checkpoint directory with only a manifest naming its run (what the choices read)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "run_id": run_id}))
    return path


def test_latest_and_prune_take_one_runs_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    a = [_fake(root, s, "a") for s in (1, 2, 3)]
    b4 = _fake(root, 4, "b")
    assert latest(root, "a") == a[2] and latest(root, "b") == b4
    assert latest(root) == b4  # the directory's run: its newest checkpoint's
    assert checkpoint.owner(root) == "b"
    prune(root, 2, "a")
    assert sorted(p.name for p in root.iterdir()) == [p.name for p in (*a[1:], b4)]
    assert checkpoint.other_runs(root, "a", resuming=False) == [b4]
    assert checkpoint.other_runs(root, None, resuming=False) == [*a[1:], b4]


def test_a_restart_takes_only_its_own_runs_newest(tmp_path, monkeypatch):
    from tessera.run_dir import check_run_dir, run_start

    root = tmp_path / "checkpoints"
    cfg = make_config("tiny", overrides=[f"train.checkpoint_dir={root}"])
    a2 = _fake(root, 2, "a")
    b4 = _fake(root, 4, "b")  # another run's, with a higher step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv(run_dir.RUN_ID_ENV, "a")
    start = run_start(cfg)
    assert (start.resume_from, start.run_id, start.others) == (a2, "a", [b4])
    # torchrun's rendezvous id names the run when tessera's launcher did not.
    monkeypatch.delenv(run_dir.RUN_ID_ENV)
    monkeypatch.setenv(run_dir.ELASTIC_RUN_ID_ENV, "a")
    assert run_start(cfg).resume_from == a2
    # Restarted before its first checkpoint: where train.resume says, under the same id.
    monkeypatch.setenv(run_dir.ELASTIC_RUN_ID_ENV, "c")
    assert run_start(cfg).resume_from is None and run_start(cfg).run_id == "c"
    # A first attempt never takes a checkpoint by itself, and counts every one as another run's.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert run_start(cfg).resume_from is None and run_start(cfg).others == [a2, b4]
    with pytest.raises(ConfigError, match=rf"train.checkpoint_dir='{root}': holds another run's "
                       r"checkpoints \(step-0000002, step-0000004; run a, b\): .* or train into "
                       "a new train.checkpoint_dir"):
        check_run_dir(cfg, run_start(cfg))
    check_run_dir(make_config("tiny", overrides=[f"train.checkpoint_dir={root}",
                                                 "train.overwrite=true"]), run_start(cfg))


def test_a_restarted_run_resumes_its_own_checkpoint_end_to_end(tiny_data, first, tmp_path,
                                                               monkeypatch):
    """A restart (TORCHELASTIC_RESTART_COUNT > 0) of the first run, with another run's step-6
    beside its own: it resumes its own step 4; --overwrite deletes the other's."""
    out = _copy(first, tmp_path)
    root = out / "checkpoints"
    (own,) = _ids(out)
    other = Path(shutil.copytree(step_dir(root, 4), step_dir(root, 6)))
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps(meta | {"run_id": "other", "step": 6}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv(run_dir.RUN_ID_ENV, own)
    args = ["--out", str(out), "--steps", "6", "--checkpoint-interval", "2"]
    assert "holds another run's checkpoints (step-0000006; run other)" in cli_error(
        ["train", "--data", tiny_data, *SMALL, *args])
    printed = _train(tiny_data, *args, "--overwrite")
    assert f"resumed from {step_dir(root, 4)} at step 4 (restart 1)" in printed
    assert _steps(out) == ["step-0000004", "step-0000006"] and _ids(out) == {own}


def test_checkpoints_from_before_run_ids(tiny_data, first, tmp_path):
    """Without a run id: another run's for a new run (refused), still resumable."""
    out = _copy(first, tmp_path)
    for path in (out / "checkpoints").iterdir():
        meta = json.loads((path / "meta.json").read_text())
        del meta["run_id"], meta["config_hash"]
        (path / "meta.json").write_text(json.dumps(meta))
    line = cli_error(["train", "--data", tiny_data, *SMALL, "--out", str(out), "--steps", "2"])
    assert "(step-0000002, step-0000004; run from before run ids)" in line
    inspect = CliRunner().invoke(app, ["checkpoint", "inspect", str(out)]).output
    assert "run none (written before run ids), config hash none" in inspect
    printed = _train(tiny_data, "--out", str(out), "--steps", "6", "--checkpoint-interval", "2",
                     "--resume", "latest")
    assert f"resumed from {step_dir(out / 'checkpoints', 4)} at step 4" in printed
    new = run_id_of(step_dir(out / "checkpoints", 6))
    assert new is not None and latest(out / "checkpoints") == step_dir(out / "checkpoints", 6)
    # Pruning leaves the old checkpoints alone (they are not this run's).
    assert _steps(out) == ["step-0000002", "step-0000004", "step-0000006"]


def test_default_out_is_a_new_directory_linked_from_runs_latest(tiny_data, tmp_path,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    args = ["--steps", "2", "--checkpoint-interval", "2"]
    _train(tiny_data, *args)
    (one,) = [p for p in runs.iterdir() if p.name != "latest"]
    assert STAMP.fullmatch(one.name) and os.readlink(runs / "latest") == one.name
    _train(tiny_data, *args)
    (two,) = [p for p in runs.iterdir() if p.name not in ("latest", one.name)]
    assert STAMP.fullmatch(two.name) and os.readlink(runs / "latest") == two.name
    assert _steps(one) == _steps(two) == ["step-0000002"]
    # --resume latest without --out continues the run runs/latest points to, in its directory.
    printed = _train(tiny_data, "--steps", "4", "--checkpoint-interval", "2", "--resume",
                     "latest")
    assert f"resumed from {Path('runs') / two.name / 'checkpoints' / 'step-0000002'}" in printed
    assert _steps(two) == ["step-0000002", "step-0000004"] and _steps(one) == ["step-0000002"]
    assert sorted(p.name for p in runs.iterdir()) == sorted([one.name, two.name, "latest"])


def test_new_run_names_take_a_suffix_and_latest_is_replaced(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = run_dir.claim(run_dir.new_out_dir("20260101-000000"))
    assert first == Path("runs/20260101-000000") and first.is_dir()
    assert run_dir.new_out_dir("20260101-000000") == Path("runs/20260101-000000-2")
    # Taken between choosing and making: the next free name.
    Path("runs/20260101-000000-2").mkdir()
    assert run_dir.claim(Path("runs/20260101-000000-2")) == Path("runs/20260101-000000-3")
    assert run_dir.point_latest(first) is None and os.readlink("runs/latest") == first.name
    assert run_dir.point_latest(Path("runs/20260101-000000-3")) is None
    assert os.readlink("runs/latest") == "20260101-000000-3"
    assert not [p for p in Path("runs").iterdir() if p.name.startswith(".latest")]
    # --resume latest follows the link; where its directory is gone, a new run starts.
    assert run_dir.default_out_dir("latest", False) == (Path("runs/20260101-000000-3"), False)
    Path("runs/20260101-000000-3").rmdir()
    out, new = run_dir.default_out_dir("latest", False)
    assert new and STAMP.fullmatch(out.name) and out.parent == Path("runs")


def test_an_older_runs_latest_directory_is_left_with_a_warning(tiny_data, tmp_path,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "runs" / "latest"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text("{}\n")
    result = CliRunner().invoke(app, ["train", "--data", tiny_data, *SMALL, "--steps", "1"])
    assert result.exit_code == 0, result.output
    assert "warning: runs/latest is a directory (from an older tessera), left as it is" in (
        result.stderr)
    assert not old.is_symlink() and (old / "metrics.jsonl").read_text() == "{}\n"
    assert len(list((tmp_path / "runs").iterdir())) == 2


def test_the_launched_ranks_get_the_directory_and_run_id(tiny_data, tmp_path, monkeypatch):
    """`train --nproc 2` chooses the directory and the run id once: the ranks get the
    directory as their last argument and the id in TESSERA_RUN_ID (restarts inherit both)."""
    import tessera.launch

    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(tessera.launch, "launch", lambda n, argv, restarts=0: seen.append(
        (argv, os.environ.get(run_dir.RUN_ID_ENV))) or 0)
    args = ["train", "--data", tiny_data, *SMALL, "--nproc", "2", "--steps", "2"]
    monkeypatch.setattr(sys, "argv", ["tessera", *args])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    ((argv, run_id),) = seen
    out = os.readlink("runs/latest")
    assert argv[-2:] == ["--set", f'train.out_dir="runs/{out}"'] and Path("runs", out).is_dir()
    assert run_id is not None and STAMP.fullmatch(run_id.rsplit("-", 1)[0])
    assert run_dir.RUN_ID_ENV not in os.environ  # set for the launch only


def test_a_resumed_launch_keeps_the_checkpoints_run_id(tiny_data, first, tmp_path,
                                                       monkeypatch):
    import tessera.launch

    seen = []
    monkeypatch.setattr(tessera.launch, "launch", lambda n, argv, restarts=0: seen.append(
        os.environ.get(run_dir.RUN_ID_ENV)) or 0)
    args = ["train", "--data", tiny_data, *SMALL, "--nproc", "2", "--tp", "2", "--steps", "6",
            "--out", str(tmp_path / "next"), "--resume", str(step_dir(first / "checkpoints", 4))]
    monkeypatch.setattr(sys, "argv", ["tessera", *args])
    assert CliRunner().invoke(app, args).exit_code == 0
    assert seen == list(_ids(first))


def test_under_plain_torchrun_the_ranks_need_a_shared_name(tiny_data, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(run_dir.ELASTIC_RUN_ID_ENV, "none")  # torchrun's default --rdzv-id
    assert "train.out_dir='': under torchrun without --rdzv-id (or TESSERA_RUN_ID) the ranks " \
           "cannot agree on a new directory: give --out DIR" in cli_error(
               ["train", "--data", tiny_data, *SMALL, "--steps", "1"])
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv(run_dir.ELASTIC_RUN_ID_ENV, "job7")
    assert run_dir.default_out_dir("", under_launcher=True) == (Path("runs/job7"), True)


def test_a_run_without_checkpoints_may_reuse_its_out(tiny_data, tmp_path):
    """`make demo` trains into runs/demo without checkpoints, as often as it is run."""
    for _ in range(2):
        _train(tiny_data, "--out", str(tmp_path / "demo"), "--steps", "1")
