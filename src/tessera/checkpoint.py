"""Layout-free checkpoints: every rank saves what it holds, a run resumes in any layout.

A checkpoint is a directory ``<checkpoint_dir>/step-0000100/`` written with
``torch.distributed.checkpoint`` (DCP):

- ``__<rank>_0.distcp`` … one file per rank with the boxes of global tensors that rank holds
  and writes, in reference names (``tessera.sharded_state``: ``model.<ref>``, ``master.<ref>``
  under bf16, ``optim.exp_avg.<ref>``, ``optim.exp_avg_sq.<ref>``, ``optim.step.<ref>``,
  ``buffer.<ref>`` (MoE routing biases), ``rng.rank-NNNNN`` (the CPU generator) and, on a
  GPU, ``rng.cuda.rank-NNNNN`` (the rank's CUDA generator)); experts are boxes of the
  stacked (E, ...) tensors, whatever the ep degree; a replicated box is written once;
- ``.metadata``: DCP's index, every tensor's global shape and which file holds which box;
- ``extra.json``: the step, the learning-rate schedule's position, and the data loader's
  position in global samples;
- ``meta.json``, written last: format, step, the model, the layout that wrote it, the batch
  shape and data seed, the run id and the config's hash (:func:`config_hash`), what the run's
  validation scored (data set, targets, windows per pass; ``tessera eval``'s defaults), and the
  SHA-256 and size of every other file.

A checkpoint directory belongs to one run (``tessera.run_dir``): pruning keeps the newest
checkpoints of the run that saves, and :func:`latest` (``--resume latest``, a restart,
``tessera eval``/``generate``/``export-hf``/``checkpoint`` on a directory) takes the newest of
one run, never another run's; ``run_dir.check_run_dir`` refuses to start a run where another
run's checkpoints are.

Saving gathers nothing: each rank hands DCP views of its own tensors (parameters, TP shards,
pipeline chunks, ZeRO flat ranges cut into boxes), so a save's extra memory on a rank is at
most the size of one of its boxes. Writing goes to ``step-0000100.tmp``, renamed into place
after every rank has written and rank 0 has written the manifest: a crash never leaves a
directory that looks complete.

Resuming works from any layout to any other (dp, tp, pp, v, cp, ep, ZeRO stage, the parameter
server, fp32 or bf16 training): each rank asks DCP for the boxes it holds in the new layout and
DCP reads the overlapping saved boxes (reshard on load; no rank ever holds the whole model).
The master weights come from ``master.<ref>`` when the checkpoint has them, else from
``model.<ref>`` (an fp32 run's weights are its masters). The loader continues at the same
global sample, so a changed dp degree sees exactly the next unseen samples; a changed global
batch (dp × micro-batches × micro-batch size) is refused, since the sampler draws each step's
windows as one batch of that size. RNG states (CPU, and CUDA on a GPU) are per rank and belong
to a layout: they are restored only into the same layout and world size; otherwise every rank
keeps the state its seed gave it (training itself draws no random numbers: no dropout, the
sampler has its own generator). A checkpoint without a CUDA state (written on CPUs, or before
CUDA states were saved) leaves the GPU's generator as the seed made it.

Loading checks everything before anything is read into the run, on every rank and before any
collective (:func:`verify`): the manifest parses, the model, batches and data seed match this
run's (a mismatch names the field and both values), and every file has the recorded size and
checksum. A bad checkpoint is refused with its path (:class:`CheckpointError`), never half-read.
DCP's ``.metadata`` is a pickle: it is read, after its checksum matched the manifest, by an
unpickler that knows only the index's own classes (:class:`SafeReader`), so a forged
checkpoint cannot run code; the tensors DCP loads with ``weights_only``.

Offline (no process group): :func:`load_model` consolidates the weights in reference names
(``tessera eval``, ``generate``, ``export-hf``, ``train.init_from``), :func:`describe` lists a
checkpoint (``tessera checkpoint inspect``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tessera.config import Config, ModelConfig
from tessera.data.loader import val_batch_size, val_window_count
from tessera.errors import UserError
from tessera.sharded_state import Piece, model_pieces

FORMAT = 2
META = "meta.json"
EXTRA = "extra.json"


class CheckpointError(UserError):
    """A checkpoint is missing, malformed, corrupt or from another model. Names the path."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


# ---------------------------------------------------------------------------------------------
# DCP planners over pieces


def _size(t: tuple[int, ...]) -> torch.Size:
    return torch.Size(t)


class _PieceSavePlanner(DefaultSavePlanner):
    """Writes the pieces this rank writes (``Piece.write``), each a box of a global tensor;
    DCP's global plan then checks that the boxes of every tensor tile it exactly."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces: dict[tuple[str, tuple[int, ...]], Piece] = {}
        for p in pieces:
            if p.write:
                if (p.key, p.offsets) in self.pieces:
                    raise ValueError(f"two pieces of {p.key} at {p.offsets} on one rank")
                self.pieces[(p.key, p.offsets)] = p

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False):
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(p.key, _size(p.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(_size(p.offsets), _size(p.sizes)),
                               properties=TensorProperties.create_from_tensor(p.tensor),
                               size=_size(p.global_shape)))
                 for p in self.pieces.values()]
        self.plan = SavePlan(items)
        return self.plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return all_plans  # every box has exactly one writer already

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Reads into each requested piece, ``(checkpoint key, piece)``, the overlapping parts of
    the saved boxes of that key (DCP's resharding)."""

    def __init__(self, path: Path, requests: list[tuple[str, Piece]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path, self.requests = path, requests

    def set_up_planner(self, state_dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        saved = self.metadata.state_dict_metadata
        for i, (key, piece) in enumerate(self.requests):
            md = saved.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {self.path}: holds no tensor {key}")
            if tuple(md.size) != piece.global_shape:
                raise CheckpointError(f"checkpoint {self.path}: {key} has shape "
                                      f"{tuple(md.size)}, this run's is {piece.global_shape}")
            chunk = ChunkStorageMetadata(_size(piece.offsets), _size(piece.sizes))
            found = create_read_items_for_chunk_list(key, md, [chunk])
            if sum(math.prod(r.lengths) for r in found) != math.prod(piece.sizes):
                raise CheckpointError(f"checkpoint {self.path}: {key} does not cover the box "
                                      f"at {piece.offsets} of size {piece.sizes}")
            # The destination names the request, so equal boxes of one key never collide.
            items += [dataclasses.replace(r, dest_index=MetadataIndex(str(i), r.dest_index.offset))
                      for r in found]
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self.requests[int(read_item.dest_index.fqn)][1]
        return narrow_tensor_by_index(piece.tensor, read_item.dest_offsets, read_item.lengths)


# ---------------------------------------------------------------------------------------------
# Saving


def _rng_pieces(rank: int, device: torch.device, saved: set[str] | None = None) -> list[Piece]:
    """This rank's generator states: the CPU generator's (``rng.rank-N``) and, when the rank
    computes on a GPU, that device's CUDA generator's (``rng.cuda.rank-N``). `saved`: the keys
    of the checkpoint being restored; a state it lacks (a CPU run's CUDA state, or one from
    before CUDA states were saved) is left as this run's seed made it."""
    cpu = torch.get_rng_state()
    pieces = [Piece(f"rng.rank-{rank:05d}", tuple(cpu.shape), (0,), cpu, True,
                    on_load=torch.set_rng_state)]
    if device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device)
        pieces.append(Piece(f"rng.cuda.rank-{rank:05d}", tuple(cuda.shape), (0,), cuda, True,
                            on_load=functools.partial(torch.cuda.set_rng_state, device=device)))
    return [p for p in pieces if saved is None or p.key in saved]


def _engine_model(engine):
    """The ParallelModel behind an Executor (or the model itself)."""
    return getattr(engine, "model", engine)


class AsyncSaver:
    """Writes checkpoints in a background thread (``train.async_checkpoint``).

    `group`: a process group of every rank that nothing else uses (the thread's collectives
    must not interleave with training's on another group); on the CPU a gloo group. One save
    is in flight at a time: :func:`save` waits for the previous one, and :meth:`close` for the
    last."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-checkpoint")
        self._pending: Future[Path] | None = None

    def wait(self) -> Path | None:
        """Block until the save in flight is complete (renamed into place); its directory."""
        if self._pending is None:
            return None
        done, self._pending = self._pending, None
        return done.result()

    def close(self) -> Path | None:
        path = self.wait()
        self._pool.shutdown()
        return path


def save(root: str | Path, step: int, cfg: Config, engine, optimizer, scheduler, loader,
         rank: int, world: int, group: dist.ProcessGroup | None = None, *, keep: int = 0,
         saver: AsyncSaver | None = None, run_id: str | None = None) -> Path:
    """Write this step's checkpoint of run `run_id` (recorded in the manifest with the
    config's hash; None records none) and prune all but that run's newest `keep` (0 keeps
    all); every rank of `group` (None: the default group; the saver's group with a saver) calls.
    Collectives: DCP's plan gather and result gather, and two barriers. With `saver`, each
    rank copies the boxes it writes, and the writing, manifest, rename and pruning go on in the
    saver's thread after this returns. Returns the final directory (complete on return
    without a saver)."""
    if saver is not None:
        saver.wait()
        group = saver.group
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world, group)
    model = _engine_model(engine)
    pieces = [p for p in (*model_pieces(model, optimizer), *_rng_pieces(rank, model.device))
              if p.write]
    extra = {"step": step, "samples": loader.step * loader.global_batch_size,
             "global_batch": loader.global_batch_size, "data_seed": loader.seed,
             "scheduler": {"last_epoch": scheduler.last_epoch, "lr": scheduler.get_last_lr()}}
    meta = {"format": FORMAT, "step": step, **_identity(cfg), "layout": _layout(cfg, world),
            "validation": _validation(cfg)}
    meta |= {"run_id": run_id, "config_hash": config_hash(cfg)}
    if saver is None:
        return _write(tmp, final, pieces, extra, meta, rank, world, group, keep)
    # The copies the thread writes: training changes the live tensors from the next step on.
    staged = [dataclasses.replace(p, tensor=p.tensor.clone()) for p in pieces]
    saver._pending = saver._pool.submit(_write, tmp, final, staged, extra, meta, rank, world,
                                        group, keep)
    return final


def _write(tmp: Path, final: Path, pieces: list[Piece], extra: dict[str, Any],
           meta: dict[str, Any], rank: int, world: int, group: dist.ProcessGroup | None,
           keep: int) -> Path:
    """Every rank writes its pieces into `tmp`; rank 0 then adds the extra state and the
    manifest, renames `tmp` to `final` and prunes the run's older ones; a barrier ends it on
    every rank."""
    dcp.save({}, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1),
             planner=_PieceSavePlanner(pieces), process_group=group)
    if rank == 0:  # DCP returned: every rank's file and DCP's index are written
        (tmp / EXTRA).write_text(json.dumps(extra, indent=1))
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        meta = {**meta, "files": {name: {"sha256": _sha256(tmp / name),
                                         "bytes": (tmp / name).stat().st_size}
                                  for name in files}}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune(final.parent, keep, meta.get("run_id"))
    _barrier(world, group)
    return final


def _barrier(world: int, group: dist.ProcessGroup | None) -> None:
    if world > 1:
        dist.barrier(group=group)


# ---------------------------------------------------------------------------------------------
# Checking


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


# ---------------------------------------------------------------------------------------------
# Resuming


def _weight_source(key: str, saved: set[str], run_mixed: bool) -> str | None:
    """The checkpoint key a requested weight piece reads, or None to skip it: fp32 weights
    (an fp32 run's parameters, a bf16 run's masters) come from ``master.*`` when the checkpoint
    has masters, else from ``model.*``; a bf16 run's bf16 weights are re-published from its
    masters after loading."""
    prefix, _, ref = key.partition(".")
    if prefix == "model" and run_mixed:
        return None
    if prefix in ("model", "master"):
        return f"master.{ref}" if f"master.{ref}" in saved else f"model.{ref}"
    return key


def restore(path: str | Path, cfg: Config, engine, optimizer, scheduler, loader,
            group: dist.ProcessGroup | None = None) -> int:
    """Load a verified checkpoint into this run, whatever layout wrote it; every rank of
    `group` calls (DCP's plan exchange). Returns the step to continue from."""
    path = Path(path)
    meta = json.loads((path / META).read_text())
    extra = json.loads((path / EXTRA).read_text())
    model = _engine_model(engine)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    reader = SafeReader(path)
    saved = set(reader.read_metadata().state_dict_metadata)
    mixed = cfg.train.precision != "fp32"
    requests = []
    for piece in model_pieces(model, optimizer):
        source = _weight_source(piece.key, saved, mixed)
        if source is not None:
            requests.append((source, piece))
    same_layout = meta.get("layout") == _layout(cfg, world)
    if same_layout:
        requests += [(p.key, p) for p in _rng_pieces(rank, model.device, saved)]
    dcp.load({}, storage_reader=reader, planner=_PieceLoadPlanner(path, requests),
             process_group=group)
    for _, piece in requests:
        if piece.on_load is not None:
            piece.on_load(piece.tensor)
    _restore_schedule(extra["scheduler"]["last_epoch"], optimizer, scheduler)
    _restore_loader(path, extra, loader)
    engine.after_parameters_loaded()
    return int(extra["step"])


def _restore_schedule(last_epoch: int, optimizer, scheduler) -> None:
    """The LR schedule at `last_epoch`, for however many param groups this layout's optimizer
    has: each group's lr from the closed form, as LambdaLR.step() sets it."""
    scheduler.last_epoch = last_epoch
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs,
                                   scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _restore_loader(path: Path, extra: dict[str, Any], loader) -> None:
    samples, batch = int(extra["samples"]), loader.global_batch_size
    if int(extra["global_batch"]) != batch or samples % batch:
        raise CheckpointError(f"checkpoint {path}: loader at sample {samples} of global "
                              f"batches of {extra['global_batch']}, this run's are {batch}")
    loader.load_state_dict({"step": samples // batch, "seed": int(extra["data_seed"])})


# ---------------------------------------------------------------------------------------------
# Reading DCP's index as data: its .metadata is a pickle, and a checksum in a manifest that came
# with the same files proves nothing about who wrote them.

def _path_modules() -> tuple[str, ...]:
    """Where pickle finds ``PosixPath``: ``pathlib``, and ``pathlib._local`` on Pythons that
    have it (3.13 defines the class there and pickles it under that name; 3.14 keeps the name
    so that such files still load)."""
    try:
        import pathlib._local  # noqa: F401
    except ImportError:
        return ("pathlib",)
    return ("pathlib", "pathlib._local")


_METADATA_CLASSES: dict[str, frozenset[str]] = {
    # The index itself and its parts. BytesStorageMetadata (non-tensor entries) is absent:
    # tessera writes only tensors.
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    # Where each box lies in the .distcp files.
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # TensorProperties.layout: torch.strided is pickled as _get_layout("torch.strided"), a
    # lookup of the name in torch's layouts.
    "torch.serialization": frozenset({"_get_layout"}),
    # Global shapes, and the dtypes tessera's tensors have: fp32 weights, masters, optimizer
    # moments and MoE biases, bf16 weights (train.precision=bf16), int64 optimizer steps and
    # uint8 generator states. Named one by one: deciding by ``getattr(torch, name)`` would run
    # torch's module __getattr__ on a name the file chose (it imports lazy submodules and calls
    # the replacements of deprecated names) before anything is refused.
    "torch": frozenset({"Size", "float32", "bfloat16", "int64", "uint8"}),
    # StorageMeta.checkpoint_id: the directory DCP wrote to.
    **{module: frozenset({"PosixPath"}) for module in _path_modules()},
}
"""Every (module, name) the ``.metadata`` of tessera's checkpoints refers to (fp32 and bf16,
dense and MoE, tied embeddings, any layout), and nothing else; tests/test_security.py checks
that each is needed and that every other name of these modules is refused."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names in :data:`_METADATA_CLASSES`; any other, such as a function a
    forged file would call while loading, is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if name not in _METADATA_CLASSES.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with its index read by :class:`_MetadataUnpickler` (the tensors
    themselves DCP already reads with ``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise CheckpointError(f"checkpoint {path}: unreadable ({e})") from e
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as e:  # any malformed pickle, built only from the admitted names
            raise CheckpointError(f"checkpoint {path}: refused ({e})") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {path}: refused (not a checkpoint index)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------------------------------
# Offline: consolidated weights, inspection


def read_metadata(path: str | Path) -> Metadata:
    """DCP's index of a checkpoint (call after :func:`read_manifest` checked the files)."""
    return SafeReader(Path(path)).read_metadata()


def load_tensors(path: str | Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Whole tensors by checkpoint key, read from every rank's boxes in one process (no process
    group). The files must have been checked (:func:`read_manifest`)."""
    path = Path(path)
    metadata = read_metadata(path)
    out: dict[str, torch.Tensor] = {}
    requests = []
    for key in keys:
        md = metadata.state_dict_metadata[key]
        out[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        requests.append((key, Piece(key, tuple(md.size), (0,) * len(md.size), out[key], False)))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        dcp.load({}, storage_reader=SafeReader(path),
                 planner=_PieceLoadPlanner(path, requests), no_dist=True)
    return out


def load_model(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """The full model a checkpoint holds, in the reference model's names and fp32 (its masters
    when it trained in bf16), its config, and the checkpoint directory; `path` as :func:`find`
    reads it. Every file's size and SHA-256 are checked against the manifest first."""
    path = find(path)
    meta = read_manifest(path)
    try:
        model_cfg = ModelConfig(**meta["model"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path / META}: unreadable manifest ({e})") from e
    saved = set(read_metadata(path).state_dict_metadata)
    refs = sorted(k.removeprefix("model.") for k in saved if k.startswith("model."))
    keys = [_weight_source(f"model.{ref}", saved, False) for ref in refs]
    buffers = sorted(k for k in saved if k.startswith("buffer."))  # MoE routing biases
    tensors = load_tensors(path, keys + buffers)
    state = {ref: tensors[key].float() for ref, key in zip(refs, keys, strict=True)}
    state |= {key.removeprefix("buffer."): tensors[key].float() for key in buffers}
    if model_cfg.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    from tessera.model import Transformer

    with torch.device("meta"):
        order = list(Transformer(model_cfg).state_dict())
    missing = [k for k in order if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path}: no weights for {', '.join(missing)}")
    return model_cfg, {k: state[k] for k in order}, path


def describe(path: str | Path) -> list[str]:
    """`tessera checkpoint inspect`: the run id and config hash, step, layout, model, and every
    tensor with its global shape, dtype, number of saved boxes and bytes; files checked
    first."""
    path = find(path)
    meta = read_manifest(path)
    extra = json.loads((path / EXTRA).read_text())
    metadata = read_metadata(path)
    layout = meta.get("layout", {})
    run_id = meta.get("run_id") or "none (written before run ids)"
    lines = [f"checkpoint {path}",
             f"run {run_id}, config hash {meta.get('config_hash') or 'none'}",
             f"step {meta['step']}, {extra['samples']} samples seen (global batch "
             f"{extra['global_batch']}), lr {extra['scheduler']['lr'][0]:.3g}",
             "written by: " + " ".join(f"{k}={v}" for k, v in layout.items()),
             "model: " + " ".join(f"{k}={v}" for k, v in meta["model"].items()),
             f"files: {len(meta['files'])}, "
             f"{sum(f['bytes'] for f in meta['files'].values()):,} bytes"]
    totals: dict[str, int] = {}
    rows = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            continue
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        group = key.split(".")[0] if not key.startswith("optim.") else ".".join(
            key.split(".")[:2])
        totals[group] = totals.get(group, 0) + nbytes
        dtype = str(md.properties.dtype).removeprefix("torch.")
        rows.append(f"  {key:<48} {str(tuple(md.size)):<14} {dtype:<8} "
                    f"{len(md.chunks):>3} boxes {nbytes:>10,} B")
    lines.append("totals: " + ", ".join(f"{k} {v:,} B" for k, v in sorted(totals.items())))
    lines.append("tensors (global shape, dtype, boxes saved, bytes):")
    return lines + rows


__all__ = ["CheckpointError", "AsyncSaver", "save", "restore", "verify", "read_manifest",
           "latest", "prune", "find", "complete", "owner", "run_id_of", "other_runs", "remove",
           "config_hash", "load_model", "load_tensors", "describe", "step_dir",
           "global_batch"]
