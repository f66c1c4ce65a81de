"""Checkpoints: a resumed run continues bit for bit; a bad checkpoint is refused with its path.

Same layout (another layout: tests/test_checkpoint_reshard.py). Exactness: a run of 6 steps
that saved at step 3, and a second run resumed from that step-3 checkpoint, must log the same
loss and gradient norm at steps 4-6 (and, where the gradient noise scale is measured, the same
noise-scale record: its moving averages are saved) and end with the same full model
(tolerance 0: the same kernels run on the same numbers in the same order). Shown for
one process, dp=2 (DDP), dp=2 with ZeRO-3 (fp32 shards) and ZeRO-2 in bf16 (fp32 masters
apart from the bf16 weights), the synchronous parameter server, tp=2 and pp=2 (1F1B). The
asynchronous parameter server is refused: its in-flight gradients are not saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.checkpoint import CheckpointError, latest, load_model, step_dir
from tessera.cli import app
from tessera.config_io import make_config
from tessera.metrics import read_metrics
from tessera.noise_scale import NoiseScale, noise_scale_unsupported
from tessera.testing import run_ranks
from test_noise_scale import _strip_noise_state

STEPS, EVERY = 6, 3


def _cfg(data: str, out: str, parallel: dict | None = None, **train) -> object:
    overrides = [f"data.path={data}", "data.seq_len=16", "data.val_tokens=256",
                 f"train.steps={STEPS}", f"train.checkpoint_interval={EVERY}",
                 "train.keep_checkpoints=0", "train.sample_tokens=0", "train.eval_interval=0",
                 "train.grad_accum=2", f"train.out_dir={out}"]
    overrides += [f"{k}={v}" if "." in k else f"parallel.{k}={v}"
                  for k, v in (parallel or {}).items()]
    overrides += [f"train.{k}={v}" for k, v in train.items()]
    return make_config("tiny", overrides=overrides)


NOISE = ("noise_scale", "noise_scale_tokens", "grad_sq_est", "grad_trace_est")
"""A step record's gradient noise scale (``tessera.noise_scale``), where measured."""


def _records(out: Path, noise: bool = False) -> dict[int, tuple]:
    """Per step: (loss, grad_norm), and with `noise` the noise-scale fields (None where not
    measured)."""
    rows = read_metrics(out / "metrics.jsonl")
    return {r["step"]: (r["loss"], r["grad_norm"], *(r.get(k) for k in NOISE if noise))
            for r in rows if "loss" in r}


def _resume_rank(data: str, root: str, parallel: dict) -> dict | None:
    from tessera.trainer import train

    a, b = Path(root) / "a", Path(root) / "b"
    train(_cfg(data, str(a), parallel), progress=False)
    resume = step_dir(a / "checkpoints", EVERY)
    train(_cfg(data, str(b), parallel, resume=str(resume)), progress=False)
    if torch.distributed.get_rank() != 0:
        return None
    model = {run: load_model(step_dir(run / "checkpoints", STEPS))[1] for run in (a, b)}
    return dict(a=_records(a, True), b=_records(b, True), model_a=model[a], model_b=model[b])


LAYOUTS = {
    "dp=2": dict(dp=2),
    "zero-3 dp=2": dict(dp=2, zero_stage=3),
    # bf16: the fp32 masters are separate from the bf16 compute weights, so loading must
    # re-publish them (in fp32 ZeRO the shards are their own masters).
    "zero-2 dp=2 bf16": {"dp": 2, "zero_stage": 2, "train.precision": "bf16"},
    "parameter server dp=2": dict(dp=2, dp_mode="ps"),
    "tp=2": dict(dp=1, tp=2),
    "pp=2 1f1b": dict(dp=1, pp=2, schedule="1f1b"),
    # Composed layouts: every mechanism's state in one checkpoint.
    "tp=2 pp=2 zero-1": dict(dp=1, tp=2, pp=2, zero_stage=1),
    "dp=2 tp=2 pp=2 zero-3 bf16 full recompute": {
        "dp": 2, "tp": 2, "pp": 2, "zero_stage": 3, "recompute": "full",
        "train.precision": "bf16"},
    # Context parallelism: replicas over dp × cp, ZeRO shards over that group.
    "dp=2 cp=2 ring zero-2": dict(dp=2, cp=2, cp_method="ring", zero_stage=2),
}


def _world(parallel: dict) -> int:
    return (parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1)
            * parallel.get("cp", 1))


def _check_resumed(got: dict, label: str) -> None:
    a, b = got["a"], got["b"]
    assert sorted(a) == list(range(1, STEPS + 1)), label
    assert sorted(b) == list(range(EVERY + 1, STEPS + 1)), label  # nothing before the resume
    for step in b:
        assert b[step] == a[step], f"{label} step {step}: {b[step]} != {a[step]}"
    assert got["model_a"].keys() == got["model_b"].keys()
    for name, value in got["model_a"].items():
        torch.testing.assert_close(got["model_b"][name], value, rtol=0, atol=0,
                                   msg=f"{label} {name}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", LAYOUTS)
def test_resumed_run_continues_exactly(tiny_data, tmp_path, name):
    world = _world(LAYOUTS[name])
    parallel = LAYOUTS[name]
    got = run_ranks(_resume_rank, world, args=(tiny_data, str(tmp_path), parallel),
                    timeout=300)[0]
    _check_resumed(got, name)
    # The noise scale is measured (and compared above) exactly where the layout allows it.
    measured = noise_scale_unsupported(parallel.get("dp", 1), parallel.get("cp", 1), 1,
                                       parallel.get("dp_mode", "allreduce")) is None
    assert all((row[4] is not None) == measured for row in got["b"].values()), name
    meta = json.loads((step_dir(tmp_path / "a" / "checkpoints", EVERY) / "meta.json")
                      .read_text())
    # One DCP file per rank that holds something to write, DCP's index, the replicated extra.
    assert meta["layout"]["world_size"] == world
    assert {".metadata", "extra.json", "__0_0.distcp"} <= set(meta["files"])


def test_one_process_resume_and_latest(tiny_data, tmp_path):
    from tessera.trainer import run

    run(_cfg(tiny_data, str(tmp_path / "a")), progress=False)
    assert latest(tmp_path / "a" / "checkpoints") == step_dir(tmp_path / "a" / "checkpoints",
                                                              STEPS)
    run(_cfg(tiny_data, str(tmp_path / "b"),
             resume=str(step_dir(tmp_path / "a" / "checkpoints", EVERY))), progress=False)
    models = [load_model(step_dir(tmp_path / r / "checkpoints", STEPS))[1] for r in ("a", "b")]
    _check_resumed(dict(a=_records(tmp_path / "a"), b=_records(tmp_path / "b"),
                        model_a=models[0], model_b=models[1]), "one process")


def _train_cli(data: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--data", data, "--steps", str(STEPS),
            "--checkpoint-interval", str(EVERY), "--out", str(out), "--no-progress",
            "--set", "data.seq_len=16", "--set", "data.val_tokens=256",
            "--set", "train.sample_tokens=0", *extra]


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory) -> Path:
    """A one-process run's checkpoint directory (steps 3 and 6)."""
    out = tmp_path_factory.mktemp("saved")
    result = CliRunner().invoke(app, _train_cli(tiny_data, out))
    assert result.exit_code == 0, result.output
    return out / "checkpoints"


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_latest_resumes_the_newest_and_starts_fresh_without_one(tiny_data, saved, tmp_path):
    # A directory left by a crash mid-write (no manifest) is not a checkpoint.
    (saved.parent / "checkpoints" / "step-0000009.tmp").mkdir(exist_ok=True)
    assert latest(saved) == step_dir(saved, STEPS)
    result = CliRunner().invoke(app, _train_cli(tiny_data, tmp_path / "fresh",
                                                "--resume", "latest"))
    assert result.exit_code == 0, result.output
    assert _records(tmp_path / "fresh").keys() == set(range(1, STEPS + 1))


def test_corrupt_missing_and_mismatched_checkpoints_are_refused(tiny_data, saved, tmp_path):
    good = step_dir(saved, EVERY)
    # A flipped bit in a rank's shard file.
    bad = _copy(good, tmp_path / "flipped")
    data = bytearray((bad / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / "__0_0.distcp").write_bytes(bytes(data))
    line = cli_error(_train_cli(tiny_data, tmp_path / "r1", "--resume", str(bad)))
    assert f"checkpoint {bad / '__0_0.distcp'}: size or SHA-256 differs" in line
    # A truncated shard file and a truncated DCP index.
    for name in ("__0_0.distcp", ".metadata"):
        cut = _copy(good, tmp_path / f"cut{name}")
        (cut / name).write_bytes((cut / name).read_bytes()[:100])
        assert f"checkpoint {cut / name}: size or SHA-256 differs" in cli_error(
            _train_cli(tiny_data, tmp_path / "r2", "--resume", str(cut)))
    # No manifest: an unfinished write, or not a checkpoint at all.
    bare = _copy(good, tmp_path / "bare")
    (bare / "meta.json").unlink()
    assert f"checkpoint {bare}: no meta.json" in cli_error(
        _train_cli(tiny_data, tmp_path / "r3", "--resume", str(bare)))
    # An unreadable manifest.
    junk = _copy(good, tmp_path / "junk")
    (junk / "meta.json").write_text("{not json")
    assert "unreadable manifest" in cli_error(
        _train_cli(tiny_data, tmp_path / "r4", "--resume", str(junk)))
    # Another model or global batch names the field and both values.
    line = cli_error(_train_cli(tiny_data, tmp_path / "r5", "--resume", str(good),
                                "--set", "model.n_layers=3"))
    assert f"checkpoint {good}: model.n_layers=2 there, 3 in this run" in line
    line = cli_error(_train_cli(tiny_data, tmp_path / "r6", "--resume", str(good),
                                "--microbatches", "2"))
    assert "global_batch=8 there, 16 in this run" in line
    line = cli_error(_train_cli(tiny_data, tmp_path / "r7", "--resume", str(good),
                                "--set", "data.seed=7"))
    assert "data_seed=1234 there, 7 in this run" in line
    # Nothing was written for any refused run.
    assert not any((tmp_path / f"r{i}").exists() for i in range(1, 8))


def test_settings_that_leave_the_state_alone_may_change_on_resume(tiny_data, saved, tmp_path):
    """Recomputation and the DDP bucket size change how a step runs, not what a rank holds:
    the resumed run continues with the same numbers (recomputation is bitwise neutral, and
    one rank has nothing to reduce)."""
    out = tmp_path / "changed"
    result = CliRunner().invoke(app, _train_cli(
        tiny_data, out, "--resume", str(step_dir(saved, EVERY)), "--recompute", "full",
        "--bucket-mb", "1"))
    assert result.exit_code == 0, result.output
    assert _records(out) == {s: r for s, r in _records(saved.parent).items() if s > EVERY}


def _refuse_rank(data: str, bad: str) -> str:
    from tessera.trainer import train

    try:
        train(_cfg(data, bad + "-out", dict(dp=2), resume=bad), progress=False)
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_every_rank_refuses_before_any_collective(tiny_data, tmp_path):
    """A checkpoint whose rank-1 file is corrupt: both ranks refuse (rank 0 too, though it
    would read rank 0's file first), so no rank is left waiting in a collective."""
    out = tmp_path / "two"
    run_ranks(_save_two_ranks, 2, args=(tiny_data, str(out)))
    bad = step_dir(out / "checkpoints", EVERY)
    raw = bytearray((bad / "__1_0.distcp").read_bytes())
    raw[-10] ^= 0xFF
    (bad / "__1_0.distcp").write_bytes(bytes(raw))
    messages = run_ranks(_refuse_rank, 2, args=(tiny_data, str(bad)))
    assert all(f"checkpoint {bad / '__1_0.distcp'}: size or SHA-256" in m for m in messages)


def _save_two_ranks(data: str, out: str) -> None:
    from tessera.trainer import train

    train(_cfg(data, out, dict(dp=2)), progress=False)


def test_asynchronous_parameter_server_cannot_checkpoint():
    from tessera.errors import ConfigError
    from tessera.layout import validate

    cfg = make_config("tiny", parallel=dict(dp=2, dp_mode="ps-async"),
                      train=dict(checkpoint_interval=2))
    with pytest.raises(ConfigError, match="parallel.dp_mode='ps-async': cannot checkpoint"):
        validate(cfg, 2)


def test_inspect_and_export(saved, tmp_path):
    """`tessera checkpoint inspect` names the step, the layout and every tensor; `export`
    writes the consolidated weights (torch: model.pt in reference names; hf: a Llama dir)."""
    ckpt = step_dir(saved, EVERY)
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(saved)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"checkpoint {step_dir(saved, STEPS)}" in out and "step 6," in out
    assert "world_size=1" in out and "dp=1 tp=1 pp=1" in out
    assert "model.tok_embeddings.weight" in out and "optim.exp_avg_sq.norm.weight" in out
    assert "\nnoise scale: not measured\n" in out  # dp 1 saves no averages
    result = CliRunner().invoke(app, ["checkpoint", "export", str(ckpt), "--to",
                                      str(tmp_path / "pt"), "--format", "torch"])
    assert result.exit_code == 0, result.output
    exported = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    _, state, _ = load_model(ckpt)
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], state[k]) for k in state)
    pytest.importorskip("safetensors")
    result = CliRunner().invoke(app, ["checkpoint", "export", str(ckpt), "--to",
                                      str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # A bad checkpoint is refused by the tools too, with its path.
    bad = _copy(ckpt, tmp_path / "bad")
    (bad / "__0_0.distcp").write_bytes((bad / "__0_0.distcp").read_bytes()[:-1])
    assert f"checkpoint {bad / '__0_0.distcp'}: size or SHA-256 differs" in cli_error(
        ["checkpoint", "inspect", str(bad)])


def test_inspect_shows_the_saved_noise_scale(saved, tmp_path):
    """`checkpoint inspect` gives B_simple and both averages as training computes them from the
    saved state (``NoiseScale``, bias-corrected: decay 0.9 over 3 steps divides each average
    by 0.271), the record of the step it was saved at; a state without a positive |G|^2
    average, one saved before the averages were, and a malformed one (refused, with its
    path)."""
    def inspect(ckpt: Path) -> list[str]:
        result = CliRunner().invoke(app, ["checkpoint", "inspect", str(ckpt)])
        assert result.exit_code == 0, result.output
        return [ln for ln in result.output.splitlines() if ln.startswith("noise scale:")]

    ckpt = step_dir(saved, EVERY)
    noise = NoiseScale(decay=0.9)
    last = [noise.update(s, b, 4, 16) for s, b in ((1.5, 1.125), (3.1, 2.2), (2.0, 1.3))][-1]
    _strip_noise_state(ckpt, tmp_path / "measured", noise.state_dict())
    assert inspect(tmp_path / "measured") == [
        f"noise scale: B_simple ≈ {last['noise_scale']:.4g} sequences after 3 measured steps "
        f"(averages |G|^2 {last['grad_sq_est']:.4g}, tr(Σ) {last['grad_trace_est']:.4g}, "
        f"decay 0.9)"]
    negative = NoiseScale()
    g_sq = negative.update(1.0, 0.1, 1, 2)["grad_sq_est"]
    _strip_noise_state(ckpt, tmp_path / "negative", negative.state_dict())
    assert inspect(tmp_path / "negative") == [
        f"noise scale: B_simple undefined after 1 measured step (the |G|^2 average, "
        f"{g_sq:.4g}, is not positive)"]
    _strip_noise_state(ckpt, tmp_path / "older")
    assert inspect(tmp_path / "older") == [
        "noise scale: not saved (the checkpoint predates the saved moving averages)"]
    _strip_noise_state(ckpt, tmp_path / "bad", {"decay": 0.9})
    assert cli_error(["checkpoint", "inspect", str(tmp_path / "bad")]).startswith(
        f"error: checkpoint {tmp_path / 'bad' / 'extra.json'}: malformed noise-scale state")


def _sync_and_async(data: str, root: str) -> None:
    from tessera.trainer import train

    for name, background in (("sync", "false"), ("async", "true")):
        train(_cfg(data, str(Path(root) / name), dict(dp=2, zero_stage=1), checkpoint_interval=2,
                   keep_checkpoints=2, async_checkpoint=background), progress=False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_background_save_writes_what_a_blocking_one_writes(tiny_data, tmp_path):
    """train.async_checkpoint: training mutates the weights and moments while the previous
    step's files are written, so each rank must write the copies it took at the save: every
    tensor of both kept checkpoints equals the blocking run's, bit for bit; pruning and the
    manifest still happen (in the saver's thread), and nothing unfinished is left behind."""
    from tessera.checkpoint import load_tensors, read_manifest
    from tessera.checkpoint_read import read_metadata

    run_ranks(_sync_and_async, 2, args=(tiny_data, str(tmp_path)))
    assert _records(tmp_path / "sync") == _records(tmp_path / "async")
    for run in ("sync", "async"):
        names = sorted(p.name for p in (tmp_path / run / "checkpoints").iterdir())
        assert names == ["step-0000004", "step-0000006"], (run, names)
    for step in (4, 6):
        got = {}
        for run in ("sync", "async"):
            path = step_dir(tmp_path / run / "checkpoints", step)
            read_manifest(path)
            keys = list(read_metadata(path).state_dict_metadata)
            got[run] = load_tensors(path, sorted(keys))
        assert got["sync"].keys() == got["async"].keys()
        for key, value in got["sync"].items():
            assert torch.equal(got["async"][key], value), (step, key)


def _save_then_mutate(data: str, root: str) -> None:
    import threading

    import torch.distributed as dist

    from tessera import checkpoint
    from tessera.data.loader import BatchLoader, TokenDataset
    from tessera.optim import lr_lambda
    from tessera.parallelize import parallelize
    from tessera.step import Executor
    from tessera.topology import Topology

    cfg = _cfg(data, root, dict(dp=2, zero_stage=1))
    topo = Topology.build(cfg.parallel)
    executor = Executor(parallelize(cfg, topo, torch.device("cpu")))
    optimizer = executor.optimizer(cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    loader = BatchLoader(TokenDataset(data).train, 16, 8, 2, topo.coords()["dp"], topo.dp)
    args = (cfg, executor, optimizer, scheduler, loader, topo.rank, topo.world_size)
    checkpoint.save(Path(root) / "blocking", 1, *args)
    saver = checkpoint.AsyncSaver(dist.new_group(backend="gloo"))
    gate = threading.Event()
    saver._pool.submit(gate.wait)  # the write queues behind this until the tensors changed
    checkpoint.save(Path(root) / "background", 1, *args, saver=saver)
    with torch.no_grad():  # what the next steps do to the live state
        for u in optimizer.units:
            for t in (u.master, optimizer.state[u.master]["exp_avg"],
                      optimizer.state[u.master]["exp_avg_sq"]):
                t.add_(1.0)
    gate.set()
    saver.close()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_background_save_writes_the_state_at_the_save(tiny_data, tmp_path):
    """The writing thread starts only after every live weight and moment has changed: what it
    writes must still be the state at the save (each rank's copy), bit for bit."""
    from tessera.checkpoint import load_tensors, read_manifest
    from tessera.checkpoint_read import read_metadata

    run_ranks(_save_then_mutate, 2, args=(tiny_data, str(tmp_path)))
    got = {}
    for run in ("blocking", "background"):
        path = step_dir(tmp_path / run, 1)
        read_manifest(path)
        got[run] = load_tensors(path, list(read_metadata(path).state_dict_metadata))
    assert got["blocking"].keys() == got["background"].keys()
    for key, value in got["blocking"].items():
        assert torch.equal(got["background"][key], value), key


def _one_process_state(data: str, root: Path) -> tuple:
    """(cfg, executor, optimizer, scheduler, loader) of a one-process run: what save and
    restore take."""
    from tessera.data.loader import BatchLoader, TokenDataset
    from tessera.optim import lr_lambda
    from tessera.parallelize import parallelize
    from tessera.step import Executor
    from tessera.topology import Topology

    cfg = _cfg(data, str(root))
    executor = Executor(parallelize(cfg, Topology.build(cfg.parallel), torch.device("cpu")))
    optimizer = executor.optimizer(cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    loader = BatchLoader(TokenDataset(data).train, 16, 8, 2, 0, 1)
    return cfg, executor, optimizer, scheduler, loader


class FakeCudaRng:
    """torch.cuda.get_rng_state / set_rng_state of one pretend GPU (this machine has none):
    a 16-byte state, as CUDA's Philox generator keeps (seed and offset)."""

    def __init__(self) -> None:
        self.state = torch.arange(16, dtype=torch.uint8)
        self.sets: list[tuple[torch.Tensor, torch.device]] = []

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        assert torch.device(device) == torch.device("cuda", 0)
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        self.state = state.clone()
        self.sets.append((state.clone(), torch.device(device)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_rng_states_saved_and_restored_per_device(tiny_data, tmp_path, monkeypatch):
    """Each rank saves its CPU generator (``rng.rank-N``) and, when it computes on a GPU, that
    device's CUDA generator (``rng.cuda.rank-N``); resuming in the same layout restores both.

    Exercised for real here: the CPU generator's round trip through DCP, that a CPU run writes
    no CUDA entry, and that a checkpoint without one (a CPU run's, or one written before CUDA
    states were saved) still resumes on a GPU run, its CUDA generator left as it was. Not
    exercised (no GPU on this machine): torch.cuda's own get/set; the rank's device is set to
    cuda:0 and torch.cuda.get_rng_state / set_rng_state are replaced by :class:`FakeCudaRng`,
    so what is checked is which state is saved under which key and that resuming hands it back
    to the set function with the rank's device."""
    from tessera import checkpoint
    from tessera.checkpoint import load_tensors
    from tessera.checkpoint_read import read_metadata

    cfg, executor, optimizer, scheduler, loader = _one_process_state(tiny_data, tmp_path)
    args = (cfg, executor, optimizer, scheduler, loader, 0, 1)
    torch.manual_seed(123)
    cpu_state = torch.get_rng_state()
    cpu_run = checkpoint.save(tmp_path / "cpu", 1, *args)
    keys = set(read_metadata(cpu_run).state_dict_metadata)
    assert "rng.rank-00000" in keys and not any(k.startswith("rng.cuda.") for k in keys)

    fake = FakeCudaRng()
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    monkeypatch.setattr(executor.model, "device", torch.device("cuda", 0))
    gpu_run = checkpoint.save(tmp_path / "gpu", 1, *args)
    saved = load_tensors(gpu_run, ["rng.rank-00000", "rng.cuda.rank-00000"])
    assert torch.equal(saved["rng.rank-00000"], cpu_state)
    assert torch.equal(saved["rng.cuda.rank-00000"], torch.arange(16, dtype=torch.uint8))

    torch.manual_seed(999)
    fake.state = torch.zeros(16, dtype=torch.uint8)
    checkpoint.restore(gpu_run, *args[:5])
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert len(fake.sets) == 1 and fake.sets[0][1] == torch.device("cuda", 0)
    assert torch.equal(fake.state, torch.arange(16, dtype=torch.uint8))

    # No CUDA entry: the CPU state is restored, the GPU's generator is left alone.
    torch.manual_seed(999)
    checkpoint.restore(cpu_run, *args[:5])
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert len(fake.sets) == 1
