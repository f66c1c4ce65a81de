"""Deterministic, resumable batches from prepared token shards, sharded by data-parallel rank.

The global batch of optimizer step k is a function of (seed, k) alone: `G = dp·accum·mbs`
window starts drawn uniformly from the train split by a generator seeded with (seed, k). Rank r
of the data-parallel group takes windows [r·accum·mbs, (r+1)·accum·mbs) and cuts them into
`accum` micro-batches. So N ranks see exactly the windows one process would see with N times
the accumulation, in the same order: the property every data-parallel parity test relies on.
The loader's whole position is the step number, saved and restored with the run.

Context parallelism: a cp rank takes the same windows as its dp rank's other cp ranks and keeps
its zig-zag chunks of each (``context_parallel.shard_sequence``: chunks r and 2·cp−1−r of 2·cp),
inputs and targets alike; the cp ranks together hold every token once.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tessera.data.prepare import FORMAT, VERSION
from tessera.errors import UserError


class DataError(UserError):
    """A prepared data directory or shard is missing, malformed or corrupt. Names the path."""


def _read_manifest(root: Path) -> dict:
    path = root / "manifest.json"
    if not root.is_dir():
        raise DataError(f"{root}: data directory not found (run `tessera data prepare` first)")
    if not path.is_file():
        raise DataError(f"{path}: manifest missing; is {root} a prepared data directory?")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a tessera token manifest")
    if manifest.get("version") != VERSION:
        raise DataError(f"{path}: version {manifest.get('version')!r}, expected {VERSION}")
    for key in ("dtype", "vocab_size", "splits"):
        if key not in manifest:
            raise DataError(f"{path}: field {key!r} missing")
    return manifest


def shard_digest(path: Path) -> str:
    """SHA-256 of a file (a data shard, a checkpoint's file), read 1 MiB at a time: a
    checkpoint is hashed while a rank holds its state, so the buffer stays small beside it
    (tests/test_checkpoint_memory.py bounds a save's extra memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class TokenSplit:
    """One split's shards, memory-mapped. Every shard's size is checked when the split opens
    (a stat: cheap); its SHA-256 the first time this process reads from it, before any of its
    tokens is used. So a rank hashes only the shards its windows touch, not the whole corpus
    at every start, and a corrupt shard is still refused with its path, never half-read."""

    def __init__(self, root: Path, entries: list[dict], dtype: np.dtype, verify: bool = True):
        self.shards: list[np.ndarray] = []
        self.paths: list[Path] = []
        self.digests: list[str] = []
        for entry in entries:
            path = root / entry["file"]
            if not path.is_file():
                raise DataError(f"{path}: shard missing")
            expected = int(entry["tokens"]) * dtype.itemsize
            if path.stat().st_size != expected:
                raise DataError(f"{path}: {path.stat().st_size} bytes, manifest says {expected}"
                                " (truncated or foreign file)")
            self.shards.append(np.memmap(path, dtype=dtype, mode="r"))
            self.paths.append(path)
            self.digests.append(entry["sha256"])
        self.verified = [not verify] * len(entries)
        """Shards whose checksum this process has checked (all True when verify=False)."""
        self.offsets = np.cumsum([0] + [s.size for s in self.shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def verify_shard(self, i: int) -> None:
        """Check shard i's SHA-256 against the manifest, once per process."""
        if self.verified[i]:
            return
        if shard_digest(self.paths[i]) != self.digests[i]:
            raise DataError(f"{self.paths[i]}: checksum mismatch (file changed since prepare)")
        self.verified[i] = True

    def verify_all(self) -> None:
        for i in range(len(self.shards)):
            self.verify_shard(i)

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split, across shard boundaries if need be."""
        out, pos = [], start
        while pos < start + length:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            self.verify_shard(i)
            local = pos - int(self.offsets[i])
            take = min(start + length - pos, self.shards[i].size - local)
            out.append(np.asarray(self.shards[i][local:local + take], dtype=np.int64))
            pos += take
        return np.concatenate(out)


class TokenDataset:
    """A prepared directory: its manifest and the train and val splits (shards checked as
    :class:`TokenSplit` says; ``verify()`` hashes them all now)."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.root = Path(path)
        self.manifest = _read_manifest(self.root)
        self.vocab_size = int(self.manifest["vocab_size"])
        self.tokenizer = self.manifest.get("tokenizer", "byte")
        try:
            dtype = np.dtype(self.manifest["dtype"])
        except TypeError as e:
            raise DataError(f"{self.root / 'manifest.json'}: bad dtype "
                            f"{self.manifest['dtype']!r}") from e
        splits = self.manifest["splits"]
        for name in ("train", "val"):
            if name not in splits:
                raise DataError(f"{self.root / 'manifest.json'}: split {name!r} missing")
        self.train = TokenSplit(self.root, splits["train"], dtype, verify)
        self.val = TokenSplit(self.root, splits["val"], dtype, verify)

    def verify(self) -> TokenDataset:
        """Hash every shard now (e.g. `data prepare --if-missing`); raises DataError."""
        self.train.verify_all()
        self.val.verify_all()
        return self


@dataclass
class BatchLoader:
    """Yields each optimizer step's micro-batches for one data-parallel rank."""

    split: TokenSplit
    seq_len: int
    micro_batch_size: int
    grad_accum: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    step: int = 0
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        if len(self.split) < self.seq_len + 2:
            raise DataError(f"train split has {len(self.split)} tokens, fewer than one window "
                            f"of seq_len+1={self.seq_len + 1}")

    @property
    def global_batch_size(self) -> int:
        return self.dp_size * self.grad_accum * self.micro_batch_size

    def starts(self, step: int) -> torch.Tensor:
        """Window starts of the whole global batch of `step` (all ranks)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, len(self.split) - self.seq_len - 1, (self.global_batch_size,),
                             generator=g)

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's `grad_accum` micro-batches of `step`: (inputs, targets), each (mbs, T)."""
        per_rank = self.grad_accum * self.micro_batch_size
        mine = self.starts(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        rows = torch.from_numpy(np.stack([self.split.window(int(s), self.seq_len + 1)
                                          for s in mine]))  # (per_rank, T+1)
        return [cp_shard((mb[:, :-1], mb[:, 1:]), self.cp_rank, self.cp_size)
                for mb in rows.split(self.micro_batch_size)]

    def __iter__(self):
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader state has seed {state['seed']}, this run uses {self.seed}")
        self.step = int(state["step"])


def cp_shard(batch: tuple[torch.Tensor, torch.Tensor], cp_rank: int, cp_size: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T) -> this cp rank's zig-zag tokens of both, (B, T/cp)."""
    if cp_size == 1:
        return batch
    from tessera.parallel.context_parallel import shard_sequence

    return tuple(shard_sequence(t, 1, cp_size, cp_rank) for t in batch)


def val_window_count(n_tokens: int, seq_len: int, dp_size: int = 1) -> int:
    """How many validation windows cover >= n_tokens targets: a multiple of dp_size, so every
    rank scores the same number."""
    n_windows = math.ceil(n_tokens / seq_len)
    return n_windows + (-n_windows) % dp_size


def val_batch_size(micro_batch_size: int) -> int:
    """Validation windows per forward pass: four micro-batches (no activations kept for a
    backward)."""
    return 4 * micro_batch_size


def val_windows(split: TokenSplit, seq_len: int, n_tokens: int, batch_size: int, dp_rank: int = 0,
                dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed non-overlapping validation windows covering >= n_tokens targets, dealt round-robin
    to data-parallel ranks and batched. Raises if the split is too small."""
    n_windows = val_window_count(n_tokens, seq_len, dp_size)
    if n_windows * seq_len + 1 > len(split):
        raise DataError(f"val split has {len(split)} tokens, fewer than the {n_tokens} asked "
                        "for validation (data.val_tokens)")
    mine = range(dp_rank, n_windows, dp_size)
    rows = torch.from_numpy(np.stack([split.window(i * seq_len, seq_len + 1) for i in mine]))
    # At most all windows in one batch (torch takes a split size only up to int64).
    batch_size = max(1, min(batch_size, len(mine)))
    return [cp_shard((b[:, :-1], b[:, 1:]), cp_rank, cp_size) for b in rows.split(batch_size)]
