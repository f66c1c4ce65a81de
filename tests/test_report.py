"""The training summary says when the host was loaded: the planner's predicted step time
prices an idle host, so beside a loaded one's measured step it reads low."""

from __future__ import annotations

import pytest
import torch

from tessera import report
from tessera.config_io import make_config
from tessera.report import host_load_note, summary_lines


def _summary(monkeypatch, load: tuple[float, int], world: int = 1) -> list[str]:
    monkeypatch.setattr(report, "planner_prediction", lambda *a: (0.004, "the test's"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return summary_lines(make_config("tiny"), world, torch.device("cpu"), 0.01, 1.0, 1.0, None,
                         None, [], load=load)


def test_summary_notes_a_loaded_host_below_the_prediction(monkeypatch):
    lines = _summary(monkeypatch, (7.25, 2))
    at = next(i for i, ln in enumerate(lines) if ln.startswith("step time"))
    assert "planner predicted 4 ms (0.40x; the test's)" in lines[at]
    assert lines[at + 1] == ("            host loaded (load average 7.25 on 2 cores, the run's "
                             "own threads 1): the prediction assumes an idle host")


@pytest.mark.parametrize("load", [(1.0, 2), (0.3, 16)])
def test_summary_says_nothing_of_an_idle_host(monkeypatch, load):
    # The run's own thread is the whole load: nothing to note.
    assert not any("host loaded" in ln for ln in _summary(monkeypatch, load))


def test_what_counts_as_loaded():
    # Others' threads (the load beyond the run's own): fewer than one is never loaded.
    assert host_load_note(2.9, 16, 2) is None
    # Others hold half the cores or more.
    assert host_load_note(10.0, 16, 2) is not None  # 8 of 16
    assert host_load_note(9.0, 16, 2) is None  # 7 of 16, and 9 threads fit 16 cores
    # Or the run and the others together want more cores than there are.
    assert host_load_note(17.5, 16, 16) is not None
    assert host_load_note(15.0, 16, 13) is None
    # The run's own threads are not others' load.
    assert host_load_note(4.0, 2, 4) is None
    assert host_load_note(5.0, 2, 4) is not None


def test_planner_workload_carries_every_field_of_the_run():
    """The summary prices the run's own layout and workload: every Layout field, and every
    Workload field a Config sets, comes from the run. Each is given a value other than the
    planner's default here, so a field the conversion drops reads as its default and fails."""
    import dataclasses

    from tessera.planner.workload import Layout, Workload

    parallel = dict(dp=2, tp=2, pp=2, cp=2, virtual_stages=2, microbatch_group=4,
                    zero_stage=1, recompute="selective", schedule="interleaved",
                    sequence_parallel=True, dp_mode="ps", cp_method="ulysses", cp_ulysses=4)
    cfg = make_config("demo", parallel=dict(parallel, stage_layout="1*4", bucket_mb=50.0,
                                            scatter_gather=False),
                      train=dict(micro_batch_size=2, grad_accum=4, precision="fp32",
                                 compile=True, loss_chunk_tokens=32))
    w, layout = report.planner_workload(cfg, 16, "H100")
    assert layout == Layout(**parallel, micro_batch=2, stage_layout=(1, 1, 1, 1))
    unset = [f.name for f in dataclasses.fields(Layout) if getattr(layout, f.name) == f.default]
    assert unset == []  # a Layout field added later is set here too
    carried = dict(gpus=16, global_batch=2 * 2 * 4, seq_len=cfg.data.seq_len, precision="fp32",
                   scatter_gather=False, bucket_mb=50.0, kernels="compiled",
                   loss_chunk_tokens=32)
    assert {name: getattr(w, name) for name in carried} == carried
    defaults = {f.name: f.default for f in dataclasses.fields(Workload)}
    assert [name for name in carried if carried[name] == defaults[name]] == []
