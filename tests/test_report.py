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
