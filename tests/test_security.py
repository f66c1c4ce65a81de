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
from tessera.checkpoint import CheckpointError
from tessera.checkpoint_read import read_metadata
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


# ---------------------------------------------------------------------------------------------
# The index's allow-list: exactly what tessera's checkpoints need


def _call_by_global(module: str, name: str) -> bytes:
    """Protocol 2: GLOBAL 'module name', then call it with no arguments (REDUCE)."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R."


def _call_by_stack_global(module: str, name: str) -> bytes:
    """Protocol 4: the two names as strings on the stack, STACK_GLOBAL, then REDUCE."""
    def text(s: str) -> bytes:
        raw = s.encode()
        return b"X" + len(raw).to_bytes(4, "little") + raw

    return b"\x80\x04" + text(module) + text(name) + b"\x93)R."


def _offered_names(module_name: str) -> list[str]:
    """Every attribute of the module but the admitted ones; for torch also the names its module
    __getattr__ answers (lazy submodules, deprecated functions), which dir() does not list."""
    import importlib

    from tessera.checkpoint_read import _METADATA_CLASSES

    module = importlib.import_module(module_name)
    names = set(dir(module))
    if module is torch:
        names |= set(getattr(torch, "_lazy_modules", ())) | set(
            getattr(torch, "_deprecated_attrs", {}))
    return sorted(names - _METADATA_CLASSES[module_name])


class _Spy:
    """Stands in for a module attribute: records a lookup's call, and any call of its result."""

    def __init__(self, calls: list[str], name: str):
        self.calls, self.name = calls, name

    def __call__(self, *args, **kwargs):
        self.calls.append(self.name)
        return self


def test_every_other_name_of_an_admitted_module_is_refused(tmp_path):
    import importlib
    import io

    from tessera.checkpoint_read import _METADATA_CLASSES, _MetadataUnpickler

    index = tmp_path / ".metadata"
    offered, calls = 0, []
    for module_name in _METADATA_CLASSES:
        module = importlib.import_module(module_name)
        for name in _offered_names(module_name):
            for form in (_call_by_global, _call_by_stack_global):
                data = form(module_name, name)
                index.write_bytes(data)
                with pytest.raises(CheckpointError) as refused:
                    read_metadata(tmp_path)
                assert str(refused.value) == (
                    f"checkpoint {index}: refused ({module_name}.{name} is not part of a "
                    "checkpoint index)")
                # Nothing ran: with the name bound to a spy, the spy is never looked up (a
                # lookup would hand it to REDUCE, which would call it).
                missing = object()
                old = module.__dict__.get(name, missing)
                setattr(module, name, _Spy(calls, f"{module_name}.{name}"))
                try:
                    with pytest.raises(pickle.UnpicklingError):
                        _MetadataUnpickler(io.BytesIO(data)).load()
                finally:
                    if old is missing:
                        delattr(module, name)
                    else:
                        setattr(module, name, old)
                offered += 1
    assert not calls, calls
    assert offered > 2 * 1000, offered  # torch alone has over a thousand names


def test_the_spy_would_see_an_admitted_name_run(tmp_path):
    # The check above proves something: an admitted name bound to a spy is looked up and called.
    import io

    from tessera.checkpoint_read import _MetadataUnpickler

    calls: list[str] = []
    module = torch.serialization
    old = module._get_layout
    module._get_layout = _Spy(calls, "torch.serialization._get_layout")
    try:
        for form in (_call_by_global, _call_by_stack_global):
            _MetadataUnpickler(io.BytesIO(form("torch.serialization", "_get_layout"))).load()
    finally:
        module._get_layout = old
    assert calls == ["torch.serialization._get_layout"] * 2


def _save_tiny(data: str, out: Path, *overrides: str) -> Path:
    from tessera.config_io import make_config
    from tessera.trainer import run

    cfg = make_config("tiny", overrides=[
        f"data.path={data}", "data.seq_len=16", "data.val_tokens=256", "train.steps=1",
        "train.checkpoint_interval=1", "train.sample_tokens=0", "train.eval_interval=0",
        f"train.out_dir={out}", *overrides])
    run(cfg, progress=False)
    return out / "checkpoints" / "step-0000001"


def test_every_admitted_name_is_needed(tiny_data, tmp_path):
    # The names the indexes of real checkpoints ask for, fp32 and bf16 (bf16 weights beside
    # fp32 masters): together exactly the allow-list. (MoE, tied embeddings and multi-rank
    # layouts ask for the same names.)
    from tessera.checkpoint import load_model
    from tessera.checkpoint_read import _METADATA_CLASSES, _MetadataUnpickler

    asked: set[tuple[str, str]] = set()

    class Recording(_MetadataUnpickler):
        def find_class(self, module, name):
            asked.add((module, name))
            return super().find_class(module, name)

    for precision in ("fp32", "bf16"):
        ckpt = _save_tiny(tiny_data, tmp_path / precision, f"train.precision={precision}")
        with (ckpt / ".metadata").open("rb") as f:
            Recording(f).load()
        assert load_model(ckpt)[1]  # and it loads through the allow-list
    # PosixPath is admitted under each name a Python pickles it by (pathlib, or pathlib._local
    # on 3.13); a checkpoint names one of them.
    paths = {(m, n) for m, names in _METADATA_CLASSES.items() if m.startswith("pathlib")
             for n in names}
    admitted = {(m, n) for m, names in _METADATA_CLASSES.items() for n in names}
    assert asked <= admitted
    assert admitted - asked <= paths and len(asked & paths) == 1, admitted - asked
