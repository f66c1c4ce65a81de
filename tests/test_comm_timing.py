"""The data-parallel wrappers' collective timestamps (tessera.parallel.comm_timing): recorded,
ordered, and summed into the step's measured exposed communication. Orderings only, no
timings: the durations depend on the machine's load."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from tessera.config_io import make_config
from tessera.step import build_executor
from tessera.testing import run_ranks
from tessera.topology import Topology

SEQ = 16


def _cfg(**parallel) -> object:
    return make_config(
        None, model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ),
        parallel=dict(dp=2, **parallel), train=dict(micro_batch_size=2, steps=2),
        data=dict(seq_len=SEQ))


def _logs_rank() -> dict[str, dict]:
    """Two steps of DDP (small buckets) and of ZeRO-3 on two ranks; the second step's log."""
    out = {}
    for name, parallel in (("ddp", dict(bucket_mb=0.01)), ("zero3", dict(zero_stage=3))):
        cfg = _cfg(**parallel)
        engine = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            tokens = torch.randint(0, 256, (2, SEQ + 1), generator=g)
            engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
        wrapper = engine.model.wrappers[0]
        out[name] = dict(events=list(wrapper.comm_log.events),
                         exposed=wrapper.comm_log.exposed(),
                         step_exposed=engine.last_comm_wait_s,
                         n_buckets=len(getattr(wrapper, "buckets", ())),
                         units=[u.name for u in getattr(wrapper, "units", ())])
    return out


@pytest.fixture(scope="module")
def logs() -> dict[str, dict]:
    return run_ranks(_logs_rank, 2)[0]


@pytest.mark.multiprocess
def test_ddp_buckets_launch_during_backward_and_are_waited_for(logs):
    run = logs["ddp"]
    events = run["events"]
    (end,) = [e.start for e in events if e.what == "backward_end"]
    launches = [e for e in events if e.what == "launch"]
    waits = [e for e in events if e.what == "wait"]
    assert run["n_buckets"] > 2
    assert [e.name for e in launches] == [f"bucket{i}" for i in range(run["n_buckets"])]
    # Every bucket's all-reduce starts inside backward (overlap), each wait after it ended.
    assert all(e.start < end for e in launches)
    assert [e.name for e in waits] == [e.name for e in launches]
    assert all(end <= e.start <= e.end for e in waits)
    assert run["exposed"] >= 0 and run["exposed"] == pytest.approx(run["step_exposed"])


@pytest.mark.multiprocess
def test_zero3_gathers_and_reductions_are_timestamped_in_order(logs):
    run = logs["zero3"]
    events = run["events"]
    (end,) = [e.start for e in events if e.what == "backward_end"]
    assert all(a.start <= b.start for a, b in pairwise(events))  # appended in time order
    for unit in run["units"]:
        gathers = [e.start for e in events if e.what == "gather" and e.name == unit]
        reduces = [e.start for e in events if e.what == "reduce" and e.name == unit]
        assert gathers, f"{unit}: never gathered"
        assert len(reduces) == 1 and reduces[0] <= end, f"{unit}: reduced {len(reduces)}x"
        # a wait on a unit's handle comes after something was started for that unit
        for w in (e for e in events if e.what == "wait" and e.name == unit):
            assert min(gathers) <= w.start <= w.end
    assert run["exposed"] >= 0 and run["exposed"] == pytest.approx(run["step_exposed"])
