"""Save a training run and resume it exactly: the same layout continues bit for bit.

A checkpoint is a directory ``<checkpoint_dir>/step-0000100/``:

- ``rank-00000.pt`` … one file per rank with what that rank alone holds: the tensors its
  optimizer steps (``engine.parameters()``: whole tensors, tensor-parallel shards, pipeline
  chunks' weights or ZeRO's fp32 master shards), the optimizer's and the learning-rate
  scheduler's state, and the data loader's position;
- ``model.pt``: the full model in the reference model's names (``engine.full_state_dict()``,
  gathered), for inference or for starting a run with another layout;
- ``meta.json``, written last: the step, the world size, the model, the layout
  (:data:`LAYOUT_FIELDS`), the batch shape and data seed, and the SHA-256 and size of every
  file.

Writing goes to ``step-0000100.tmp`` and is renamed into place after every rank has written
and rank 0 has written the manifest, so a crash never leaves a directory that looks complete.

Loading checks everything before anything is read into the run, on every rank and before any
collective: the manifest parses, the model, layout and batches match this run's (a mismatch
names the field and both values), and every rank's file has the recorded size and checksum. A bad
checkpoint is refused with its path (:class:`CheckpointError`), never half-read. Resuming with
another layout is refused; ``model.pt`` is the way to carry weights across layouts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import Config, ModelConfig

FORMAT = 1
META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, corrupt or from another layout. Names the path."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "dp_mode", "schedule",
                 "virtual_stages")
"""The parallel fields that decide what each rank holds. The others (bucket size, all-reduce
algorithm, recomputation, sequence parallelism) change how a step runs, not its state, and may
differ on resume."""


def _identity(cfg: Config) -> dict[str, Any]:
    """What must be equal to resume: the model, the layout, and what the loader's position
    means (batch shape, accumulation, data order)."""
    return {"model": asdict(cfg.model),
            "parallel": {k: getattr(cfg.parallel, k) for k in LAYOUT_FIELDS},
            "micro_batch_size": cfg.train.micro_batch_size, "grad_accum": cfg.train.grad_accum,
            "seq_len": cfg.data.seq_len, "data_seed": cfg.data.seed}


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (one with a manifest), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / META).is_file())
    return done[-1] if done else None


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints under `root` (0 keeps all), and
    any unfinished ``.tmp`` directory."""
    root = Path(root)
    for tmp in root.glob("step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    if keep <= 0:
        return
    done = sorted(p for p in root.glob("step-*") if (p / META).is_file())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save(root: str | Path, step: int, cfg: Config, engine, optimizer, scheduler, loader,
         rank: int, world: int) -> Path:
    """Write this step's checkpoint (every rank calls; collectives: one gather of the full
    model and two barriers). Returns the final directory."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    full = engine.full_state_dict()  # gathers: every rank takes part
    _barrier(world)
    state = {"format": FORMAT, "step": step, "rank": rank,
             "tensors": [t.detach().cpu().clone() for t in engine.parameters()],
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "loader": loader.state_dict()}
    torch.save(state, tmp / rank_file(rank))
    if rank == 0:
        torch.save({k: v.detach().cpu() for k, v in full.items()}, tmp / "model.pt")
    _barrier(world)
    if rank == 0:
        files = [rank_file(r) for r in range(world)] + ["model.pt"]
        meta = {"format": FORMAT, "step": step, "world_size": world, **_identity(cfg),
                "files": {name: {"sha256": _sha256(tmp / name),
                                 "bytes": (tmp / name).stat().st_size} for name in files}}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier(world)
    return final


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _mismatch(path: Path, field: str, saved: Any, ours: Any) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {field}={saved!r} there, {ours!r} in this run: "
                           "resuming needs the same model, layout and batches (model.pt "
                           "carries the weights to another layout)")


def verify(path: str | Path, cfg: Config, world: int) -> dict[str, Any]:
    """Check a checkpoint completely without loading it (see the module docstring); returns
    its manifest. Raises CheckpointError naming the path."""
    path = Path(path)
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {path}: no {META} (not a checkpoint, or its writing "
                              "did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
        files, step = meta["files"], int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {meta_path}: unreadable manifest ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {meta_path}: format {meta.get('format')!r}, this "
                              f"tessera reads format {FORMAT}")
    if meta.get("world_size") != world:
        raise _mismatch(path, "world_size", meta.get("world_size"), world)
    ours = _identity(cfg)
    for section, values in ours.items():
        saved = meta.get(section)
        if isinstance(values, dict):
            for key, value in values.items():
                if not isinstance(saved, dict) or saved.get(key) != value:
                    raise _mismatch(path, f"{section}.{key}",
                                    saved.get(key) if isinstance(saved, dict) else None, value)
        elif saved != values:
            raise _mismatch(path, section, saved, values)
    if step < 0 or step > cfg.train.steps:
        raise CheckpointError(f"checkpoint {path}: step {step} is outside this run's "
                              f"train.steps={cfg.train.steps}")
    for r in range(world):
        name = rank_file(r)
        if name not in files:
            raise CheckpointError(f"checkpoint {meta_path}: no entry for {name}")
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {f}: missing")
        if f.stat().st_size != want.get("bytes") or _sha256(f) != want.get("sha256"):
            raise CheckpointError(f"checkpoint {f}: size or SHA-256 differs from {META} "
                                  "(corrupt or partly written)")
    return meta


def find(path: str | Path) -> Path:
    """A checkpoint directory from what a user types: the step directory itself, a checkpoint
    root (its newest), or a run's out_dir (the newest under its checkpoints/)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    found = latest(path) or latest(path / "checkpoints")
    if found is None:
        raise CheckpointError(f"checkpoint {path}: no {META} there, nor a complete step-* "
                              "under it or under its checkpoints/")
    return found


def load_model(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """The full model a checkpoint holds (``model.pt``, in the reference model's names), its
    config, and the checkpoint directory; `path` as :func:`find` reads it. The file's size and
    SHA-256 are checked against the manifest first."""
    path = find(path)
    try:
        meta = json.loads((path / META).read_text())
        model_cfg = ModelConfig(**meta["model"])
        want = meta["files"]["model.pt"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path / META}: unreadable manifest ({e})") from e
    f = path / "model.pt"
    if not f.is_file() or f.stat().st_size != want.get("bytes") or _sha256(f) != want.get(
            "sha256"):
        raise CheckpointError(f"checkpoint {f}: missing, or size or SHA-256 differs from {META}")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - not plain tensors (weights_only refused it), or bad
        raise CheckpointError(f"checkpoint {f}: unreadable ({str(e).splitlines()[0]})") from e
    return model_cfg, state, path


def load(path: str | Path, rank: int) -> dict[str, Any]:
    """This rank's state from a verified checkpoint (tensors on the CPU)."""
    f = Path(path) / rank_file(rank)
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"checkpoint {f}: unreadable ({e})") from e
    if state.get("rank") != rank or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {f}: holds rank {state.get('rank')!r}, format "
                              f"{state.get('format')!r}")
    return state


def restore(state: dict[str, Any], path: str | Path, engine, optimizer, scheduler,
            loader) -> int:
    """Put a loaded rank state into the run; returns the step to continue from."""
    params = engine.parameters()
    tensors = state["tensors"]
    if len(tensors) != len(params) or any(
            (t.shape, t.dtype) != (p.shape, p.dtype) for t, p in zip(tensors, params,
                                                                     strict=True)):
        raise CheckpointError(f"checkpoint {path}: this rank's tensors do not have the shapes "
                              "and dtypes of the run's parameters")
    with torch.no_grad():
        for p, t in zip(params, tensors, strict=True):
            p.copy_(t)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    engine.after_parameters_loaded()
    return int(state["step"])
