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
`text_field` column; needs pyarrow), given as files or directories, and a directory that
Hugging Face `datasets`' ``save_to_disk`` wrote, given as a source itself (each row of its
`text_field` column one document; needs datasets). Documents are joined by the tokenizer's
end-of-text token, or by a blank line for bytes, which have no special tokens.

The split is by tokens, not by file, so one file is enough: the token stream is cut into equal
blocks and `val_percent` of them, spread evenly through the stream, are held out. Files are
read in sorted order, so the split depends only on the sources, not on how they are listed.
The default source is the running Python's standard library (`.py` files, not site-packages):
about 30 MB of real text that is present on every machine.

Memory stays bounded whatever the corpus size: the sources are read as a stream of pieces (a
text file in pieces of about `chunk_chars` characters, a JSON Lines record or a Parquet row at a
time) grouped into tokenization tasks of about `chunk_chars` characters; each task's tokens are
appended to a scratch file `stream.tmp` as soon as they exist. Once the token count is known,
a second pass copies the stream, `chunk_chars` tokens at a time, into the train and val shards,
hashing as it writes. With `workers` > 1, tasks are tokenized by that many processes, at most
2·workers tasks in flight, and written in task order: the output is byte-identical for any
worker count. A text file is cut only before a line that starts with a non-space character,
where neither bytes nor GPT-2- or Llama-3-style pre-tokenizers join tokens, so a piecewise
text file tokenizes as the whole file would. (A tokenizer that prepends a space to every input,
SentencePiece's Metaspace, would mark each piece's start: a text file larger than
`chunk_chars` then differs there from whole-file tokenization.)
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import sysconfig
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from tessera.data.tokenizer import Tokenizer, load_tokenizer

FORMAT, VERSION = "tessera-tokens", 1
EOT_TEXT = "\n\n"  # bytes have no end-of-text token: documents are joined by a blank line
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", "")
RECORD_SUFFIXES = (".jsonl", ".parquet")
VAL_BLOCKS = 1000  # the stream is cut into this many blocks (fewer for tiny corpora)
CHUNK_CHARS = 1 << 22  # characters per tokenization task; tokens per copy into the shards
PARQUET_ROWS = 1024  # rows per Parquet batch read
STREAM = "stream.tmp"  # the whole token stream, on disk until it is split


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
        if path.is_file() or is_hf_dataset(path):
            found.append((path.name, path))
        elif path.is_dir():
            found += [(str(p.relative_to(path)), p) for p in sorted(path.rglob("*"))
                      if p.is_file() and p.suffix in TEXT_SUFFIXES + RECORD_SUFFIXES]
        else:
            raise FileNotFoundError(f"data source not found: {path}")
    if not found:
        raise FileNotFoundError(f"no text, .jsonl or .parquet files under {', '.join(sources)}")
    return found


def check_sources_hold_text(sources: list[str], text_field: str = "text") -> None:
    """Raise ValueError naming the first source that holds no text: an empty text file, a
    .jsonl, .parquet or Hugging Face dataset without a non-empty `text_field`, a directory of
    only such files. Reads each source only up to its first text."""
    for src in sources:
        if src == "stdlib":
            continue
        files = collect_files([src])
        if not any(_holds_text(path, text_field) for _, path in files):
            what = ("no file with text" if Path(src).is_dir() and not is_hf_dataset(Path(src))
                    else f"no non-empty {text_field!r}" if files[0][1].suffix in RECORD_SUFFIXES
                    or is_hf_dataset(Path(src)) else "no text")
            raise ValueError(f"{src}: empty source ({what}); nothing to tokenize")


def _holds_text(path: Path, text_field: str) -> bool:
    if path.suffix in RECORD_SUFFIXES or path.is_dir():
        return any(text for text in documents(path, text_field))
    return path.stat().st_size > 0


def is_hf_dataset(path: Path) -> bool:
    """A directory `datasets.Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk`
    (dataset_dict.json) wrote."""
    return path.is_dir() and ((path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def _hf_dataset_documents(path: Path, text_field: str) -> Iterator[str]:
    """The `text_field` column of a saved Hugging Face dataset, row by row in batches (Arrow
    files are memory-mapped, never loaded whole); a DatasetDict's splits in sorted order."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: reading a Hugging Face datasets directory needs datasets "
                         "(pip install 'tessera[datasets]')") from None
    loaded = datasets.load_from_disk(str(path))
    parts = ([loaded[name] for name in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict)
             else [loaded])
    for part in parts:
        if text_field not in part.column_names:
            raise ValueError(f"{path}: no column {text_field!r} (choose it with --text-field); "
                             f"columns: {', '.join(part.column_names)}")
        for batch in part.select_columns([text_field]).iter(batch_size=PARQUET_ROWS):
            yield from (t for t in batch[text_field] if t is not None)


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
    for batch in table.iter_batches(batch_size=PARQUET_ROWS, columns=[text_field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def _text_pieces(path: Path, chunk_chars: int) -> Iterator[str]:
    """A text file in pieces of about `chunk_chars` characters (plus at most one line), each cut
    before a line that starts with a non-space character. At least one piece, maybe empty."""
    piece: list[str] = []
    size = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if size >= chunk_chars and not line[:1].isspace():
                yield "".join(piece)
                piece, size = [], 0
            piece.append(line)
            size += len(line)
    yield "".join(piece)


def document_pieces(path: Path, text_field: str = "text",
                    chunk_chars: int = CHUNK_CHARS) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) of one file, in reading order: a text file is one document read
    in pieces, a .jsonl line or a .parquet row one document each."""
    if path.suffix in RECORD_SUFFIXES or path.is_dir():
        for text in documents(path, text_field):
            yield text, True
        return
    pieces = _text_pieces(path, chunk_chars)
    piece = next(pieces)
    for following in pieces:
        yield piece, False
        piece = following
    yield piece, True


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file: the whole file for text, one per record for .jsonl/.parquet."""
    if path.is_dir():
        yield from _hf_dataset_documents(path, text_field)
    elif path.suffix == ".jsonl":
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


def tokenization_tasks(files: list[tuple[str, Path]], text_field: str = "text",
                       chunk_chars: int = CHUNK_CHARS) -> Iterator[list[tuple[str, bool]]]:
    """The files (``collect_files``) as a stream of tasks: consecutive (text, ends a document)
    pieces of about `chunk_chars` characters in all. Lazy: one task in memory at a time."""
    task: list[tuple[str, bool]] = []
    size = 0
    for _, path in files:
        for text, end in document_pieces(path, text_field, chunk_chars):
            task.append((text, end))
            size += len(text)
            if size >= chunk_chars:
                yield task
                task, size = [], 0
    if task:
        yield task


def encode_task(tokenizer: Tokenizer, task: list[tuple[str, bool]], dtype: np.dtype,
                separator: np.ndarray) -> np.ndarray:
    """The tokens of one task: each piece's, and the separator after each document's end."""
    parts: list[np.ndarray] = []
    for text, end in task:
        parts.append(np.asarray(tokenizer.encode(text), dtype=dtype))
        if end:
            parts.append(separator)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


_WORKER: dict = {}


def _start_worker(tokenizer: str, dtype: str, separator: np.ndarray) -> None:
    _WORKER.update(tokenizer=load_tokenizer(tokenizer), dtype=np.dtype(dtype),
                   separator=separator)


def _encode_in_worker(task: list[tuple[str, bool]]) -> np.ndarray:
    return encode_task(_WORKER["tokenizer"], task, _WORKER["dtype"], _WORKER["separator"])


def encoded_stream(tasks: Iterable[list[tuple[str, bool]]], tokenizer: Tokenizer,
                   dtype: np.dtype, separator: np.ndarray, workers: int = 1
                   ) -> Iterator[np.ndarray]:
    """Each task's tokens, in task order. With workers > 1 a pool of that many processes
    (each loads the tokenizer by its name) encodes them, at most 2·workers tasks in flight."""
    if workers <= 1:
        for task in tasks:
            yield encode_task(tokenizer, task, dtype, separator)
        return
    # spawn, not fork: the parent may hold torch's or the tokenizers library's threads.
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                             initializer=_start_worker,
                             initargs=(tokenizer.name, dtype.name, separator)) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.submit(_encode_in_worker, task))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class ShardWriter:
    """Appends tokens to `{split}_NNN.bin` files of at most `shard_tokens` tokens each, hashing
    as it writes; `entries` are the manifest's records of the finished shards."""

    def __init__(self, out: Path, split: str, shard_tokens: int):
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.entries: list[dict] = []
        self._file = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._file is None:
                name = f"{self.split}_{len(self.entries):03d}.bin"
                self._file = (self.out / name).open("wb")
                self.entries.append({"file": name, "tokens": 0, "sha256": ""})
            take = ids[:self.shard_tokens - self._count]
            data = take.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take.size
            ids = ids[take.size:]
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.close()
        self.entries[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._file, self._hash, self._count = None, hashlib.sha256(), 0

    def close(self) -> list[dict]:
        if self._file is not None:
            self._finish()
        return self.entries


def split_stream(stream: Path, n_tokens: int, out: Path, dtype: np.dtype, val_percent: float,
                 shard_tokens: int, chunk_tokens: int) -> dict[str, list[dict]]:
    """Copy the token stream into train and val shards by the block mask, `chunk_tokens` at a
    time; return each split's shard entries."""
    is_val, block = val_block_mask(n_tokens, val_percent)
    writers = {split: ShardWriter(out, split, shard_tokens) for split in ("train", "val")}
    with stream.open("rb") as f:
        for i, val in enumerate(is_val):
            left = min(block, n_tokens - i * block)
            while left:
                ids = np.fromfile(f, dtype=dtype, count=min(left, chunk_tokens))
                writers["val" if val else "train"].write(ids)
                left -= ids.size
    return {split: writer.close() for split, writer in writers.items()}


def prepare(sources: list[str], out_dir: str | Path, tokenizer: Tokenizer,
            val_percent: float = 2.0, shard_tokens: int = 1 << 26,
            text_field: str = "text", workers: int = 1,
            chunk_chars: int = CHUNK_CHARS) -> dict:
    """Tokenize `sources` into `out_dir`; return the manifest. Idempotent: rewrites the dir.

    `workers`: tokenizing processes (1: this one). `chunk_chars`: characters per tokenization
    task and tokens per copy, what bounds the memory held (module docstring)."""
    if workers < 1 or chunk_chars < 1 or shard_tokens < 1:
        raise ValueError(f"workers={workers}, chunk_chars={chunk_chars}, "
                         f"shard_tokens={shard_tokens}: each must be >= 1")
    out = Path(out_dir)
    dtype = token_dtype(tokenizer.vocab_size)
    eot = getattr(tokenizer, "eot_id", None)
    separator = np.asarray([eot] if eot is not None else tokenizer.encode(EOT_TEXT), dtype=dtype)
    check_sources_hold_text(sources, text_field)  # before anything is written
    tasks = tokenization_tasks(collect_files(sources), text_field, chunk_chars)
    out.mkdir(parents=True, exist_ok=True)
    stream, n_tokens = out / STREAM, 0
    try:
        with stream.open("wb") as f:
            for ids in encoded_stream(tasks, tokenizer, dtype, separator, workers):
                f.write(ids.tobytes())
                n_tokens += ids.size
        if n_tokens < 2:
            raise ValueError(f"{', '.join(sources)}: {n_tokens} tokens; need at least 2 to "
                             "split into train and val")
        # Only now, with every source read, are an earlier set's shards overwritten; no
        # manifest meanwhile: a directory without one is never half-ready.
        (out / "manifest.json").unlink(missing_ok=True)
        splits = split_stream(stream, n_tokens, out, dtype, val_percent, shard_tokens,
                              chunk_chars)
    finally:
        stream.unlink(missing_ok=True)
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "sources": sources,
                "eot_id": eot, "splits": splits}
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / "manifest.json")
    return manifest
