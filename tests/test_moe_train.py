"""Mixture of experts through `tessera train`: the flags, refusals at start-up with the reason,
and the per-expert load in the metrics and the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from cli_errors import cli_error
from tessera.config_io import make_config
from tessera.metrics import read_metrics
from tessera.parallelize import parallelize
from tessera.report import summary_lines
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.trainer import run, train
from tessera.weights import load_weights

TINY = ["train", "--preset", "tiny", "--set", "data.seq_len=16", "--set", "data.val_tokens=512"]


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "4", "--dp", "4", "--ep", "4", "--moe-experts", "6"],
     "parallel.ep=4: must divide model.moe_experts=6"),
    (["--nproc", "2", "--dp", "2", "--moe-experts", "4", "--moe-top-k", "5"],
     "model.moe_top_k=5: must be <= model.moe_experts=4"),
    (["--nproc", "2", "--dp", "2", "--ep", "4", "--moe-experts", "4"],
     "parallel.ep=4: must divide parallel.dp=2"),
    (["--nproc", "2", "--dp", "2", "--ep", "2"],
     "parallel.ep=2: expert parallelism needs a mixture-of-experts model"),
])
def test_bad_moe_flags_are_refused_before_launch(tiny_data, flags, message):
    line = cli_error([*TINY, "--data", tiny_data, *flags])
    assert message in line, line


def _train(cfg) -> None:
    train(cfg, progress=False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_expert_load_in_metrics_and_summary(tiny_data, tmp_path):
    """Four ranks, ep 2 × pp 2 (the first stage holds no MoE layer but takes part in the
    metrics' sums), capacity 1.0, the routing bias on: every step logs tokens per expert
    (k·tokens per MoE layer in all), the dropped share and the busiest/mean ratio; the summary
    shows the run's load; the sample at the end loads the gathered weights and routing biases
    into the single-device model."""
    cfg = make_config("tiny", overrides=[f"data.path={tiny_data}", "data.seq_len=16",
                                         "data.val_tokens=512"],
                      model=dict(moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0,
                                 moe_router_bias_rate=1e-3, moe_every=2),
                      parallel=dict(dp=2, ep=2, pp=2),
                      train=dict(steps=4, micro_batch_size=2, grad_accum=2, eval_interval=0,
                                 sample_tokens=8, out_dir=str(tmp_path)))
    run_ranks(_train, 4, args=(cfg,))
    rows = [r for r in read_metrics(Path(tmp_path) / "metrics.jsonl") if r["step"] > 0]
    assert len(rows) == 4
    tokens = 2 * 4 * 16  # global batch
    for r in rows:
        assert sum(r["moe_tokens_per_expert"]) == 2 * tokens  # top-2, one MoE layer of 2
        assert 0 <= r["moe_dropped_fraction"] < 1 and r["moe_max_load_ratio"] >= 1
        assert r["moe_aux_loss"] > 0
    summary = json.loads((Path(tmp_path) / "summary.json").read_text())["moe"]
    assert summary["moe_tokens_per_expert"] == [
        sum(r["moe_tokens_per_expert"][e] for r in rows) for e in range(4)]
    lines = summary_lines(cfg, 4, torch.device("cpu"), 0.1, 1.0, 1.0, None, None, [],
                          moe=summary)
    assert any(ln.startswith("experts     E=4 top-2 capacity 1: tokens per expert")
               for ln in lines)
    assert any("ep=2" in ln for ln in lines)



def _routed_per_step(tiny_data: str, out: Path, recompute: str,
                     early_stop: bool = True) -> tuple[list, list]:
    """One process, two steps of 2 micro-batches of 2 sequences: each step's tokens per
    expert from the metrics, and the summary's. `early_stop` False: torch's checkpoint replays
    each recomputed block to its end instead of stopping after its last saved tensor."""
    cfg = make_config("tiny", overrides=[f"data.path={tiny_data}", "data.seq_len=16",
                                         "data.val_tokens=512"],
                      model=dict(moe_experts=4, moe_top_k=2, moe_every=2),
                      parallel=dict(recompute=recompute),
                      train=dict(steps=2, micro_batch_size=2, grad_accum=2, eval_interval=0,
                                 sample_tokens=0, out_dir=str(out)))
    with set_checkpoint_early_stop(early_stop):
        result = run(cfg, progress=False)
    rows = read_metrics(out / "metrics.jsonl")
    return ([r["moe_tokens_per_expert"] for r in rows if r["step"] > 0],
            result.moe["moe_tokens_per_expert"])


def test_full_recompute_counts_each_routing_once(tiny_data, tmp_path):
    """Backward under recompute=full runs every block's forward again, router included: the
    load counts only the real forward's routing, so they equal the run without recomputation
    (the same routing: recomputation runs the same kernels on the same numbers). Whether the
    replay reaches the layer's counting depends on where torch's checkpoint stops it (by
    default after the block's last saved tensor, which comes before the counting today), so
    both ways are run."""
    plain, plain_total = _routed_per_step(tiny_data, tmp_path / "none", "none")
    for early_stop in (True, False):
        full, full_total = _routed_per_step(tiny_data, tmp_path / f"full-{early_stop}", "full",
                                            early_stop)
        assert full == plain and full_total == plain_total, f"early_stop={early_stop}"
        for step in full:  # top-2 over the step's 2·2·16 tokens, one MoE layer of 2
            assert sum(step) == 2 * (2 * 2 * 16)


def test_init_from_starts_from_the_saved_routing_bias(tiny_data, tmp_path):
    """The routing bias is a buffer that training moves outside the optimizer: a run started
    from a checkpoint's weights (train.init_from) takes the saved bias with them, not zeros."""
    data = [f"data.path={tiny_data}", "data.seq_len=16", "data.val_tokens=512"]
    moe = dict(moe_experts=4, moe_top_k=2, moe_every=2, moe_router_bias_rate=1e-2)
    first = make_config("tiny", overrides=data, model=moe,
                        train=dict(steps=3, checkpoint_interval=3, eval_interval=0,
                                   sample_tokens=0, out_dir=str(tmp_path / "a")))
    run(first, progress=False)
    saved = {k: v for k, v in load_weights(tmp_path / "a")[1].items()
             if k.endswith("expert_bias")}
    assert saved and all(v.abs().sum() > 0 for v in saved.values())
    second = make_config("tiny", overrides=data, model=moe,
                         train=dict(init_from=str(tmp_path / "a")))
    model = parallelize(second, Topology.build(second.parallel), torch.device("cpu"))
    state = model.full_state_dict()
    for name, bias in saved.items():  # the same float32 values, copied
        assert torch.equal(state[name], bias), name
