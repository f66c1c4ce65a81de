"""Expert parallelism against the single-device MoE model (tessera.parallel.expert_parallel).

Eight layouts run in one 4-rank job, 10 AdamW steps each (clipping active), on the same global
batches as the reference: ep 4 (dp 4, dropless, our pairwise all-to-all), ep 2 × expert-dp 2
(dp 4, capacity dropping, pairwise, 2 micro-batches), ep 2 × tp 2 (capacity) and ep 2 × pp 2
(1F1B, 2 micro-batches, dropless), with ZeRO-3, -1 and -2 (experts sharded over expert-dp) and
with full recomputation. Each step is compared teacher-forced (tests/dp_parity.py's Shadow
idea): the reference model loaded with the run's parameters before the step must give the run's
loss and every parameter's gradient (gathered by reference name, experts from every ep rank),
and AdamW fed the run's clipped gradients must give the run's parameters after it.

Tolerances (tessera.testing):
- loss and gradients: the same sums in another order. An expert weight's gradient adds one
  term per assignment routed to it, at most N·k = 128·2 assignments, in another order
  (assignments arrive by source rank, micro-batches and replicas are summed separately);
  dense gradients add N tokens' terms. So the summation bound over N·k terms, scale the
  tensor's largest reference magnitude.
- the optimizer step: AdamW's elementwise update from the same parameters and gradients:
  ADAM_ROUNDINGS roundings of values as large as the parameters.
Routing itself is discrete: the run routes the reference's tokens to the reference's experts
only if round-off never flips a top-k choice, which the loss and gradient checks would expose
(a flipped token changes gradients by O(1) of their size, far outside the bound). The capacity
layouts must drop assignments (checked), the same ones as the reference (else gradients differ).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tessera.config import Config
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.model import build_model, cross_entropy
from tessera.moe import collect_stats
from tessera.optim import adamw
from tessera.parallel.expert_parallel import is_expert_param
from tessera.step import build_executor
from tessera.testing import assert_close_summed, rank_micro_batches, run_ranks
from tessera.topology import Topology

STEPS, GLOBAL_BATCH, SEQ, CLIP, LR, TOP_K = 10, 8, 16, 0.5, 1e-3, 2
N_TOKENS = GLOBAL_BATCH * SEQ
ADAM_ROUNDINGS = 8


def _cfg(dp: int, ep: int, tp: int = 1, pp: int = 1, m: int = 1, capacity: float = 0.0,
         **parallel: Any) -> Config:
    return make_config(
        None,
        model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                   moe_experts=4, moe_top_k=TOP_K, moe_ffn_hidden=32,
                   moe_capacity_factor=capacity, moe_aux_loss_coef=0.05,
                   moe_z_loss_coef=0.01, moe_shared_expert=tp > 1),
        data=dict(seq_len=SEQ),
        parallel=dict(dp=dp, ep=ep, tp=tp, pp=pp, **parallel),
        train=dict(lr=LR, warmup_steps=0, steps=STEPS, grad_accum=m, grad_clip=CLIP,
                   micro_batch_size=GLOBAL_BATCH // dp // m))


LAYOUTS: dict[str, Config] = {
    "ep4 dropless pairwise": _cfg(4, 4, ep_alltoall="pairwise"),
    "ep2 x edp2 capacity pairwise m2": _cfg(4, 2, m=2, capacity=1.0, ep_alltoall="pairwise"),
    "ep2 x tp2 capacity": _cfg(2, 2, tp=2, capacity=1.0),
    "ep2 x pp2 dropless m2": _cfg(2, 2, pp=2, m=2),
    # ZeRO: experts in units of their own, sharded and reduced over edp
    "ep2 x edp2 zero3 capacity m2": _cfg(4, 2, m=2, capacity=1.0, zero_stage=3),
    "ep2 x tp2 zero1": _cfg(2, 2, tp=2, zero_stage=1),
    "ep2 x pp2 zero2 m2": _cfg(2, 2, pp=2, m=2, zero_stage=2),
    # the blocks' forward (all-to-alls included) runs again in backward
    "ep2 x edp2 full recompute": _cfg(4, 2, capacity=1.0, recompute="full"),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (+1 mod 256 from a random start) so the loss visibly falls."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 256, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % 256
    return tokens[:, :-1], tokens[:, 1:]


def _run(cfg: Config) -> dict[str, Any] | None:
    topo = Topology.build(cfg.parallel)
    executor = build_executor(cfg, topo, torch.device("cpu"))
    opt = executor.optimizer(cfg.train)
    m = cfg.train.grad_accum
    out: dict[str, Any] = {"params": [], "losses": [], "grads": [], "norms": []}
    dropped = 0.0
    for step in range(STEPS):
        out["params"].append(executor.full_state_dict())
        opt.zero_grad(set_to_none=True)
        out["losses"].append(executor.forward_backward(rank_micro_batches(*_batch(step), topo, m)))
        out["grads"].append(executor.model.full_grads())
        out["norms"].append(executor.clip_grad_norm_(CLIP))
        opt.step()
        stats = collect_stats(list(executor.model.chunks.values()))
        dropped += float(stats["dropped"]) if stats else 0.0
    out["params"].append(executor.full_state_dict())
    out["dropped"] = dropped
    return out if topo.rank == 0 else None


def _layouts_rank(names: list[str]) -> dict[str, Any]:
    return {name: _run(LAYOUTS[name]) for name in names}


def _check(name: str, run: dict[str, Any]) -> None:
    cfg = LAYOUTS[name]
    model = build_model(cfg.model)
    params = dict(model.named_parameters())
    shadow_opt = adamw(model.parameters(), cfg.train)
    for step in range(STEPS):
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(run["params"][step][k])
        model.zero_grad(set_to_none=True)
        x, y = _batch(step)
        loss = cross_entropy(model(x), y)
        loss.backward()
        label = f"{name} step {step}"
        assert_close_summed(run["losses"][step], loss.item(), terms=N_TOKENS,
                            msg=f"{label} loss")
        grads = run["grads"][step]
        assert grads.keys() == params.keys(), label
        for k, p in params.items():
            assert_close_summed(grads[k], p.grad, terms=N_TOKENS * TOP_K,
                                msg=f"{label} grad {k}")
        # the optimizer step: AdamW (its own moments) fed the run's clipped gradients
        factor = min(1.0, CLIP / (run["norms"][step] + 1e-6))
        with torch.no_grad():
            for k, p in params.items():
                p.grad = grads[k] * factor
        shadow_opt.step()
        for k, p in params.items():
            assert_close_summed(run["params"][step + 1][k], p.detach(), terms=ADAM_ROUNDINGS,
                                msg=f"{label} param {k} after the step")
    assert run["norms"][0] > CLIP  # clipping is exercised
    assert run["losses"][-1] < run["losses"][0], name
    if cfg.model.moe_capacity_factor > 0:
        assert run["dropped"] > 0, f"{name}: capacity dropped nothing"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_expert_parallel_layouts_match_the_single_device_model():
    results = run_ranks(_layouts_rank, 4, args=(list(LAYOUTS),), timeout=600)
    for name, run in results[0].items():
        _check(name, run)


def test_expert_groups_are_blocks_of_dp_and_their_replicas():
    # (pp, dp, cp, tp) = (1, 4, 1, 2): dp ranks of tp position 0 are 0, 2, 4, 6
    topo = Topology(dp=4, tp=2, ep=2)
    assert topo.all_groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.all_groups("edp") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert topo.size("edp") == 2


def test_layouts_pass_the_layout_check_and_experts_are_named():
    for cfg in LAYOUTS.values():
        validate(cfg)
    assert is_expert_param("layers.1.feed_forward.experts.w2")
    assert not is_expert_param("layers.1.feed_forward.router.weight")


@pytest.mark.parametrize("overrides,field,rule", [
    (dict(parallel=dict(dp=4, ep=4), model=dict(moe_experts=6)), "parallel.ep",
     "must divide model.moe_experts=6"),
    (dict(parallel=dict(dp=2, ep=4)), "parallel.ep", "must divide parallel.dp=2"),
    (dict(model=dict(moe_experts=4, moe_top_k=5)), "model.moe_top_k",
     "must be <= model.moe_experts=4"),
    (dict(parallel=dict(dp=2, ep=2), model=dict(moe_experts=0)), "parallel.ep",
     "needs a mixture-of-experts model"),
    (dict(parallel=dict(dp=2, ep=2), train=dict(precision="bf16")), "train.precision",
     "fp32 only"),
    (dict(parallel=dict(cp=2)), "parallel.cp", "route per whole sequence"),
])
def test_bad_moe_layouts_are_refused_with_the_reason(overrides, field, rule):
    sections = {"model": dict(d_model=32, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=2),
                "data": dict(seq_len=16)}
    for k, v in overrides.items():
        sections[k] = {**sections.get(k, {}), **v}
    with pytest.raises(ConfigError) as e:
        validate(make_config(None, **sections))
    assert e.value.field_name == field and rule in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# All-to-all traffic: what the counters saw equals what the routing implies.

BYTES_CFG = _cfg(2, 2, m=2, capacity=1.0, ep_alltoall="pairwise")


def _bytes_rank() -> dict[str, Any]:
    from tessera.collectives import CommStats, all_to_all_v

    # our variable-split all-to-all against the backend's, exact (it only moves rows)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(7)
    splits = torch.randint(0, 5, (2, 2), generator=g)  # splits[src][dst], one empty block at most
    x = torch.randn(int(splits[rank].sum()), 3, generator=g) + rank
    send, recv = splits[rank].tolist(), splits[:, rank].tolist()
    ours = all_to_all_v(x, send, recv, algorithm="pairwise")
    theirs = all_to_all_v(x, send, recv, algorithm="backend")

    cfg = BYTES_CFG
    topo = Topology.build(cfg.parallel)
    comm = CommStats()
    executor = build_executor(cfg, topo, torch.device("cpu"), ep_stats=comm)
    x, y = _batch(0)
    d, m = topo.coords()["dp"], cfg.train.grad_accum
    rows = slice(d * GLOBAL_BATCH // 2, (d + 1) * GLOBAL_BATCH // 2)
    executor.forward_backward(list(zip(x[rows].chunk(m), y[rows].chunk(m), strict=True)))
    return {"equal": torch.equal(ours, theirs), "shape": tuple(ours.shape),
            "wire_bytes": comm.bytes_sent, "counted_bytes": executor.model.ep.stats.bytes_sent}


def _kept_per_expert(cfg: Config, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The reference model's kept assignments per expert of each MoE layer for `tokens`."""
    model = build_model(cfg.model)
    kept = []

    def hook(module, args, out):
        r = module.route(args[0])
        e = r["experts"][r["keep"]]
        kept.append(torch.bincount(e, minlength=module.n_experts))

    for layer in model.layers:
        layer.feed_forward.register_forward_hook(hook)
    model(tokens)
    return kept


@pytest.mark.multiprocess
def test_all_to_all_bytes_equal_the_routing_formula():
    """Per MoE layer call on rank r: forward dispatch sends the rows kept for the other rank's
    experts, combine returns the rows that rank sent to r; backward repeats both transposed. So
    bytes_r = 2·Σ_calls (rows r sends + rows r receives, other ranks only)·h·4 (fp32). Our
    pairwise all-to-all's wire counter and the dispatcher's counter must both equal it."""
    results = run_ranks(_bytes_rank, 2)
    cfg = BYTES_CFG
    h, E, ep, m = cfg.model.d_model, cfg.model.moe_experts, 2, cfg.train.grad_accum
    local = E // ep
    x, _ = _batch(0)
    # kept[rank][call] per expert, calls = micro-batches × layers
    kept = {r: [k for mb in x[r * 4:(r + 1) * 4].chunk(m) for k in _kept_per_expert(cfg, mb)]
            for r in range(2)}
    for rank, got in enumerate(results):
        assert got["equal"] and got["shape"][1] == 3
        other = 1 - rank
        rows = 0
        for mine, theirs in zip(kept[rank], kept[other], strict=True):
            rows += int(mine[other * local:(other + 1) * local].sum())  # dispatched to other
            rows += int(theirs[rank * local:(rank + 1) * local].sum())  # returned to other
        formula = 2 * rows * h * 4
        assert formula > 0
        assert got["wire_bytes"] == formula, (rank, got, formula)
        assert got["counted_bytes"] == formula, (rank, got, formula)
