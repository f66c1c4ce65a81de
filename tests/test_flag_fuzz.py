"""A seeded sample of benchmarks/flag_fuzz.py's random flag sets: each `tessera train ...
--dry-run`, in a forked process of its own, is accepted (exit 0, no traceback, nothing
written) or refused in one line with exit 2, within the fuzz's 30 s limit. The full run
(1,000 cases, and real launches of the accepted edge cases) is the benchmark's; its record is
benchmarks/results/flag_fuzz.json."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import flag_fuzz  # noqa: E402

SAMPLE = flag_fuzz.draw_cases(seed=50, n=24)
flag_fuzz.preload()


def test_the_draw_covers_every_kind_and_is_deterministic():
    drawn = flag_fuzz.draw_cases(seed=50, n=400)
    assert [c.argv for c in drawn] == [c.argv for c in flag_fuzz.draw_cases(seed=50, n=400)]
    kinds = Counter(k for c in drawn for k in c.kinds)
    for kind in ("ordinary", "boundary", "huge", "negative", "nonfinite", "wrong-type",
                 "unknown", "conflicting"):
        assert kinds[kind] >= 5, kinds
    # Every option of `tessera train` is drawn: a new flag is fuzzed without editing the fuzz.
    flags = {a for c in drawn for a in c.argv if a.startswith("--")}
    assert {opt[0] for opt in flag_fuzz._options().values()} <= flags


@pytest.mark.parametrize("index", range(len(SAMPLE)))
def test_a_random_flag_set_is_accepted_or_refused_in_one_line(index, tiny_data):
    result = flag_fuzz.dry_run(SAMPLE[index], tiny_data)
    assert result["verdict"] in ("accepted", "refused"), result


def test_the_judge_calls_a_traceback_a_hang_and_two_error_lines_findings():
    judge = flag_fuzz.judge
    assert judge([], 2, "error: x=1: bad\n", False, 0.1)["verdict"] == "refused"
    assert judge([], 2, "warning: w\nerror: x=1: bad\n", False, 0.1)["verdict"] == "refused"
    assert judge([], 0, "warning: w\n", False, 0.1)["verdict"] == "accepted"
    assert judge([], 1, "Traceback (most recent call last):\n", False, 1)["verdict"] == (
        "traceback")
    assert judge([], None, "", True, 30)["verdict"] == "hang"
    assert judge([], 2, "error: a\nerror: b\n", False, 0.1)["verdict"] == "bad-exit"
    assert judge([], 1, "error: a\n", False, 0.1)["verdict"] == "bad-exit"
    assert judge([], 0, "", False, 0.1, started=True)["verdict"] == "wrote-output"
