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
- ``extra.json``: the step, the learning-rate schedule's position, the data loader's
  position in global samples, and the gradient noise scale's moving averages
  (``noise_scale``: ``NoiseScale.state_dict``, plain numbers the same on every rank; null
  where the run did not measure it);
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
CUDA states were saved) leaves the GPU's generator as the seed made it. The noise scale's
moving averages continue in any layout that measures them (the same numbers on every rank);
where the checkpoint holds none (its run did not measure: dp 1, cp > 1, ep > 1, a parameter
server, ``train.noise_scale`` off; or it was written before they were saved) they start over,
and a run that does not measure drops them (its own checkpoints hold none).

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

This module saves and restores; the manifest, its checks and finding a run's checkpoints live
in ``tessera.checkpoint_manifest``, the readers in ``tessera.checkpoint_read``, and the names
in ``__all__`` are importable from here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from tessera.checkpoint_manifest import (
    EXTRA,
    FORMAT,
    META,
    CheckpointError,
    _identity,
    _layout,
    _sha256,
    _validation,
    complete,
    config_hash,
    find,
    global_batch,
    latest,
    other_runs,
    owner,
    prune,
    read_manifest,
    remove,
    run_id_of,
    step_dir,
    verify,
)
from tessera.checkpoint_read import (
    SafeReader,
    _PieceLoadPlanner,
    _size,
    _weight_source,
    describe,
    load_model,
    load_tensors,
)
from tessera.config import Config
from tessera.sharded_state import Piece, model_pieces


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
    noise = getattr(engine, "noise", None)
    extra = {"step": step, "samples": loader.step * loader.global_batch_size,
             "global_batch": loader.global_batch_size, "data_seed": loader.seed,
             "scheduler": {"last_epoch": scheduler.last_epoch, "lr": scheduler.get_last_lr()},
             "noise_scale": noise.state_dict() if noise is not None else None}
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


def restore(path: str | Path, cfg: Config, engine, optimizer, scheduler, loader,
            group: dist.ProcessGroup | None = None) -> int:
    """Load a verified checkpoint into this run, whatever layout wrote it; every rank of
    `group` calls (DCP's plan exchange). Returns the step to continue from. The noise scale's
    averages (an Executor's ``noise``, where this run measures) continue from the saved ones,
    or start over where the checkpoint holds none."""
    path = Path(path)
    meta = json.loads((path / META).read_text())
    extra = json.loads((path / EXTRA).read_text())
    model = _engine_model(engine)
    noise = getattr(engine, "noise", None)
    if noise is not None and extra.get("noise_scale") is not None:
        try:  # checked whole before it changes anything
            noise.load_state_dict(extra["noise_scale"])
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path / EXTRA}: {e}") from None
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



__all__ = ["CheckpointError", "AsyncSaver", "save", "restore", "verify", "read_manifest",
           "latest", "prune", "find", "complete", "owner", "run_id_of", "other_runs", "remove",
           "config_hash", "load_model", "load_tensors", "describe", "step_dir",
           "global_batch"]
