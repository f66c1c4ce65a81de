"""``tessera plan --critical-batch``: the samples model, the time/cost frontier, and how the
cheapest plan follows the critical batch (McCandlish et al. 2018)."""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

import pytest
from typer.testing import CliRunner

from tessera.cli import app
from tessera.errors import UserError
from tessera.planner.critical_batch import (
    CriticalBatchPlan,
    Point,
    family,
    frontier,
    gpu_counts,
    lr_scale,
    noise_scale_from_run,
    plan_critical_batch,
    samples_needed,
)
from tessera.planner.estimate import PlanError
from tessera.planner.hardware import load_hardware
from tessera.planner.models import load_model
from tessera.planner.search import SearchSpace, enumerate_layouts, search
from tessera.planner.workload import Layout, Workload

A100 = load_hardware("A100-80GB")


@lru_cache(maxsize=1)
def small_plan() -> CriticalBatchPlan:
    """GPT-3 350M on 4, 8 and 32 A100s at 0.25 to 16 sequences per GPU (a few seconds)."""
    w = Workload(model=load_model("gpt3-350m"), hardware=A100, gpus=32, global_batch=1,
                 seq_len=2048)
    return plan_critical_batch(w, 256.0, 2.048e9, counts=[4, 8, 32],
                               betas=[0.25, 1, 4, 16])


def test_samples_needed_by_hand():
    # T = 2.048e9 tokens of 2048: S_min = 1e6 sequences; B = 512 at B_crit = 256: 3x.
    assert samples_needed(2.048e9, 2048, 512, 256) == pytest.approx(3e6)
    assert samples_needed(2.048e9, 2048, 1, 1e12) == pytest.approx(1e6)
    with pytest.raises(UserError, match="--critical-batch=0"):
        samples_needed(1e9, 2048, 8, 0)
    with pytest.raises(UserError, match="--tokens=0"):
        samples_needed(0, 2048, 8, 64)


def test_time_and_cost_of_a_point_by_hand():
    """steps = S/B, time = steps x step time, GPU-hours = N x time; and so
    cost x MFU / (1 + B/B_crit) is the same at every point (cost ∝ (1 + βN/B_crit)/U)."""
    plan = small_plan()
    p = plan.points[0]
    S = 1e6 * (1 + p.batch / 256)
    assert p.samples == pytest.approx(S)
    assert p.steps == pytest.approx(S / p.batch)
    assert p.hours == pytest.approx(S / p.batch * p.best.step_time / 3600)
    assert p.gpu_hours == pytest.approx(p.gpus * p.hours)
    invariant = [q.gpu_hours * q.mfu / (1 + q.batch / 256) for q in plan.points]
    assert max(invariant) == pytest.approx(min(invariant), rel=1e-9)
    # Time = cost / N.
    assert all(q.hours == pytest.approx(q.gpu_hours / q.gpus) for q in plan.points)
    assert next(q for q in plan.points if (q.gpus, q.batch) == (32, 8)).beta == 0.25
    # The cheapest is the least GPU-hours, the fastest the least hours (two different points
    # here, so a swapped sort key shows).
    assert plan.cheapest().gpu_hours == min(q.gpu_hours for q in plan.points)
    assert plan.fastest().hours == min(q.hours for q in plan.points)
    assert plan.fastest().hours < plan.cheapest().hours


def test_frontier_keeps_what_nothing_beats_on_both():
    plan = small_plan()
    base = plan.points[0]

    def pt(hours: float, gpu_hours: float) -> Point:
        # a point with the given time and cost: one GPU, step time scaled to match
        steps = base.samples / base.batch
        est = type(base.best).__new__(type(base.best))
        est.__dict__.update(base.best.__dict__)
        est.step_time = hours * 3600 / steps
        return Point(family="1F1B", gpus=round(gpu_hours / hours), batch=base.batch,
                     best=est, samples=base.samples)

    a, b, c, d = pt(1, 8), pt(2, 6), pt(4, 8), pt(8, 4)  # c: slower and no cheaper than b
    assert frontier([c, d, b, a]) == [a, b, d]
    # Ties: as fast as a but dearer, as cheap as b but slower: beaten, so left out.
    assert frontier([c, d, b, a, pt(1, 9), pt(3, 6)]) == [a, b, d]
    # Every point off the plan's frontier is beaten on both by one on it.
    front = plan.frontier()
    for q in plan.points:
        if q not in front:
            assert any(f.hours <= q.hours and f.gpu_hours <= q.gpu_hours for f in front)


def test_families_and_grid():
    assert family(Layout(dp=8)) == "1F1B"
    assert family(Layout(dp=2, pp=4, zero_stage=3, schedule="bfs", virtual_stages=2)) == (
        "breadth-first + ZeRO-3")
    assert family(Layout(pp=4, schedule="interleaved-lean", virtual_stages=2)) == "interleaved"
    assert family(Layout(pp=4, schedule="gpipe")) is None
    assert family(Layout(dp=8, zero_stage=2)) == "1F1B"  # only ZeRO-3 makes a family of its own
    assert family(Layout(dp=2, pp=4, zero_stage=2, schedule="interleaved", virtual_stages=2)) == (
        "interleaved")
    # One pipeline rank with two chunks is a pipeline (pp·v > 1): its schedule's family.
    assert family(Layout(pp=1, schedule="bfs", virtual_stages=2)) == "breadth-first"
    assert family(Layout(pp=4, schedule="zb-h1")) == "zero-bubble"
    assert family(Layout(dp=2, pp=4, zero_stage=2, schedule="zb-v", virtual_stages=2)) == (
        "zero-bubble")
    assert family(Layout(dp=2, pp=4, zero_stage=1, schedule="dualpipev", virtual_stages=2)) == (
        "zero-bubble")
    # tessera refuses ZeRO-3 with a split backward: no such layout joins any family.
    assert family(Layout(dp=2, pp=4, zero_stage=3, schedule="dualpipev", virtual_stages=2)) is None
    assert gpu_counts(64) == [2, 4, 8, 16, 32, 64]
    assert gpu_counts(24) == [1, 2, 4, 8, 16, 24]
    plan = small_plan()
    assert {(p.gpus, p.batch) for p in plan.points} >= {(4, 1), (32, 512), (8, 32)}
    assert all(p.best.layout.gpus == p.gpus for p in plan.points)


def test_grid_refuses_non_positive_values_before_searching():
    """A GPU count or batch per GPU of 0 is refused by name (not dropped from the grid), and
    so are 0 tokens, even on a grid without a whole batch (1 GPU x 0.5), where no point's
    samples would be computed to refuse them."""
    w = small_plan().workload
    for grid, flag in [(dict(counts=[0, 4]), "--gpu-counts="),
                       (dict(betas=[0.0, 1.0]), "--batch-per-gpu=")]:
        with pytest.raises(UserError, match=flag):
            plan_critical_batch(w, 256.0, 1e9, **({"counts": [4], "betas": [1.0]} | grid))
    with pytest.raises(UserError, match="--tokens=0"):
        plan_critical_batch(w, 256.0, 0.0, counts=[1], betas=[0.5])
    # B = β·N must be whole: 1.0001 sequences on 1 GPU is no grid point (β·N's round-off, a
    # few ulps, is what the 1e-9 allows), so nothing is left to plan.
    with pytest.raises(PlanError, match=r"1 x 1\.0001 \(GPUs x batch per GPU\): no whole batch"):
        plan_critical_batch(w, 256.0, 1e9, counts=[1], betas=[1.0001])


def test_zero_bubble_family_holds_split_backward_schedules_without_zero3():
    """The zero-bubble family is the best of zb-h1 / zb-v / dualpipev at each grid point, never
    under ZeRO-3, and no other family holds a split-backward schedule."""
    split = {"zb-h1", "zb-v", "dualpipev"}
    plan = small_plan()
    zb = [p for p in plan.points if p.family == "zero-bubble"]
    assert zb and {p.best.layout.schedule for p in zb} <= split
    assert all(p.best.layout.zero_stage < 3 and p.best.layout.pp > 1 for p in zb)
    others = [p for p in plan.points if p.family != "zero-bubble"]
    assert not {p.best.layout.schedule for p in others} & split
    assert plan.frontier("zero-bubble")
    # The point is the fastest of every pipelined split-backward layout below ZeRO-3 there.
    p = next(q for q in zb if (q.gpus, q.batch) == (8, 32))
    w = dataclasses.replace(plan.workload, gpus=p.gpus, global_batch=p.batch)
    layouts = [L for L in enumerate_layouts(w, SearchSpace())
               if L.schedule in split and L.pp > 1 and L.zero_stage < 3]
    assert {L.schedule for L in layouts} == split
    alone = search(w, SearchSpace(), top=1, layouts=layouts).best
    assert p.best.step_time == pytest.approx(alone.step_time, rel=1e-12)


def test_small_critical_batch_moves_the_cheapest_plan_to_fewer_gpus_and_smaller_batch():
    """Cost ∝ (1 + B/B_crit)/U: with B_crit = 4 sequences the samples penalty dominates, and
    the cheapest plan is the smallest batch on few GPUs (planner: 4 GPUs at batch 4); with
    B_crit = 10^6 only utilization counts, and the cheapest plan moves to a larger batch on
    more GPUs (planner: 8 GPUs at batch 128). The fastest plan moves the same way."""
    plan = small_plan()
    small, large = plan.at(4.0), plan.at(1e6)
    cs, cl = small.cheapest(), large.cheapest()
    print(f"B_crit 4: cheapest {cs.gpus} GPUs batch {cs.batch}; B_crit 1e6: {cl.gpus} GPUs "
          f"batch {cl.batch}")
    assert cs.batch < cl.batch and cs.gpus < cl.gpus
    assert small.fastest().batch < large.fastest().batch
    # Under a small B_crit, more GPUs cost more: the frontier's cost rises with N.
    front = small.frontier()
    assert [p.gpus for p in front] == sorted((p.gpus for p in front), reverse=True)


def test_lr_rule_and_warning():
    assert lr_scale("linear", 64, 256) == 4.0
    assert lr_scale("sqrt", 64, 256) == 2.0
    assert lr_scale("none", 64, 256) == 1.0
    from tessera.planner.critical_batch_report import explain

    text = explain(small_plan().at(2.0))
    assert "learning rate cannot buy them back" in text
    assert "cannot buy" not in explain(small_plan().at(1e9))


def test_from_run_reads_the_last_noise_scale(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # Steps 4-6 hold no usable noise scale: 0, a negative (tr Σ's average < 0), an overflow.
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9, "noise_scale": 40.0},
               {"step": 3, "loss": 2.8, "noise_scale": 55.5},
               {"step": 4, "loss": 2.7, "noise_scale": 0.0}, {"step": 5, "noise_scale": -3.0},
               {"step": 6, "noise_scale": float("inf")}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.json").write_text(json.dumps({"train": {"lr_scaling": "sqrt",
                                                           "reference_batch": 32}}))
    value, where, train = noise_scale_from_run(run, 2048)
    assert value == 55.5 and train["lr_scaling"] == "sqrt" and "step 3" in where
    # With the tokens beside it, the noise scale is converted to the plan's sequence length.
    records.append({"step": 7, "noise_scale": 60.0, "noise_scale_tokens": 61440.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert noise_scale_from_run(run, 2048)[0] == 30.0
    records.pop()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = CliRunner().invoke(app, ["plan", "--model", "gpt3-125m", "--gpus", "8", "--tokens",
                                 "1e9", "--from-run", str(run), "--gpu-counts", "8",
                                 "--batch-per-gpu", "1,4", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["critical_batch"] == 55.5 and out["lr_scaling"] == "sqrt"
    assert {p["lr_scale"] for p in out["points"]} == {0.5, 1.0}  # sqrt(8/32), sqrt(32/32)
    (run / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    r = CliRunner().invoke(app, ["plan", "--model", "gpt3-350m", "--gpus", "8", "--tokens",
                                 "1e9", "--from-run", str(run)])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        f"error: --from-run {run}: metrics.jsonl holds no noise_scale record (the trainer "
        f"measures it under dp >= 2); give --critical-batch B instead"]


def test_cli_critical_batch_json_and_errors():
    runner = CliRunner()
    r = runner.invoke(app, ["plan", "--model", "gpt3-125m", "--gpus", "8", "--critical-batch",
                            "64", "--tokens", "1e9", "--gpu-counts", "4,8", "--batch-per-gpu",
                            "1,4", "--json", "--explain", "--lr-scaling", "linear",
                            "--reference-batch", "16"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["critical_batch"] == 64 and "Cheapest" in out["explain"]
    assert "Zero-bubble (zb-h1, zb-v, dualpipev) is priced without ZeRO-3 only" in out["explain"]
    zb = out["frontier"]["zero-bubble"]
    assert zb and all(p["family"] == "zero-bubble" and "zero=3" not in p["layout"] for p in zb)
    rows = [p for p in out["points"] if p["global_batch"] == 32]
    assert rows and all(p["lr_scale"] == 2.0 for p in rows)
    assert {p["gpus"] for p in out["points"]} == {4, 8}
    r = runner.invoke(app, ["plan", "--model", "gpt3-125m", "--gpus", "8", "--critical-batch",
                            "64"])
    assert r.exit_code == 2 and "--tokens" in r.output
    r = runner.invoke(app, ["plan", "--model", "gpt3-125m", "--gpus", "8", "--critical-batch",
                            "64", "--tokens", "1e9", "--global-batch", "32"])
    assert r.exit_code == 2 and "--global-batch=32: does not combine" in r.output
