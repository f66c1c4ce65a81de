"""Where the rules live: each config field checks itself, ``tessera.layout.validate`` holds every
rule that ties fields together and runs once per process (the preflight), ConfigError sits in
a module that imports nothing from tessera."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tessera.errors
import tessera.layout
from tessera.config import ParallelConfig
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.parallelize import parallelize
from tessera.preflight import check_run
from tessera.topology import Topology


def test_errors_module_imports_nothing_from_tessera():
    tree = ast.parse(Path(tessera.errors.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.split(".")[0] == "tessera"], imported


@pytest.mark.parametrize("fields, message", [
    (dict(dp=4, ep=3), "parallel.ep=3: must divide parallel.dp=4"),
    (dict(virtual_stages=2, schedule="1f1b"),
     "parallel.virtual_stages=2: needs schedule interleaved, interleaved-lean, bfs, zb-v, "
     "dualpipev, not '1f1b'"),
])
def test_a_section_checks_its_fields_and_validate_ties_them(fields, message):
    """ParallelConfig accepts fields that are each valid; validate refuses the combination."""
    cfg = make_config("tiny", parallel=fields)
    assert cfg.parallel == ParallelConfig(**fields)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == message


def _counting_layout_checks(monkeypatch) -> list[int]:
    """Count layout.validate's runs (by its first rule, looked up at call time)."""
    calls: list[int] = []
    first_rule = tessera.layout._check_parallel
    monkeypatch.setattr(tessera.layout, "_check_parallel",
                        lambda cfg: (calls.append(1), first_rule(cfg))[1])
    return calls


def test_the_preflight_checks_the_layout_once_and_parallelize_not_again(monkeypatch, tmp_path):
    calls = _counting_layout_checks(monkeypatch)
    cfg = make_config("tiny", train=dict(out_dir=str(tmp_path / "run")),
                      data=dict(path=str(tmp_path / "none")))
    checked = check_run(cfg, 1, "cpu", data=False, memory=False)
    assert len(calls) == 1
    parallelize(checked.cfg, Topology.build(checked.cfg.parallel), torch.device("cpu"))
    assert len(calls) == 1


def test_parallelize_refuses_a_topology_that_is_not_the_config_layout():
    cfg = make_config("tiny", model=dict(n_layers=2), parallel=dict(pp=2))
    with pytest.raises(AssertionError, match="is not cfg.parallel's layout"):
        parallelize(cfg, Topology(rank=0), torch.device("cpu"))
