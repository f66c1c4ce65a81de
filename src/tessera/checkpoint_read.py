"""Reading a checkpoint's tensors: DCP's index through an unpickler that knows only the
index's own classes (:class:`SafeReader`), the load planner that reads saved boxes into any
requested box (resharding), and offline, without a process group, the consolidated model
(:func:`load_model`) and a listing (:func:`describe`)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tessera.checkpoint_manifest import EXTRA, META, CheckpointError, find, read_manifest
from tessera.config import ModelConfig
from tessera.noise_scale import NoiseScale
from tessera.sharded_state import Piece


def _size(t: tuple[int, ...]) -> torch.Size:
    return torch.Size(t)


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


def noise_scale_line(path: Path, extra: dict[str, Any]) -> str:
    """One line on the gradient noise scale's moving averages in `extra` (extra.json of
    checkpoint `path`): B_simple as training computes it from them
    (``tessera.noise_scale.NoiseScale.estimate``, bias-corrected), or why there is none."""
    if "noise_scale" not in extra:
        return "noise scale: not saved (the checkpoint predates the saved moving averages)"
    if extra["noise_scale"] is None:
        return "noise scale: not measured"
    noise = NoiseScale()
    try:
        noise.load_state_dict(extra["noise_scale"])
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path / EXTRA}: {e}") from None
    if noise.steps == 0:
        return "noise scale: no step measured yet"
    g_sq, trace, scale = noise.estimate()
    steps = f"{noise.steps} measured step{'s' if noise.steps != 1 else ''}"
    if scale is None:
        return (f"noise scale: B_simple undefined after {steps} (the |G|^2 average, "
                f"{g_sq:.4g}, is not positive)")
    return (f"noise scale: B_simple ≈ {scale:.4g} sequences after {steps} (averages |G|^2 "
            f"{g_sq:.4g}, tr(Σ) {trace:.4g}, decay {noise.decay:g})")


def describe(path: str | Path) -> list[str]:
    """`tessera checkpoint inspect`: the run id and config hash, step, layout, model, the
    gradient noise scale's saved averages (:func:`noise_scale_line`), and every tensor with its
    global shape, dtype, number of saved boxes and bytes; files checked first."""
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
             noise_scale_line(path, extra),
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
