"""The local-machine terms (`tessera.planner.local.terms`) as Hardware holds them: one optional
field, flat keys in a hardware file, the catalog GPUs' values where there are none."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.errors import ConfigError
from tessera.planner.hardware import FILE_KEYS, load_hardware, replace, save_hardware
from tessera.planner.local.terms import (
    GPU_TERMS,
    LOCAL_KEYS,
    LocalTerms,
    local_terms,
    straggler_time,
    zero_unit_work,
)

SHIPPED = Path(__file__).parent.parent / "benchmarks" / "results" / "local_hardware.toml"


def test_catalog_gpus_hold_no_local_terms_and_price_them_as_gpus():
    h100 = load_hardware("H100")
    assert h100.local is None and local_terms(h100) == GPU_TERMS
    assert GPU_TERMS.dp_overlap == 1.0 and GPU_TERMS.ddp_copy_passes == 2.0
    assert straggler_time(h100, 8, 1.0) == 0.0
    assert zero_unit_work(h100, 6, 1e9) == 0.0
    # terms equal to the GPU values are no terms: the catalog entry itself
    assert replace(h100, cores=0, jitter=0.0) == h100
    assert replace(h100, local=LocalTerms()).local is None


def test_a_calibrated_file_loads_its_flat_keys_into_local_and_writes_them_back(tmp_path):
    hw = load_hardware(SHIPPED)
    assert hw.local is not None and hw.local.cores == 2 and hw.local.dp_overlap == 0.0
    assert not hasattr(hw, "cores")  # one field for them all
    # written back flat, in the file's order: the file as `tessera plan calibrate` wrote it
    # (less the keys written since, which it adds at their defaults)
    out = save_hardware(hw, tmp_path / "again.toml")
    written = [line.split(" = ")[0] for line in out.read_text().splitlines()]
    assert written == [k for k in FILE_KEYS if k in hw.to_dict()]
    assert set(LOCAL_KEYS) - {"calibrated_micro_batch"} <= {
        line.split(" = ")[0] for line in SHIPPED.read_text().splitlines()}
    assert load_hardware(out) == hw


def test_replace_sets_a_local_term_by_its_file_name_and_keeps_the_others():
    hw = load_hardware(SHIPPED)
    faster = replace(hw, jitter_rate=0.0, peak_tflops=1.0)
    assert faster.local.jitter_rate == 0.0 and faster.peak_tflops == 1.0
    assert faster.local.jitter_fixed_us == hw.local.jitter_fixed_us
    assert replace(load_hardware("H100"), cores=2).local == LocalTerms(cores=2)
    with pytest.raises(ConfigError, match="hardware.dp_overlap"):
        replace(hw, dp_overlap=1.5)
