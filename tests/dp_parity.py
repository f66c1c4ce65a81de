"""Shared set-up of the data-parallel parity tests (test_ddp.py, test_parameter_server.py,
test_zero.py, test_recompute.py).

One global batch per step, a pure function of the step number; dp rank r of N takes rows
[r·G/N, (r+1)·G/N) and cuts them into `accum` micro-batches, like the real loader.

Two references. The free-running one is one process running the same engine code with dp=1 on
the whole batch as one micro-batch for all the steps. The shadow (`Shadow`) is the
single-device model teacher-forced onto the parallel run: every step it takes the run's
parameters, computes the loss and gradients of the whole global batch and takes its own AdamW
step. Comparing each step against the shadow isolates that step's reordered sums (tolerance:
the summation bound of tessera.testing), where comparing against the free-running reference
also carries every earlier step's differences, which Adam amplifies; the free-running
reference still checks the whole trajectory, in units of lr·steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.config import Config
from tessera.config_io import make_config
from tessera.model import build_model, cross_entropy
from tessera.optim import adamw, lr_lambda
from tessera.step import Executor, build_executor
from tessera.testing import assert_close_summed
from tessera.topology import Topology

SEQ = 16
GLOBAL_BATCH = 8
STEPS = 10
VOCAB = 256
LR = 1e-2
TOKENS = GLOBAL_BATCH * SEQ
"""Tokens of one global batch: the terms a loss or a gradient element sums."""


def tiny_config(dp: int = 1, accum: int = 1, **parallel: Any) -> Config:
    return make_config(
        None,
        model=dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   max_seq_len=SEQ),
        data=dict(seq_len=SEQ),
        parallel=dict(dp=dp, **parallel),
        # lr 1e-2 moves the weights far enough in 10 steps that a wrong gradient shows.
        train=dict(grad_accum=accum, lr=LR, steps=STEPS, warmup_steps=0, grad_clip=1.0),
    )


def global_batch(step: int, pattern: bool = False, rows: int = GLOBAL_BATCH
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, SEQ) inputs and targets. pattern=True: each token is the previous + 1
    (mod VOCAB) from a random start, which a model learns in a few dozen steps."""
    g = torch.Generator().manual_seed(1000 + step)
    if pattern:
        start = torch.randint(0, VOCAB, (rows, 1), generator=g)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    else:
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # (G, T) each


def local_micro_batches(step: int, dp_rank: int, dp: int, accum: int, pattern: bool = False,
                        rows: int = GLOBAL_BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = global_batch(step, pattern, rows)
    per = rows // dp
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return list(zip(x.chunk(accum), y.chunk(accum), strict=True))


def clip_like_engine(params: list[nn.Parameter], max_norm: float) -> float:
    """Executor.clip_grad_norm_'s rule on one process: fp64 norm, scale by max/(norm + 1e-6)."""
    sq = sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


class Shadow:
    """The single-device model teacher-forced onto a parallel run (see the module docstring).

    ``gradients(state, micro_batches)``: from the run's parameters `state` (reference names),
    the mean loss of the global batch (usually one micro-batch: all of it), its gradients,
    their norm and the gradients clipped by the engine's rule.
    ``optimizer_step(state, grads)``: torch's AdamW (with the warm-up/cosine schedule if
    `schedule`) applied to the run's parameters and the run's own clipped gradients; its
    moments are built from the run's gradients, so an optimizer that matches AdamW matches it
    to a few roundings, with no Adam amplification in the way.
    """

    def __init__(self, cfg: Config, schedule: bool = False):
        self.model = build_model(cfg.model, cfg.train.seed)
        self.params = dict(self.model.named_parameters())
        self.clip = cfg.train.grad_clip
        self.opt = adamw(self.model.parameters(), cfg.train)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.train)) \
            if schedule else None

    def gradients(self, state: dict[str, torch.Tensor],
                  micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        self.model.load_state_dict(state)
        self.model.zero_grad(set_to_none=True)
        loss = 0.0
        for x, y in micro_batches:  # gradients accumulate; the loss of each scaled by 1/n
            part = cross_entropy(self.model(x), y) / len(micro_batches)
            part.backward()
            loss += float(part.detach())
        grads = {n: p.grad.clone() for n, p in self.params.items()}
        norm = clip_like_engine(list(self.params.values()), self.clip)
        clipped = {n: p.grad.clone() for n, p in self.params.items()}
        return dict(loss=loss, norm=norm, grads=grads, clipped=clipped)

    @torch.no_grad()
    def optimizer_step(self, state: dict[str, torch.Tensor],
                       grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        self.model.load_state_dict(state)
        for name, p in self.params.items():
            p.grad = None if grads[name] is None else grads[name].clone()
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam's exp_avg and exp_avg_sq by parameter name."""
        return {n: {k: self.opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                for n, p in self.params.items()}


def named_grads(engine: Executor) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone()
            for _, n, p in engine.model.named_chunk_parameters()}


def named_params(engine: Executor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for _, n, p in engine.model.named_chunk_parameters()}


def train_and_record(engine: Executor, cfg: Config, dp_rank: int, steps: int = STEPS,
                     pattern: bool = False, grads: Callable[[Executor], Any] = named_grads,
                     params: Callable[[Executor], Any] = named_params, shadow: bool = False
                     ) -> dict[str, Any]:
    """Run `steps` optimizer steps; record the loss and the gradients (`grads(engine)`, after
    the step's synchronization, before clipping) of each step, and the final parameters
    (`params(engine)`; by default both by name from ``engine.model``).

    shadow=True also records per step a `Shadow`'s loss and gradients at the run's parameters
    ("shadow"), the run's parameters after its step ("step_params") and AdamW's step from the
    run's parameters with the run's clipped gradients (`grads(engine)` after clipping)
    ("shadow_params")."""
    opt = engine.optimizer(cfg.train)
    twin = Shadow(cfg) if shadow else None
    out: dict[str, list] = dict(losses=[], grads=[], shadow=[], step_params=[], shadow_params=[])
    for step in range(steps):
        before = engine.full_state_dict() if twin else None
        if twin is not None:
            out["shadow"].append(twin.gradients(before, [global_batch(step, pattern)]))
        opt.zero_grad(set_to_none=True)
        micro = local_micro_batches(step, dp_rank, cfg.parallel.dp, cfg.train.grad_accum, pattern)
        out["losses"].append(engine.forward_backward(micro))
        out["grads"].append(grads(engine))
        engine.clip_grad_norm_(cfg.train.grad_clip)
        clipped = grads(engine) if twin else None
        opt.step()
        if twin is not None:
            out["step_params"].append(engine.full_state_dict())
            out["shadow_params"].append(twin.optimizer_step(before, clipped))
    return dict(out, params=params(engine))


def reference_run(steps: int = STEPS) -> dict[str, Any]:
    """One process, the whole global batch as one micro-batch, the same engine code (dp=1)."""
    cfg = tiny_config()
    engine = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
    return train_and_record(engine, cfg, dp_rank=0, steps=steps)


def distributed_run(cfg: Config, steps: int = STEPS, pattern: bool = False, **record: Any
                    ) -> tuple[Executor, dict[str, Any]]:
    """Build the engine `cfg` asks for on this rank (all ranks call) and train it; `record`
    goes to train_and_record (grads=, params=, shadow=)."""
    topo = Topology.build(cfg.parallel)
    engine = build_executor(cfg, topo, torch.device("cpu"))
    return engine, train_and_record(engine, cfg, topo.coords()["dp"], steps, pattern, **record)


ADAM_ROUNDINGS = 8
"""Roundings in AdamW's elementwise update of one parameter (decay, two lerp/addcmul moment
updates, bias corrections, sqrt, division, the add): the terms of its summation bound."""


def assert_matches_reference(run: dict[str, Any], label: str, check_grads: bool = True) -> None:
    """`run` (recorded with shadow=True) against its shadow, step by step. Tolerances
    (tessera.testing):

    - loss and gradients: N ranks sum their own tokens' contributions, then the N partial means
      are added, where the shadow sums the TOKENS tokens of the global batch at once: the same
      sums in another order from the same parameters, so the summation bound over TOKENS terms;
    - the optimizer step: AdamW from the same parameters with the same gradients; the same
      elementwise arithmetic, perhaps vectorized differently: ADAM_ROUNDINGS roundings of
      values as large as the parameters.

    Step by step, these prove the whole run: every step starts where the run is and does what
    the single device would do from there. (Comparing with a free-running single-device run
    instead lets Adam turn round-off in near-zero gradient entries into visible differences.)
    """
    for step, (got, twin) in enumerate(zip(run["losses"], run["shadow"], strict=True)):
        # The mean of TOKENS per-token losses, all positive: scale = the loss itself.
        assert_close_summed(got, twin["loss"], terms=TOKENS, msg=f"{label} loss, step {step}")
        if not check_grads:
            continue
        got_grads, want = run["grads"][step], twin["grads"]
        assert got_grads.keys() == want.keys(), label
        for name, w in want.items():
            # A parameter no rank used keeps grad=None; the shadow's is then all zeros.
            g = got_grads[name] if got_grads[name] is not None else torch.zeros_like(w)
            assert_close_summed(g, w, terms=TOKENS, msg=f"{label} grad {name}, step {step}")
        for name, want in run["shadow_params"][step].items():
            assert_close_summed(run["step_params"][step][name], want, terms=ADAM_ROUNDINGS,
                                msg=f"{label} param {name} after step {step}")
