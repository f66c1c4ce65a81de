"""`tessera data prepare`: text files -> memory-mappable token shards with a train/val split.

Layout of a prepared directory::

    manifest.json   {"format": "tessera-tokens", "version": 1, "tokenizer", "vocab_size",
                     "dtype", "splits": {"train": [shard, ...], "val": [...]}}
    train_000.bin   raw little-endian token ids, `dtype` (uint8 for bytes, uint16/uint32 else)
    val_000.bin

Each shard entry records its file name, token count and SHA-256, so a truncated or altered
shard is refused with its path before anything is read from it.

Files are split into train and validation by a hash of their relative path, so the split does
not depend on the order files are found in, and a file is never half in each split. The
default source is the running Python's standard library (`.py` files, not site-packages): about
30 MB of real text that is present on every machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from tessera.data.tokenizer import Tokenizer

FORMAT, VERSION = "tessera-tokens", 1
EOT_TEXT = "\n\n"  # documents are joined by a blank line: bytes have no special tokens


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
    """(relative name, path) of every text file under the sources ('stdlib' or paths)."""
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
                      if p.is_file() and p.suffix in (".py", ".txt", ".md", ".rst", "")]
        else:
            raise FileNotFoundError(f"data source not found: {path}")
    if not found:
        raise FileNotFoundError(f"no text files under {', '.join(sources)}")
    return found


def is_val(name: str, val_percent: float) -> bool:
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") % 10000
    return bucket < val_percent * 100


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536
                    else np.uint32)


def _write_shard(out: Path, name: str, ids: np.ndarray) -> dict:
    data = ids.tobytes()
    (out / name).write_bytes(data)
    return {"file": name, "tokens": int(ids.size), "sha256": hashlib.sha256(data).hexdigest()}


def prepare(sources: list[str], out_dir: str | Path, tokenizer: Tokenizer,
            val_percent: float = 2.0, shard_tokens: int = 1 << 26) -> dict:
    """Tokenize `sources` into `out_dir`; return the manifest. Idempotent: rewrites the dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for name, path in collect_files(sources):
        text = path.read_text(encoding="utf-8", errors="replace") + EOT_TEXT
        split = "val" if is_val(name, val_percent) else "train"
        parts[split].append(np.asarray(tokenizer.encode(text), dtype=dtype))
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "sources": sources,
                "splits": {}}
    for split, arrays in parts.items():
        if not arrays:
            raise ValueError(f"split {split!r} would be empty: give more files or change "
                             f"val_percent={val_percent}")
        ids = np.concatenate(arrays)
        manifest["splits"][split] = [
            _write_shard(out, f"{split}_{i // shard_tokens:03d}.bin", ids[i:i + shard_tokens])
            for i in range(0, ids.size, shard_tokens)]
    # The manifest goes last, through a rename: a directory without one is never half-ready.
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / "manifest.json")
    return manifest
