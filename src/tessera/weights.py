"""Whole-model weights from what a user points at, in the reference model's names: a tessera
checkpoint (its weights consolidated from every rank's shards, after its manifest's checksums)
or a Hugging Face Llama directory.
`tessera eval`, `tessera generate` and `train.init_from` read weights through here."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from tessera.config import ModelConfig


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory: a config.json with a model_type (a tessera run's
    config.json has none)."""
    config = Path(path) / "config.json"
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _checkpoint_path(path: str | Path) -> Path:
    path = Path(path)
    return path.parent if path.name == "model.pt" else path


def weights_config(path: str | Path) -> ModelConfig:
    """The model config of the weights at `path`, without reading the tensors."""
    from tessera.checkpoint import META, CheckpointError, find
    from tessera.hf import model_config_from_hf

    if is_hf_dir(path):
        config = Path(path) / "config.json"
        return model_config_from_hf(json.loads(config.read_text()), config)
    found = find(_checkpoint_path(path))
    try:
        return ModelConfig(**json.loads((found / META).read_text())["model"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {found / META}: unreadable manifest ({e})") from e


def load_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict on the CPU) of the weights at `path`."""
    from tessera.checkpoint import load_model
    from tessera.hf import HFError, load_hf

    if is_hf_dir(path):
        try:
            return load_hf(path)
        except pickle.UnpicklingError as e:  # pytorch_model.bin holds more than tensors
            raise HFError(f"{Path(path) / 'pytorch_model.bin'}: refused, not plain tensors "
                          f"({str(e).splitlines()[0]})") from e
    cfg, state, _ = load_model(_checkpoint_path(path))
    return cfg, state
