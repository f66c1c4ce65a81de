"""A checkpoint's manifest and directory: ``meta.json`` (format, step, model, layout, batch,
run id, config hash, every file's size and SHA-256), checking a checkpoint before anything is
read (:func:`verify`), and finding, listing and pruning the checkpoints of a run
(:func:`find`, :func:`latest`, :func:`prune`). ``tessera.checkpoint`` saves and restores;
``tessera.checkpoint_read`` reads a checkpoint's tensors offline."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tessera.config import Config
from tessera.data.loader import shard_digest as _sha256
from tessera.data.loader import val_batch_size, val_window_count
from tessera.errors import UserError

FORMAT = 2
META = "meta.json"
EXTRA = "extra.json"


class CheckpointError(UserError):
    """A checkpoint is missing, malformed, corrupt or from another model. Names the path."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "dp_mode", "schedule",
                 "virtual_stages")
"""The parallel fields that decide what each rank holds: recorded in the manifest (shown by
``tessera checkpoint inspect``; RNG states are restored only when they and the world size are
unchanged). A resumed run may change any of them."""


def global_batch(cfg: Config) -> int:
    """Sequences per optimizer step over all data-parallel ranks."""
    return cfg.parallel.dp * cfg.train.grad_accum * cfg.train.micro_batch_size


def _identity(cfg: Config) -> dict[str, Any]:
    """What must be equal to resume: the model, and what the loader's position means."""
    return {"model": asdict(cfg.model), "global_batch": global_batch(cfg),
            "seq_len": cfg.data.seq_len, "data_seed": cfg.data.seed}


def _validation(cfg: Config) -> dict[str, Any]:
    """What the trainer's validation scored (``trainer.evaluate``): the data set's val split,
    in windows of ``seq_len``, this many targets, this many windows per forward pass; ``tessera
    eval`` scores the same by default."""
    windows = val_window_count(cfg.data.val_tokens, cfg.data.seq_len, cfg.parallel.dp)
    return {"data": os.path.abspath(cfg.data.path), "tokens": windows * cfg.data.seq_len,
            "batch_size": val_batch_size(cfg.train.micro_batch_size)}


def _layout(cfg: Config, world: int) -> dict[str, Any]:
    return {"world_size": world, "precision": cfg.train.precision,
            **{k: getattr(cfg.parallel, k) for k in LAYOUT_FIELDS}}


CONFIG_HASH_EXCLUDED = ("out_dir", "checkpoint_dir", "resume", "overwrite")
"""The train fields left out of :func:`config_hash`: where a run writes and what it continues
from, not what it trains."""


def config_hash(cfg: Config) -> str:
    """16 hex digits of the SHA-256 of the resolved config (every section and field, as
    ``tessera config`` prints them, but the train fields in :data:`CONFIG_HASH_EXCLUDED`),
    serialized as JSON with sorted keys: equal configs give equal hashes."""
    fields = cfg.to_dict()
    fields["train"] = {k: v for k, v in fields["train"].items() if k not in CONFIG_HASH_EXCLUDED}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root` (directories with a manifest), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / META).is_file())


def run_id_of(path: str | Path) -> str | None:
    """The run id in the manifest of the checkpoint at `path`; None for one written before
    run ids (or no readable manifest there: :func:`read_manifest` says what is wrong)."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return None
    run_id = meta.get("run_id") if isinstance(meta, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def owner(root: str | Path) -> str | None:
    """The run the checkpoint directory `root` belongs to: the run id of its newest checkpoint
    that has one (None: no checkpoint there has a run id)."""
    for path in reversed(complete(root)):
        if (run_id := run_id_of(path)) is not None:
            return run_id
    return None


def latest(root: str | Path, run_id: str | None = None) -> Path | None:
    """The newest complete checkpoint under `root` of run `run_id`, or None. Without
    `run_id`, of the run the directory belongs to (:func:`owner`), or where no checkpoint has
    a run id (all written before run ids), the newest of all."""
    done = complete(root)
    run_id = run_id or owner(root)
    if run_id is not None:
        done = [p for p in done if run_id_of(p) == run_id]
    return done[-1] if done else None


def other_runs(root: str | Path, run_id: str | None, resuming: bool) -> list[Path]:
    """The complete checkpoints under `root` that are not run `run_id`'s: those of another run
    id, all of them for a new run (`run_id` None), and those without one (written before run
    ids) unless this run resumes a checkpoint."""
    return [p for p in complete(root)
            if run_id is None or run_id_of(p) not in (run_id, *((None,) if resuming else ()))]


def remove(paths: list[Path]) -> None:
    """Delete these checkpoint directories (``--overwrite``: another run's)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def prune(root: str | Path, keep: int, run_id: str | None) -> None:
    """Delete all but the newest `keep` complete checkpoints of run `run_id` under `root` (0
    keeps all; other runs' are never touched), and any unfinished ``.tmp`` directory."""
    root = Path(root)
    for tmp in root.glob("step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    if keep <= 0:
        return
    done = [p for p in complete(root) if run_id_of(p) == run_id]
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)



def _mismatch(path: Path, field: str, saved: Any, ours: Any) -> CheckpointError:
    rule = ("the global batch (dp x grad_accum x micro_batch_size) fixes which windows each "
            "step samples; keep it, in any layout" if field == "global_batch" else
            "resuming needs the same model and data order (train.init_from starts another "
            "model from its weights)")
    return CheckpointError(f"checkpoint {path}: {field}={saved!r} there, {ours!r} in this run: "
                           f"{rule}")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, checked for format; every file's size and
    checksum verified. Raises CheckpointError naming the path."""
    path = Path(path)
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {path}: no {META} (not a checkpoint, or its writing "
                              "did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {meta_path}: unreadable manifest ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {meta_path}: format {meta.get('format')!r}, this "
                              f"tessera reads format {FORMAT}")
    for name in (".metadata", EXTRA):
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


def verify(path: str | Path, cfg: Config, world: int | None = None) -> dict[str, Any]:
    """Check a checkpoint completely without loading it (see the module docstring); returns
    its manifest. Any layout and world size may resume it. Raises CheckpointError."""
    path = Path(path)
    meta = read_manifest(path)
    for section, values in _identity(cfg).items():
        saved = meta.get(section)
        if isinstance(values, dict):
            for key, value in values.items():
                if not isinstance(saved, dict) or saved.get(key) != value:
                    raise _mismatch(path, f"{section}.{key}",
                                    saved.get(key) if isinstance(saved, dict) else None, value)
        elif saved != values:
            raise _mismatch(path, section, saved, values)
    step = int(meta["step"])
    if step < 0 or step > cfg.train.steps:
        raise CheckpointError(f"checkpoint {path}: step {step} is outside this run's "
                              f"train.steps={cfg.train.steps}")
    return meta


def find(path: str | Path) -> Path:
    """A checkpoint directory from what a user types: the step directory itself, a checkpoint
    root, or a run's out_dir (its checkpoints/): of a directory, the newest checkpoint of the
    run it belongs to (:func:`latest`)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    found = latest(path) or latest(path / "checkpoints")
    if found is None:
        raise CheckpointError(f"checkpoint {path}: no {META} there, nor a complete step-* "
                              "under it or under its checkpoints/")
    return found
