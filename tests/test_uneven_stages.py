"""Uneven pipeline stages: `parallel.stage_layout` (blocks per chunk) in the config, the layout
check, `tessera train --stage-layout`, the planner, and a 2-rank run against the single-device
model.

Llama 3 405B puts 126 layers on 16 pipeline stages with the first and the last stage one layer
short (Grattafiori et al. 2024, §3.3.2): 7, 8 x 14, 7, which pp*v dividing the layers cannot
express.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from cli_errors import cli_error
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.model import build_model, cross_entropy
from tessera.pipeline.split import first_last_fewer, parse_stage_layout
from tessera.planner.estimate import PlanError, estimate
from tessera.planner.hardware import load_hardware
from tessera.planner.models import load_model
from tessera.planner.rules import check_layout, chunk_sizes
from tessera.planner.workload import Layout, Workload, stage_layout_text
from tessera.step import build_executor
from tessera.testing import assert_close_summed, run_ranks
from tessera.topology import Topology

MBS, SEQ, VOCAB, LAYERS, M = 2, 16, 64, 5, 3
STAGES = "1,4"  # not what the cost-balanced split picks for 5 blocks on 2 stages


def uneven_config(stage_layout: str = STAGES, pp: int = 2):
    return make_config(
        "tiny",
        model=dict(vocab_size=VOCAB, d_model=32, n_layers=LAYERS, n_heads=2, n_kv_heads=1,
                   max_seq_len=32, tie_embeddings=False),
        parallel=dict(pp=pp, schedule="1f1b", stage_layout=stage_layout),
        train=dict(grad_accum=M, micro_batch_size=MBS, steps=1,
                   out_dir="/nonexistent-not-written"),
        data=dict(seq_len=SEQ))


def test_stage_layout_parses_and_names_the_rule():
    assert parse_stage_layout("7,8*14,7") == (7,) + (8,) * 14 + (7,)
    assert first_last_fewer(126, 16) == parse_stage_layout("7,8*14,7")
    assert stage_layout_text(first_last_fewer(126, 16)) == "7,8*14,7"
    validate(uneven_config(), world_size=2)
    with pytest.raises(ConfigError, match=r"parallel.stage_layout='1,3'.*add up to "
                                          r"model.n_layers=5"):
        validate(uneven_config("1,3"))
    with pytest.raises(ConfigError, match=r"gives 3 chunks; needs one per chunk, "
                                          r"pp\*virtual_stages=2"):
        validate(uneven_config("1,2,2"))
    with pytest.raises(ConfigError, match="at least one block"):
        validate(uneven_config("0,5"))
    with pytest.raises(ConfigError, match="comma-separated block counts"):
        validate(uneven_config("one,four"))


def test_train_refuses_a_bad_stage_layout_before_launch(tiny_data):
    line = cli_error(["train", "--preset", "tiny", "--data", tiny_data, "--pp", "2",
                      "--stage-layout", "1,2"])
    assert "parallel.stage_layout='1,2'" in line and "model.n_layers=2" in line


def test_planner_expresses_llama3_405b_on_16_stages():
    """Grattafiori et al. 2024, Table 4 (TP 8, PP 16, DP 64 on 8192 H100s) and §3.3.2 (126
    layers, first and last stage one fewer): the layout is expressed exactly; a GPT-form model
    whose layers pp does not divide is refused with the rule and the way out named."""
    w = Workload(model=load_model("llama3-405b"), hardware=load_hardware("H100"), gpus=8192,
                 global_batch=2048, seq_len=8192, kernels="fused")
    L = Layout(dp=64, tp=8, pp=16, sequence_parallel=True, zero_stage=1,
               stage_layout=first_last_fewer(126, 16))
    assert check_layout(w, L) is None
    est = estimate(w, L, simulate=False)
    blocks = [c.params for c in est.costs.chunks]
    assert blocks[1] == blocks[14] and blocks[0] < blocks[1] and blocks[15] > blocks[0]
    # tessera's own split keeps every block with context parallelism too (it used to fall back
    # to 126 // 16 = 7 blocks per stage: 112 of 126).
    long = Workload(model=load_model("llama3-405b"), hardware=load_hardware("H100"),
                    gpus=16384, global_batch=128, seq_len=131072)
    assert sum(chunk_sizes(long, Layout(dp=8, tp=8, pp=16, cp=16))) == 126
    gpt = Workload(model=load_model("gpt3-175b"), hardware=load_hardware("A100"), gpus=56,
                   global_batch=56, seq_len=2048)
    with pytest.raises(PlanError, match=r"pp\*virtual=7 must divide layers=96, or give the "
                                        r"blocks per chunk \(stage_layout, e.g. "):
        estimate(gpt, Layout(tp=8, pp=7, recompute="full"))
    fewer = first_last_fewer(96, 7)
    assert fewer == (13,) + (14,) * 5 + (13,)
    assert estimate(gpt, Layout(tp=8, pp=7, recompute="full", stage_layout=fewer)).step_time > 0


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (M, MBS, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference() -> bytes:
    """The single-device model's loss and gradients on the same M micro-batches (loss
    scaled by 1/M per micro-batch, as the pipeline accumulates)."""
    cfg = uneven_config()
    model = build_model(cfg.model, cfg.train.seed)
    loss = 0.0
    for x, y in _batches():
        part = cross_entropy(model(x), y) / M
        part.backward()
        loss += float(part.detach())
    return pickle.dumps((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))


def _uneven_rank(reference: bytes):
    cfg = uneven_config()
    engine = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
    engine.cfg.train.steps = 2  # no timeline pictures from this test
    loss = engine.forward_backward(_batches())
    grads = {chunk.reference_name(n): p.grad.clone()
             for chunk in engine.model.chunks.values() for n, p in chunk.named_parameters()}
    blocks = [len(chunk.layers) for chunk in engine.model.chunks.values()]
    want_loss, want = pickle.loads(reference)
    # Both sides add the same M micro-batch means of MBS·SEQ tokens each, in the same kernels;
    # the bound is the summation bound over the batch's tokens (tessera.testing), which a
    # wrong block on a stage or a lost micro-batch exceeds by orders of magnitude.
    tokens = M * MBS * SEQ
    assert_close_summed(float(loss), want_loss, terms=tokens, msg="loss")
    for name, g in grads.items():
        assert_close_summed(g, want[name], terms=tokens, msg=name)
    return blocks, sorted(grads)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_uneven_pipeline_matches_the_single_device_model():
    """pp = 2 with stages of 1 and 4 blocks (1F1B, 3 micro-batches): the loss and every
    gradient equal the single-device model's within the summation bound, and each stage
    holds the blocks the layout gave it."""
    results = run_ranks(_uneven_rank, 2, args=(_reference(),), timeout=240)
    (blocks0, names0), (blocks1, names1) = results
    assert blocks0 == [1] and blocks1 == [4]
    cfg = uneven_config()
    every = {n for n, _ in build_model(cfg.model, cfg.train.seed).named_parameters()}
    assert set(names0) | set(names1) == every and not set(names0) & set(names1)
