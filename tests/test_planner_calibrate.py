"""`tessera plan calibrate`: measures this machine (two gloo ranks for α and β) and writes a
hardware file the planner then reads. The accuracy of its predictions is checked by
benchmarks/bench_planner_local.py (timings do not belong in tests)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tessera.cli import app
from tessera.planner.cost import Layout, Workload
from tessera.planner.hardware import load_hardware
from tessera.planner.models import load_model
from tessera.planner.search import estimate


@pytest.mark.multiprocess
def test_calibrate_writes_a_usable_hardware_file(tmp_path):
    out = tmp_path / "local.toml"
    r = CliRunner().invoke(app, ["plan", "calibrate", "--model", "tiny", "--micro-batch", "4",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    hw = load_hardware(str(out))
    # Sanity ranges, not timings: a CPU core does between 1 GFLOP/s and 10 TFLOP/s, loopback
    # moves between 10 MB/s and 1 TB/s, and a message costs between 0 and 50 ms.
    assert 1e-3 < hw.peak_tflops < 10 and hw.matmul_efficiency == 1.0
    assert 1e-3 < hw.attention_tflops < 10
    assert 0.01 < hw.intra_node_gbs < 1000 and 0 <= hw.intra_node_alpha_us < 50_000
    assert hw.memory_gb > 0.1 and hw.memory_bw_gbs > 0.1 and hw.op_overhead_us > 0
    assert hw.gpus_per_node >= 1 and hw.dp_overlap == 0.0
    assert 0.01 < hw.gather_efficiency <= 1.0
    w = Workload(model=load_model("tiny"), hardware=hw, gpus=2, global_batch=16, seq_len=32,
                 precision="fp32")
    for layout in (Layout(dp=2, micro_batch=8), Layout(tp=2, micro_batch=8),
                   Layout(pp=2, micro_batch=4)):
        assert estimate(w, layout).step_time > 0


def test_calibrate_bad_input_exits_2(tmp_path):
    r = CliRunner().invoke(app, ["plan", "calibrate", "--model", "nope", "--out",
                                 str(tmp_path / "x.toml")])
    assert r.exit_code == 2 and "unknown model" in r.output
