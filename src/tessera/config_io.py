"""Reading a configuration: presets, TOML and YAML files and ``section.field=value``
overrides, merged and each value checked against its field's type (and an integer against
int64 and :data:`tessera.config.LIMITS`) before the config's dataclasses check its range.

Every failure raises :class:`~tessera.errors.ConfigError` naming the field (or ``--config``,
``--set``), the value and the rule.
"""

from __future__ import annotations

import math
import re
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from tessera.config import (
    INT64_MAX,
    LIMITS,
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from tessera.errors import ConfigError, Verbatim, check_path
from tessera.errors import require as _require
from tessera.presets import PRESETS

_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
             "data": DataConfig}


def _merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in extra.items():
        _require(section in _SECTIONS, "config", section,
                 f"unknown section; known: {', '.join(_SECTIONS)}")
        _require(isinstance(values, dict), section, values, "must be a table of fields")
        out.setdefault(section, {}).update(values)
    return out


def _build(raw: dict[str, dict[str, Any]]) -> Config:
    sections = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name, {})
        known = {f.name: f.type for f in fields(cls)}
        for key in values:
            _require(key in known, f"{name}.{key}", values[key],
                     f"unknown field; known: {', '.join(sorted(known))}")
        sections[name] = cls(**{k: _coerce(f"{name}.{k}", str(known[k]), v)
                                for k, v in values.items()})
    return Config(**sections)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.field=value``; the value is read as YAML (numbers, bools, null, strings)."""
    key, sep, value = text.partition("=")
    section, dot, name = key.strip().partition(".")
    _require(bool(sep) and bool(dot) and bool(name), "--set", text,
             "must look like section.field=value, e.g. train.lr=1e-3")
    value = value.strip()
    if _INTEGER.fullmatch(value) and len(value) > sys.get_int_max_str_digits():
        # int() refuses it (and float() would read it as infinity): no field takes one.
        raise ConfigError(key.strip(), Verbatim(f"<integer of {len(value.lstrip('+-'))} digits>"),
                          f"must fit in a 64-bit integer (|value| <= {INT64_MAX})")
    for convert in (int, float):
        try:
            return section, name, convert(value)
        except ValueError:
            continue
    try:
        return section, name, yaml.safe_load(value) if value else ""
    except (yaml.YAMLError, ValueError) as e:
        # ValueError: PyYAML's int() of a number beyond Python's digit limit, inside a list
        raise ConfigError("--set", text, "the value cannot be read as a number, true/false, "
                          f"null or a string ({str(e).splitlines()[0]})") from None


_INTEGER = re.compile(r"[-+]?[0-9]+")


def _bounded(name: str, value: int) -> int:
    """An integer field's value within int64 and the field's LIMITS."""
    _require(-INT64_MAX - 1 <= value <= INT64_MAX, name, value,
             f"must fit in a 64-bit integer (|value| <= {INT64_MAX})")
    limit = LIMITS.get(name)
    if limit is not None:
        _require(abs(value) <= limit[0], name, value, f"must be at most {limit[0]:,}: {limit[1]}")
    return value


def _coerce(name: str, annotation: str, value: Any) -> Any:
    """Check a value read from a file or --set against the field's annotation (and an integer
    against int64 and the field's LIMITS)."""
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None and "None" in kinds:
        return None
    if "bool" in kinds:
        _require(isinstance(value, bool), name, value, "must be true or false")
        return value
    if "int" in kinds and isinstance(value, int) and not isinstance(value, bool):
        return _bounded(name, value)
    if "float" in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        # No field means anything by infinity or NaN (TOML's inf/nan, YAML's .inf/.nan,
        # --set x=1e400): a NaN would also slip through every range check (nan >= 0 is False,
        # but so is nan < 0). An integer beyond a float's range is as infinite.
        _require(not isinstance(value, int) or abs(value) <= sys.float_info.max, name, value,
                 "must be finite")
        _require(math.isfinite(value), name, value, "must be finite")
        return float(value)
    if "str" in kinds and isinstance(value, str):
        return value
    _require(False, name, value, f"must be of type {annotation}")


class _YAMLLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading floats as YAML 1.2 does: `1e-3` is a float (YAML 1.1, and
    so plain PyYAML, wants a dot, `1.0e-3`, and reads `1e-3` as a string)."""


_YAMLLoader.yaml_implicit_resolvers = {k: list(v) for k, v in
                                       yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """YAML as config files mean it: `lr: 1e-3` is a float."""
    return yaml.load(text, Loader=_YAMLLoader)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or YAML config file into nested dicts (an optional top-level `preset` key)."""
    check_path("--config", str(path))
    path = Path(path)
    _require(path.is_file(), "--config", str(path),
             "is a directory, not a file" if path.is_dir() else "file does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("--config", str(path), f"is not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    try:
        raw = (tomllib.loads(text) if path.suffix == ".toml"
               else load_yaml(text))
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError("--config", str(path), f"cannot be parsed: {e}".splitlines()[0]) from e
    except ValueError as e:
        # Both parsers call int(), which refuses over 4300 digits; PyYAML builds dates too.
        limit = sys.get_int_max_str_digits()
        raise ConfigError("--config", str(path), f"holds an integer of more than {limit} digits;"
                          f" every field must fit in a 64-bit integer (|value| <= {INT64_MAX})"
                          if f"({limit} digits)" in str(e)
                          else f"cannot be parsed: {e}".splitlines()[0]) from e
    _require(isinstance(raw, dict), "--config", str(path), "must hold a table of sections")
    return raw


def make_config(preset: str | None = "tiny", file: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = (),
                **sections: dict[str, Any]) -> Config:
    """Preset, then config file, then keyword sections, then `section.field=value` overrides.

    The file's own `preset` key applies only where `preset` is None: an explicit argument (the
    command line's --preset) is the more specific choice."""
    raw: dict[str, Any] = {}
    file_raw = load_file(file) if file else {}
    file_preset = file_raw.pop("preset", None)
    preset = preset if preset is not None else file_preset
    if preset is not None:
        _require(isinstance(preset, str) and preset in PRESETS, "preset", preset,
                 f"unknown; known: {', '.join(PRESETS)}")
        raw = _merge(raw, PRESETS[preset])
    raw = _merge(raw, file_raw)
    raw = _merge(raw, {k: v for k, v in sections.items() if v})
    for text in overrides:
        section, name, value = parse_override(text)
        raw = _merge(raw, {section: {name: value}})
    return _build(raw)
