"""The statistics the local-truth benchmark judges the planner with (benchmarks/dp_cost.py):
how often a right prediction would pass a row, given the spread the row's pairs show."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from dp_cost import median_interval, repeat_chance  # noqa: E402


def _pairs(n: int, centre: float, spread: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(centre, spread) for _ in range(n)]


def test_a_tight_row_is_passed_by_a_right_prediction_almost_always():
    # 200 pairs of σ 5% around 10: the median's own σ is ~0.4%, so a repeat's median is
    # within ±15% of this one's every time.
    assert repeat_chance(_pairs(200, 10.0, 0.5), None, 0.15) == 1.0


def test_a_wide_row_is_a_coin_toss_even_for_a_right_prediction():
    # 20 pairs of σ 100% around 10: the median's σ is ~28% of the centre (√(π/2)·σ/√n),
    # so a repeat's median falls within ±15% of this one's well under half the time (a
    # normal of that σ would give ~0.4; this draw gives 0.18), but not never.
    chance = repeat_chance(_pairs(20, 10.0, 10.0), None, 0.15)
    assert 0.05 < chance < 0.5


def test_builds_that_shift_together_make_a_repeat_less_certain():
    # 12 builds of 6 pairs each; every build's pairs share an offset of σ 35% (where the
    # models' tensors landed), so the row holds 12 independent draws, not 72: resampling whole
    # builds must find the repeat's median far less certain than resampling pairs does.
    rng = random.Random(1)
    values, build = [], []
    for k in range(12):
        offset = rng.gauss(0.0, 3.5)
        values += [10.0 + offset + rng.gauss(0.0, 0.3) for _ in range(6)]
        build += [k] * 6
    by_builds = repeat_chance(values, build, 0.15)
    by_pairs = repeat_chance(values, None, 0.15)
    assert by_builds < by_pairs - 0.1
    # and it agrees with the 95% interval the table prints (the same resamples): a row whose
    # chance is under 0.95 cannot have its whole interval within ±15%
    centre, lo, hi = median_interval(values, build)
    assert by_builds < 0.95
    assert not (centre / 1.15 <= lo and hi <= centre / 0.85)
