"""Shared set-up of the data-parallel parity tests (test_ddp.py, test_parameter_server.py).

One global batch per step, a pure function of the step number; dp rank r of N takes rows
[r·G/N, (r+1)·G/N) and cuts them into `accum` micro-batches, like the real loader. The reference
is one process running the same engine code with dp=1 on the whole batch as one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tessera.config import Config, make_config
from tessera.step import Executor, build_executor
from tessera.topology import Topology

SEQ = 16
GLOBAL_BATCH = 8
STEPS = 10
VOCAB = 256


def tiny_config(dp: int = 1, accum: int = 1, **parallel: Any) -> Config:
    return make_config(
        None,
        model=dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   max_seq_len=SEQ),
        data=dict(seq_len=SEQ),
        parallel=dict(dp=dp, **parallel),
        # lr 1e-2 moves the weights far enough in 10 steps that a wrong gradient shows.
        train=dict(grad_accum=accum, lr=1e-2, steps=STEPS, warmup_steps=0, grad_clip=1.0),
    )


def global_batch(step: int, pattern: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(GLOBAL_BATCH, SEQ) inputs and targets. pattern=True: each token is the previous + 1
    (mod VOCAB) from a random start, which a model learns in a few dozen steps."""
    g = torch.Generator().manual_seed(1000 + step)
    if pattern:
        start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    else:
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # (G, T) each


def local_micro_batches(step: int, dp_rank: int, dp: int, accum: int, pattern: bool = False
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = global_batch(step, pattern)
    per = GLOBAL_BATCH // dp
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return list(zip(x.chunk(accum), y.chunk(accum), strict=True))


def named_grads(engine: Executor) -> dict[str, torch.Tensor | None]:
    """This rank's gradients by name (pp = tp = 1: the reference model's names)."""
    return {n: None if p.grad is None else p.grad.clone()
            for _, n, p in engine.model.named_chunk_parameters()}


def named_params(engine: Executor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for _, n, p in engine.model.named_chunk_parameters()}


def train_and_record(engine: Executor, cfg: Config, dp_rank: int, steps: int = STEPS,
                     pattern: bool = False, grads: Callable[[Executor], Any] = named_grads,
                     params: Callable[[Executor], Any] = named_params) -> dict[str, Any]:
    """Run `steps` optimizer steps; record the loss and the gradients (`grads(engine)`, after
    the step's synchronization, before clipping) of each step, and the final parameters
    (`params(engine)`; by default both by name from ``engine.model``)."""
    opt = engine.optimizer(cfg.train)
    losses, recorded = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        micro = local_micro_batches(step, dp_rank, cfg.parallel.dp, cfg.train.grad_accum, pattern)
        losses.append(engine.forward_backward(micro))
        recorded.append(grads(engine))
        engine.clip_grad_norm_(cfg.train.grad_clip)
        opt.step()
    return dict(losses=losses, grads=recorded, params=params(engine))


def reference_run(steps: int = STEPS) -> dict[str, Any]:
    """One process, the whole global batch as one micro-batch, the same engine code (dp=1)."""
    cfg = tiny_config()
    engine = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
    return train_and_record(engine, cfg, dp_rank=0, steps=steps)


def distributed_run(cfg: Config, steps: int = STEPS, pattern: bool = False, **record: Any
                    ) -> tuple[Executor, dict[str, Any]]:
    """Build the engine `cfg` asks for on this rank (all ranks call) and train it; `record`
    goes to train_and_record (grads=, params=)."""
    topo = Topology.build(cfg.parallel)
    engine = build_executor(cfg, topo, torch.device("cpu"))
    return engine, train_and_record(engine, cfg, topo.coords()["dp"], steps, pattern, **record)


# fp32 tolerances. N ranks sum N partial means where one process sums all tokens at once, so the
# first step's gradients differ only by float32 rounding of the reduction order (measured
# <= 1.3e-8). Adam's update lr*m/sqrt(v) magnifies such differences in entries whose v is tiny,
# so over 10 steps parameters drift apart by up to ~2e-5 and gradients by up to ~1.2e-6
# (measured, N = 2 and 4, with and without accumulation). The bounds below leave ~4x margin and
# still catch any real mistake: a gradient reduced without dividing by N, or missing a rank's
# rows, is off by >= 1e-3 (gradients are up to 0.12).
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=5e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-4)


def assert_matches_reference(run: dict[str, Any], ref: dict[str, Any], label: str,
                             check_grads: bool = True) -> None:
    for step, (got, want) in enumerate(zip(run["losses"], ref["losses"], strict=True)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **LOSS_TOL,
                                   msg=lambda m, s=step: f"{label} loss, step {s}: {m}")
    if check_grads:
        for step, (got, want) in enumerate(zip(run["grads"], ref["grads"], strict=True)):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(
                    got[name], want[name], **GRAD_TOL,
                    msg=lambda m, s=step, n=name: f"{label} grad {n}, step {s}: {m}")
    for name, want in ref["params"].items():
        torch.testing.assert_close(run["params"][name], want, **PARAM_TOL,
                                   msg=lambda m, n=name: f"{label} param {n}: {m}")
