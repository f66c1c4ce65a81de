"""`tessera data prepare`: text -> memory-mappable token shards with a train/val split.

Layout of a prepared directory::

    manifest.json   {"format": "tessera-tokens", "version": 1, "tokenizer", "vocab_size",
                     "dtype", "splits": {"train": [shard, ...], "val": [...]}}
    train_000.bin   raw little-endian token ids, `dtype` (uint8 for bytes, uint16/uint32 else)
    val_000.bin

Each shard entry records its file name, token count and SHA-256, so a truncated or altered
shard is refused with its path before anything is read from it.

Sources are plain text files (`.txt`, `.md`, `.py`, ...; each file one document), JSON Lines
(`.jsonl`; each line one document, its text under `text_field`) and Parquet (`.parquet`, the
`text_field` column; needs pyarrow), given as files or directories. Documents are joined by the
tokenizer's end-of-text token, or by a blank line for bytes, which have no special tokens.

The split is by tokens, not by file, so one file is enough: the token stream is cut into equal
blocks and `val_percent` of them, spread evenly through the stream, are held out. Files are
read in sorted order, so the split depends only on the sources, not on how they are listed.
The default source is the running Python's standard library (`.py` files, not site-packages):
about 30 MB of real text that is present on every machine.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tessera.data.tokenizer import Tokenizer

FORMAT, VERSION = "tessera-tokens", 1
EOT_TEXT = "\n\n"  # bytes have no end-of-text token: documents are joined by a blank line
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", "")
RECORD_SUFFIXES = (".jsonl", ".parquet")
VAL_BLOCKS = 1000  # the stream is cut into this many blocks (fewer for tiny corpora)


def stdlib_files() -> list[Path]:
    """Every .py file of this interpreter's standard library, outside site-packages, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages",
                                                               "__pycache__"))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def collect_files(sources: list[str]) -> list[tuple[str, Path]]:
    """(relative name, path) of every text, JSON Lines or Parquet file under the sources."""
    found: list[tuple[str, Path]] = []
    for src in sources:
        if src == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            found += [(str(p.relative_to(root)), p) for p in stdlib_files()]
            continue
        path = Path(src)
        if path.is_file():
            found.append((path.name, path))
        elif path.is_dir():
            found += [(str(p.relative_to(path)), p) for p in sorted(path.rglob("*"))
                      if p.is_file() and p.suffix in TEXT_SUFFIXES + RECORD_SUFFIXES]
        else:
            raise FileNotFoundError(f"data source not found: {path}")
    if not found:
        raise FileNotFoundError(f"no text, .jsonl or .parquet files under {', '.join(sources)}")
    return found


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{lineno}: no string field {text_field!r} "
                                 f"(choose it with --text-field)")
            yield record[text_field]


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow "
                         "(pip install 'tessera[data]')") from None
    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_field!r} (choose it with --text-field); "
                         f"columns: {', '.join(table.schema_arrow.names)}")
    for batch in table.iter_batches(columns=[text_field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file: the whole file for text, one per record for .jsonl/.parquet."""
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, text_field)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, text_field)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def val_block_mask(n_tokens: int, val_percent: float) -> tuple[np.ndarray, int]:
    """(is_val per block, block size): val_percent of the blocks, evenly spread, at least one
    block in each split. Needs n_tokens >= 2."""
    n_blocks = min(VAL_BLOCKS, n_tokens)
    block = math.ceil(n_tokens / n_blocks)
    n_blocks = math.ceil(n_tokens / block)
    n_val = min(max(round(n_blocks * val_percent / 100), 1), n_blocks - 1)
    mask = np.zeros(n_blocks, dtype=bool)
    mask[((np.arange(n_val) + 0.5) * n_blocks / n_val).astype(np.int64)] = True
    return mask, block


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536
                    else np.uint32)


def _write_shard(out: Path, name: str, ids: np.ndarray) -> dict:
    data = ids.tobytes()
    (out / name).write_bytes(data)
    return {"file": name, "tokens": int(ids.size), "sha256": hashlib.sha256(data).hexdigest()}


def prepare(sources: list[str], out_dir: str | Path, tokenizer: Tokenizer,
            val_percent: float = 2.0, shard_tokens: int = 1 << 26,
            text_field: str = "text") -> dict:
    """Tokenize `sources` into `out_dir`; return the manifest. Idempotent: rewrites the dir."""
    out = Path(out_dir)
    dtype = token_dtype(tokenizer.vocab_size)
    eot = getattr(tokenizer, "eot_id", None)
    separator = np.asarray([eot] if eot is not None else tokenizer.encode(EOT_TEXT), dtype=dtype)
    arrays: list[np.ndarray] = []
    for _, path in collect_files(sources):
        for text in documents(path, text_field):
            arrays += [np.asarray(tokenizer.encode(text), dtype=dtype), separator]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    if ids.size < 2:
        raise ValueError(f"{', '.join(sources)}: {ids.size} tokens; need at least 2 to split "
                         "into train and val")
    is_val, block = val_block_mask(ids.size, val_percent)
    blocks = [ids[i * block:(i + 1) * block] for i in range(is_val.size)]
    parts = {"train": np.concatenate([b for b, v in zip(blocks, is_val, strict=True) if not v]),
             "val": np.concatenate([b for b, v in zip(blocks, is_val, strict=True) if v])}
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "sources": sources,
                "eot_id": eot, "splits": {}}
    for split, split_ids in parts.items():
        manifest["splits"][split] = [
            _write_shard(out, f"{split}_{i // shard_tokens:03d}.bin",
                         split_ids[i:i + shard_tokens])
            for i in range(0, split_ids.size, shard_tokens)]
    # The manifest goes last, through a rename: a directory without one is never half-ready.
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / "manifest.json")
    return manifest
