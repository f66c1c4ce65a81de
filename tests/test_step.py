"""Executor.train_step: the trainer's step, in the trainer's order, on one process."""

from __future__ import annotations

import itertools

import torch

from tessera.config_io import make_config
from tessera.moe import update_router_bias
from tessera.optim import lr_lambda
from tessera.step import build_executor
from tessera.topology import Topology

STEPS = 3


def _setup(**model):
    cfg = make_config("tiny", model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                         **model),
                      train=dict(grad_clip=0.05))
    torch.manual_seed(0)
    executor = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
    optimizer = executor.optimizer(cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    return cfg, executor, optimizer, scheduler


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 256, (2, 4, 17), generator=torch.Generator().manual_seed(step))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _by_hand(**model):
    """The step written out: zero_grad, forward and backward, clip, optimizer, scheduler, the
    routing bias."""
    cfg, executor, optimizer, scheduler = _setup(**model)
    out = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = executor.forward_backward(_batches(step))
        norm = executor.clip_grad_norm_(cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        update_router_bias(list(executor.model.chunks.values()))
        out.append((loss, norm))
    return out, executor.full_state_dict(), scheduler.get_last_lr()


def _by_train_step(**model):
    cfg, executor, optimizer, scheduler = _setup(**model)
    batches = (_batches(step) for step in itertools.count())  # taken inside the step
    out = []
    for _ in range(STEPS):
        done = executor.train_step(batches, optimizer, scheduler, cfg.train.grad_clip)
        assert done.seconds > 0 and done.compute_s > 0
        out.append((done.loss, done.grad_norm))
    return out, executor.full_state_dict(), scheduler.get_last_lr()


def _assert_same(a, b):
    assert a[0] == b[0]
    assert a[2] == b[2]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


def test_train_step_is_the_step_written_out_bit_for_bit():
    by_hand = _by_hand()
    assert by_hand[0][0][1] > 0.05  # the clip acts: a missing clip would change the weights
    _assert_same(_by_train_step(), by_hand)


def test_train_step_moves_the_routing_bias_of_a_model_with_experts():
    moe = dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden=32, moe_router_bias_rate=1e-2)
    by_hand = _by_hand(**moe)
    assert any(k.endswith("expert_bias") and v.abs().sum() > 0 for k, v in by_hand[1].items())
    _assert_same(_by_train_step(**moe), by_hand)


def test_train_step_without_the_update_leaves_the_weights():
    _, executor, optimizer, scheduler = _setup()
    before = executor.full_state_dict()
    done = executor.train_step(_batches(0), optimizer, scheduler, 1.0, update=False)
    assert done.grad_norm is None
    assert scheduler.last_epoch == 0
    after = executor.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is not None for p in executor.parameters())


def test_train_step_reads_seconds_on_the_given_clock():
    _, executor, optimizer, _ = _setup()
    ticks = iter([10.0, 12.5])
    done = executor.train_step(_batches(0), optimizer, clock=lambda: next(ticks))
    assert done.seconds == 2.5
