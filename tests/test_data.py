"""Data: preparation, refusal of bad files, determinism, data-parallel sharding, resumption."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tessera.data.loader import BatchLoader, DataError, TokenDataset, val_windows
from tessera.data.prepare import collect_files, prepare, stdlib_files, val_block_mask
from tessera.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # é"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = load_tokenizer(str(path))
    assert isinstance(loaded, HFTokenizer) and loaded.vocab_size == tok.get_vocab_size()
    ids = loaded.encode("def add(a, b):")
    assert len(ids) < len("def add(a, b):")  # merges learned
    # ... and a prepared set records the vocabulary and widens the dtype past bytes.
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"m{i}.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    manifest = prepare([str(src)], tmp_path / "out", loaded, val_percent=40)
    assert manifest["vocab_size"] == loaded.vocab_size and manifest["dtype"] == "uint16"


def test_bad_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(str(bad))


def test_stdlib_corpus_is_real_and_excludes_site_packages():
    files = stdlib_files()
    assert len(files) > 500
    assert not any("site-packages" in str(f) for f in files)
    assert sum(f.stat().st_size for f in files) > 10_000_000


def test_split_by_tokens_is_stable_and_never_empty(tmp_path):
    for i in range(50):
        (tmp_path / f"m{i}.py").write_text("x = 1\n")
    names = [n for n, _ in collect_files([str(tmp_path)])]
    assert names == sorted(names)  # the stream, and so the split, does not hang on listing order
    for n_tokens, percent in [(2, 50), (10, 2), (7, 99), (10**6, 2), (12345, 0.01)]:
        mask, block = val_block_mask(n_tokens, percent)
        assert 0 < mask.sum() < mask.size and block * mask.size >= n_tokens
    mask, _ = val_block_mask(10**6, 2)
    assert mask.sum() == 20 and mask[:500].sum() == 10  # 2% of blocks, spread through


def _tokens(out, split):
    ds = TokenDataset(out)
    part = getattr(ds, split)
    return np.concatenate([np.asarray(s) for s in part.shards])


@pytest.mark.parametrize("val_percent", [2.0, 50.0])
def test_one_text_file_is_split_by_tokens(tmp_path, val_percent):
    # Before: `split 'val' would be empty` (2%) and `split 'train' would be empty` (50%).
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    m = prepare([str(corpus)], tmp_path / "out", ByteTokenizer(), val_percent=val_percent)
    train, val = (sum(s["tokens"] for s in m["splits"][k]) for k in ("train", "val"))
    total = len(corpus.read_bytes()) + 2  # + the blank line that ends the document
    assert train + val == total
    assert val == pytest.approx(total * val_percent / 100, rel=0.05)


def test_jsonl_records_are_documents(tmp_path):
    # Before: a .jsonl file was trained on as raw `{"text": ...}` bytes, and a directory of
    # .jsonl files was refused with `no text files`.
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        lines = [json.dumps({"text": f"doc {i}.{j}", "id": j}) for j in range(40)]
        (src / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(src)], tmp_path / "out", ByteTokenizer(), val_percent=10)
    stream = bytes(np.concatenate([_tokens(tmp_path / "out", "train"),
                                   _tokens(tmp_path / "out", "val")]).tolist())
    assert b"{" not in stream and b'"text"' not in stream
    assert len(stream) == sum(len(f"doc {i}.{j}") + 2 for i in range(3) for j in range(40))
    # one file given directly, with another field name
    one = tmp_path / "one.jsonl"
    one.write_text("\n".join(json.dumps({"body": "b" * 30}) for _ in range(10)))
    m = prepare([str(one)], tmp_path / "out2", ByteTokenizer(), text_field="body")
    assert sum(s["tokens"] for v in m["splits"].values() for s in v) == 10 * 32
    with pytest.raises(ValueError, match=r"one.jsonl:1: no string field 'text'"):
        prepare([str(one)], tmp_path / "out3", ByteTokenizer())
    # A source that fails leaves an earlier prepared set in the same directory as it was.
    with pytest.raises(ValueError, match="no string field"):
        prepare([str(one)], tmp_path / "out2", ByteTokenizer())
    assert TokenDataset(tmp_path / "out2").verify().manifest == m


def test_parquet_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(20)), "body": [f"row {i}" for i in range(20)]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    m = prepare([str(tmp_path / "d.parquet")], tmp_path / "out", ByteTokenizer(),
                text_field="body")
    assert sum(s["tokens"] for v in m["splits"].values() for s in v) == sum(
        len(f"row {i}") + 2 for i in range(20))
    with pytest.raises(ValueError, match=r"d.parquet: no column 'text' .*columns: id, body"):
        prepare([str(tmp_path / "d.parquet")], tmp_path / "out2", ByteTokenizer())


def test_documents_joined_by_the_tokenizers_end_of_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["hello world\n"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.eot_id == tok.token_to_id("<|endoftext|>")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": "hello world"})
                                                for _ in range(50)))
    m = prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", loaded, val_percent=10)
    ids = np.concatenate([_tokens(tmp_path / "out", "train"), _tokens(tmp_path / "out", "val")])
    assert m["eot_id"] == loaded.eot_id and (ids == loaded.eot_id).sum() == 50


def test_loader_deterministic_and_resumable(tiny_data):
    ds = TokenDataset(tiny_data)
    a = BatchLoader(ds.train, seq_len=16, micro_batch_size=4, grad_accum=2, seed=7)
    steps = [next(a) for _ in range(3)]
    b = BatchLoader(ds.train, seq_len=16, micro_batch_size=4, grad_accum=2, seed=7)
    b.load_state_dict({"step": 2, "seed": 7})
    for (x1, y1), (x2, y2) in zip(steps[2], next(b), strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert a.state_dict() == {"step": 3, "seed": 7}
    x, y = steps[0][0]
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # targets are shifted inputs
    c = BatchLoader(ds.train, seq_len=16, micro_batch_size=4, grad_accum=2, seed=8)
    assert not torch.equal(next(c)[0][0], steps[0][0][0])
    with pytest.raises(ValueError, match="seed"):
        c.load_state_dict({"step": 0, "seed": 7})


def test_dp_shards_partition_the_single_process_batch(tiny_data):
    ds = TokenDataset(tiny_data)
    single = BatchLoader(ds.train, 16, micro_batch_size=2, grad_accum=8, seed=1).batch(5)
    whole = torch.cat([x for x, _ in single])  # (16, 16)
    shards = [BatchLoader(ds.train, 16, micro_batch_size=2, grad_accum=2, dp_rank=r, dp_size=4,
                          seed=1).batch(5) for r in range(4)]
    assert torch.equal(torch.cat([x for shard in shards for x, _ in shard]), whole)


def test_cp_ranks_hold_zigzag_chunks_of_the_same_windows(tiny_data):
    """Each cp rank of a dp rank takes that dp rank's windows and keeps chunks r and 2·cp−1−r
    (of 2·cp) of inputs and targets; together the cp ranks hold every token once."""
    from tessera.parallel.context_parallel import unshard_sequence

    ds = TokenDataset(tiny_data)
    whole = BatchLoader(ds.train, 16, micro_batch_size=2, grad_accum=2, dp_rank=1, dp_size=2,
                        seed=3).batch(4)
    parts = [BatchLoader(ds.train, 16, micro_batch_size=2, grad_accum=2, dp_rank=1, dp_size=2,
                         seed=3, cp_rank=r, cp_size=4).batch(4) for r in range(4)]
    for m, (x, y) in enumerate(whole):
        assert parts[0][m][0].shape == (2, 4)
        assert torch.equal(parts[1][m][0], torch.cat([x[:, 2:4], x[:, 12:14]], 1))
        assert torch.equal(unshard_sequence([p[m][0] for p in parts], 1), x)
        assert torch.equal(unshard_sequence([p[m][1] for p in parts], 1), y)
    val = val_windows(ds.val, 16, 64, 2)
    val_parts = [val_windows(ds.val, 16, 64, 2, cp_rank=r, cp_size=2) for r in range(2)]
    assert torch.equal(unshard_sequence([p[0][0] for p in val_parts], 1), val[0][0])


def test_val_windows_cover_and_shard(tiny_data):
    ds = TokenDataset(tiny_data)
    one = val_windows(ds.val, 16, 256, batch_size=4)
    two = [val_windows(ds.val, 16, 256, batch_size=4, dp_rank=r, dp_size=2) for r in range(2)]
    n = sum(x.shape[0] for x, _ in one)
    assert n * 16 >= 256 and n == sum(x.shape[0] for b in two for x, _ in b)
    with pytest.raises(DataError, match="val split"):
        val_windows(ds.val, 16, 10**9, batch_size=4)


def _copy(tiny_data, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(tiny_data, dst)
    return dst


def test_missing_directory_and_manifest(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nowhere'}: data directory not found"):
        TokenDataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="manifest missing"):
        TokenDataset(tmp_path / "empty")


def test_truncated_shard_refused_with_path(tiny_data, tmp_path):
    d = _copy(tiny_data, tmp_path)
    shard = d / "train_000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataError, match=f"{shard}: .* bytes, manifest says"):
        TokenDataset(d)


def _flip_first_byte(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_altered_shard_refused_with_path(tiny_data, tmp_path):
    d = _copy(tiny_data, tmp_path)
    shard = d / "val_000.bin"
    _flip_first_byte(shard)
    ds = TokenDataset(d)  # sizes are right: the checksum is checked on first read
    with pytest.raises(DataError, match=f"{shard}: checksum mismatch"):
        val_windows(ds.val, 16, 64, 4)
    with pytest.raises(DataError, match=f"{shard}: checksum mismatch"):
        TokenDataset(d).verify()
    from tessera.data.cli import is_prepared  # `data prepare --if-missing` hashes everything

    assert is_prepared(tiny_data) and not is_prepared(str(d))


def test_a_rank_hashes_only_the_shards_it_reads(tmp_path, monkeypatch):
    """Every start opens the data; a rank hashes a shard when it first reads from it, not the
    whole corpus: a corrupt shard it never reads costs it nothing, one it reads is refused
    with its path before any of its tokens is used."""
    import tessera.data.loader as loader

    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}.txt").write_text(f"file {i} " * 100)
    prepare([str(src)], tmp_path / "out", ByteTokenizer(), val_percent=10, shard_tokens=1000)
    hashed = []
    monkeypatch.setattr(loader, "shard_digest",
                        lambda path, real=loader.shard_digest: hashed.append(path.name)
                        or real(path))
    ds = TokenDataset(tmp_path / "out")
    assert len(ds.train.shards) >= 4 and hashed == []  # opening hashes nothing
    _flip_first_byte(tmp_path / "out" / "train_002.bin")  # a shard this rank will not read
    for start in (0, 500, 1990):  # windows in shards 0 and 1 only
        ds.train.window(start, 10)
    assert hashed == ["train_000.bin", "train_001.bin"]  # each once
    with pytest.raises(DataError, match=f"{tmp_path / 'out' / 'train_002.bin'}: checksum"):
        ds.train.window(2500, 10)
    # What the trainer's loader reads: only the shards its windows fall in.
    _flip_first_byte(tmp_path / "out" / "train_002.bin")  # repaired
    hashed.clear()
    ds = TokenDataset(tmp_path / "out")
    loader_ = BatchLoader(ds.train, 8, micro_batch_size=2, seed=0)
    touched = {int(np.searchsorted(ds.train.offsets, p, side="right")) - 1
               for s in loader_.starts(0).tolist() for p in (s, s + 8)}
    loader_.batch(0)
    assert sorted(hashed) == [f"train_{i:03d}.bin" for i in sorted(touched)]
    assert len(touched) < len(ds.train.shards)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format="other"), "not a tessera token manifest"),
    (lambda m: m.update(version=99), "version 99"),
    (lambda m: m.pop("dtype"), "field 'dtype' missing"),
    (lambda m: m["splits"].pop("val"), "split 'val' missing"),
])
def test_bad_manifest_refused(tiny_data, tmp_path, edit, match):
    d = _copy(tiny_data, tmp_path)
    manifest = json.loads((d / "manifest.json").read_text())
    edit(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=match):
        TokenDataset(d)


def test_window_across_shards(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"f{i}.txt").write_text(f"file {i} " * 40)
    prepare([str(src)], tmp_path / "out", ByteTokenizer(), val_percent=20, shard_tokens=1000)
    ds = TokenDataset(tmp_path / "out")
    assert len(ds.train.shards) > 1
    full = np.concatenate([np.asarray(s, dtype=np.int64) for s in ds.train.shards])
    assert np.array_equal(ds.train.window(990, 25), full[990:1015])


def test_missing_source_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="data source not found"):
        prepare([str(tmp_path / "nope")], tmp_path / "out", ByteTokenizer())
    assert not (tmp_path / "out").exists()


def _bpe(tmp_path, text: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text] * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    return load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_prepare_output_is_the_same_for_any_worker_count(tmp_path):
    """Tokenized by one process in one piece per file, or by 3 worker processes in tasks of
    ~300 characters (text files cut into pieces): byte-identical shards and manifests, and both
    the tokens of whole documents joined by the end-of-text token."""
    src = tmp_path / "src"
    src.mkdir()
    text = "def f(x):\n    return x  + 1\n\n\nclass A:\n    pass\n" * 40
    for i in range(3):
        (src / f"m{i}.py").write_text(text.replace("f(", f"f{i}("))
    (src / "r.jsonl").write_text("\n".join(json.dumps({"text": f"record {j}\n  indented"})
                                           for j in range(50)))
    tok = _bpe(tmp_path, text)
    one = prepare([str(src)], tmp_path / "one", tok, val_percent=10, shard_tokens=500)
    many = prepare([str(src)], tmp_path / "many", tok, val_percent=10, shard_tokens=500,
                   workers=3, chunk_chars=300)
    assert one == many and len(one["splits"]["train"]) > 2
    for entry in one["splits"]["train"] + one["splits"]["val"]:
        name = entry["file"]
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "many" / name).read_bytes()
    whole = []
    for _, path in collect_files([str(src)]):
        docs = ([json.loads(ln)["text"] for ln in path.read_text().splitlines()]
                if path.suffix == ".jsonl" else [path.read_text()])
        for doc in docs:
            whole += tok.encode(doc) + [tok.eot_id]
    stream = np.concatenate([_tokens(tmp_path / "many", "train"),
                             _tokens(tmp_path / "many", "val")])
    assert sorted(stream.tolist()) == sorted(whole) and len(stream) == len(whole)
    _, block = val_block_mask(len(whole), 10)
    assert stream[:block].tolist() == whole[:block]  # the first block is train


def test_prepare_memory_stays_bounded(tmp_path):
    """A corpus of ~160 chunks is prepared holding about one chunk's worth of Python objects:
    one task's text (its lines while they are joined: about 3x its characters with str
    overheads), the tokenizer's list of ints (8 bytes a token), its array and the concatenation
    (3 bytes a token): under 24 x chunk_chars. The whole token stream as uint8 alone would be
    ~160 x; as the tokenizer's lists, ~1400 x."""
    import tracemalloc

    src = tmp_path / "src"
    src.mkdir()
    line = "def f(x):\n    return x * 2  # a line of text\n"
    for i in range(4):
        (src / f"big{i}.txt").write_text(line * 12000)  # one document of ~550 KB each
    (src / "records.jsonl").write_text(
        "\n".join(json.dumps({"text": line * 20}) for _ in range(500)))
    chunk = 1 << 14
    tracemalloc.start()
    try:
        m = prepare([str(src)], tmp_path / "out", ByteTokenizer(), chunk_chars=chunk,
                    shard_tokens=1 << 18)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = sum(e["tokens"] for v in m["splits"].values() for e in v)
    assert total > 150 * chunk
    assert peak < 24 * chunk, f"peak {peak} bytes = {peak / chunk:.1f} x chunk_chars"
    assert not (tmp_path / "out" / "stream.tmp").exists()


def test_hugging_face_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [f"row {i}" for i in range(30)]
    datasets.Dataset.from_dict({"id": list(range(30)), "body": rows}).save_to_disk(
        str(tmp_path / "one"))
    m = prepare([str(tmp_path / "one")], tmp_path / "out", ByteTokenizer(), text_field="body")
    stream = bytes(np.concatenate([_tokens(tmp_path / "out", "train"),
                                   _tokens(tmp_path / "out", "val")]).tolist())
    assert sum(e["tokens"] for v in m["splits"].values() for e in v) == len(stream)
    assert sorted(stream) == sorted("".join(r + "\n\n" for r in rows).encode())
    # A DatasetDict: every split, in sorted order (test before train).
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["b" * 10] * 5}),
                          "test": datasets.Dataset.from_dict({"text": ["a" * 10] * 5})}
                         ).save_to_disk(str(tmp_path / "dict"))
    prepare([str(tmp_path / "dict")], tmp_path / "out2", ByteTokenizer(), val_percent=10)
    ds = TokenDataset(tmp_path / "out2")
    # 120 tokens in 120 one-token blocks, the 12 held out at 5, 15, ...: 0-4 are train.
    assert ds.train.window(0, 5).tolist() == [ord("a")] * 5
    with pytest.raises(ValueError, match=r"one: no column 'text' .*columns: id, body"):
        prepare([str(tmp_path / "one")], tmp_path / "out3", ByteTokenizer())
