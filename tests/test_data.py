"""Data: preparation, refusal of bad files, determinism, data-parallel sharding, resumption."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tessera.data.loader import BatchLoader, DataError, TokenDataset, val_windows
from tessera.data.prepare import collect_files, is_val, prepare, stdlib_files
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


def test_split_by_file_hash_is_stable(tmp_path):
    for i in range(50):
        (tmp_path / f"m{i}.py").write_text("x = 1\n")
    names = [n for n, _ in collect_files([str(tmp_path)])]
    held_out = [n for n in names if is_val(n, 20)]
    assert 0 < len(held_out) < len(names)  # hash split: ~20% held out, never all or none
    reversed_names = [n for n, _ in reversed(collect_files([str(tmp_path)]))]
    assert sorted(n for n in reversed_names if is_val(n, 20)) == sorted(held_out)


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


def test_altered_shard_refused_with_path(tiny_data, tmp_path):
    d = _copy(tiny_data, tmp_path)
    shard = d / "val_000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{shard}: checksum mismatch"):
        TokenDataset(d)


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
