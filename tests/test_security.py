"""Untrusted files are read as data, never run: every torch.load of a checkpoint or weights
file uses weights_only, and a pickle that would call a function is refused with its path (one
line, exit 2, through the commands that read it) before anything in it runs."""

from __future__ import annotations

import builtins
import hashlib
import json
import pickle
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from cli_errors import cli_error
from tessera.checkpoint import CheckpointError, read_metadata
from tessera.config import ModelConfig


class Payload:
    """Unpickling it would create `marker`: what a malicious file would do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _evil_index(path: Path, marker: Path) -> Path:
    """A plain pickle, as DCP writes its .metadata, that runs the payload when loaded."""
    path.write_bytes(pickle.dumps(Payload(marker)))
    return path


def _evil(path: Path, marker: Path) -> Path:
    torch.save({"tok_embeddings.weight": torch.zeros(2), "x": Payload(marker)}, path)
    return path


def test_the_payload_runs_without_weights_only(tmp_path):
    # The check below would prove nothing if the file were harmless.
    marker = tmp_path / "ran"
    torch.load(_evil(tmp_path / "f.pt", marker), weights_only=False)
    assert marker.exists()


def test_checkpoint_index_with_code_is_refused(tmp_path):
    # DCP's .metadata is a pickle; it is read with an unpickler that knows only DCP's index
    # classes, so a forged one is refused before its payload runs.
    marker = tmp_path / "ran"
    _evil_index(tmp_path / ".metadata", marker)
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / '.metadata'}: refused "
                                              r"\(builtins.exec is not part of a checkpoint"):
        read_metadata(tmp_path)
    assert not marker.exists()


def test_forged_checkpoint_is_refused_by_eval(tmp_path, tiny_data):
    # A forged checkpoint whose manifest matches its files: the checksums pass, the index not.
    marker, ckpt = tmp_path / "ran", tmp_path / "step-0000001"
    ckpt.mkdir()
    index = _evil_index(ckpt / ".metadata", marker)
    (ckpt / "extra.json").write_text("{}")
    files = {f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                      "bytes": f.stat().st_size} for f in (index, ckpt / "extra.json")}
    (ckpt / "meta.json").write_text(json.dumps({"format": 2, "step": 1,
                                                "model": asdict(ModelConfig()), "files": files}))
    line = cli_error(["eval", "--checkpoint", str(ckpt), "--data", tiny_data])
    assert line.startswith(f"error: checkpoint {index}: refused"), line
    assert not marker.exists()


def test_hugging_face_bin_with_code_is_refused_by_generate(tmp_path):
    from tessera.hf import hf_config

    marker = tmp_path / "ran"
    (tmp_path / "config.json").write_text(json.dumps(hf_config(ModelConfig())))
    _evil(tmp_path / "pytorch_model.bin", marker)
    line = cli_error(["generate", "--checkpoint", str(tmp_path), "--tokens", "1"])
    assert line.startswith(f"error: {tmp_path / 'pytorch_model.bin'}: refused, not plain "
                           "tensors")
    assert not marker.exists()


def test_every_torch_load_in_the_package_is_weights_only():
    src = Path(__file__).resolve().parents[1] / "src" / "tessera"
    calls = [(p, line) for p in src.rglob("*.py") for line in p.read_text().splitlines()
             if "torch.load(" in line]
    assert calls, "no torch.load found: the check would pass vacuously"
    for path, line in calls:
        assert "weights_only=True" in line, f"{path}: {line.strip()}"
