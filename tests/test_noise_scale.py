"""The gradient noise scale (``tessera.noise_scale``; McCandlish et al. 2018, Appendix A).

Two kinds of check, because the transformer has no closed-form noise scale:

1. **Statistics, on a problem with a known answer.** Linear regression with Gaussian inputs and
   Gaussian label noise, run through tessera's own data-parallel wrappers (``DataParallel``'s
   bucket hooks, ``ZeroModel``'s stage-2 reduce-scatter hooks, a ``RowParallelLinear`` under
   tp 2) and the training code's estimator (``small_batch_sq`` + ``NoiseScale``): the measured
   B_simple is within 20% of the truth at dp 2, dp 4, ZeRO-2 (two micro-batches, so one
   pre-reduction read per micro-batch) and dp 2 × tp 2.

   Closed form. x ~ N(0, I_d), y = x·w* + ε with ε ~ N(0, σ²), per-sample loss
   ℓ = ½(x·w − y)², evaluated at w = w* + δ. The residual is r = x·δ − ε and the per-sample
   gradient g = x·r. Then G = E[g] = E[x xᵀ]δ − E[x ε] = δ, and with Isserlis' theorem
   (E[x_i x_j x_k x_l] = δ_ij δ_kl + δ_ik δ_jl + δ_il δ_jk) and ε independent of x,
   E[g gᵀ] = E[(x·δ)² x xᵀ] + σ² E[x xᵀ] = |δ|² I + 2 δ δᵀ + σ² I, so
   Σ = E[g gᵀ] − G Gᵀ = (|δ|² + σ²) I + δ δᵀ,  tr Σ = d(|δ|² + σ²) + |δ|², and
   B_simple = tr Σ / |G|² = d + 1 + d σ² / |δ|².   (d = 8, σ = |δ| = 1: B = 17.)

   The weights stay at w (no update), so every step samples the same B_simple; the estimator
   averages 600 steps (decay 0.995). Simulated over 30 seeds, that average scatters by 5% (dp 2)
   and 3% (dp 4) around the truth, worst 13%: the 20% bound is ~4 standard deviations.

2. **Exactness, on the transformer.** One step of the engine at (dp, tp, pp) layouts covering
   DDP, ZeRO-2/3 with hooks (read per micro-batch), schedule-driven ZeRO-3, sequence parallelism
   and a tied embedding split over pp: the |G_small|² and |G_big|² the step measured (recovered
   from its first-step estimates, which the bias-corrected average leaves unsmoothed) equal the
   single-device model's, computed on each replica's (or micro-batch's) rows and on the global
   batch, over the parameters the engine counts (all but the ones still partial when the
   reduction reads them, ``ParallelModel.partial_before_reduction``). Tolerance: a squared
   norm's error is Δ|g|² = 2⟨g, Δg⟩ + |Δg|², at most twice the gradients' relative error, whose
   sums over the batch's N tokens reorder (the composition tests' bound): the summation bound
   over 2N terms with the squared norm as its scale.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config
from tessera.config_io import make_config
from tessera.model import build_model, cross_entropy
from tessera.noise_scale import (
    EMA_DECAY,
    NoiseScale,
    critical_batch_line,
    noise_scale_unsupported,
    small_batch_sq,
    unbiased_estimates,
)
from tessera.parallel.ddp import DataParallel
from tessera.parallel.tensor_parallel import (
    RowParallelLinear,
    ShardSpec,
    TPContext,
    owned_grad_sq,
)
from tessera.parallel.zero import ZeroModel
from tessera.step import build_executor
from tessera.testing import assert_close_summed, rank_micro_batches, run_ranks, summation_bound
from tessera.topology import Topology

# -- the estimator's algebra -----------------------------------------------------------------


def test_estimates_invert_the_expectations():
    """With E|G_B|² = |G|² + tr(Σ)/B fed in exactly, the estimates return |G|² and tr(Σ)."""
    g_sq, trace = 2.5, 40.0
    for b_small, b_big in [(4, 8), (2, 64), (8, 32)]:
        got = unbiased_estimates(g_sq + trace / b_small, g_sq + trace / b_big, b_small, b_big)
        # a handful of double operations on values of one magnitude: a few ulps (~1e-15)
        assert got == pytest.approx((g_sq, trace), rel=1e-12)
    for b_small, b_big in [(8, 8), (0, 8)]:  # no second batch size; an empty one
        with pytest.raises(ValueError, match="need 0 < b_small < b_big"):
            unbiased_estimates(1.0, 1.0, b_small, b_big)


def test_moving_average_is_bias_corrected():
    ns = NoiseScale(decay=0.9)
    first = ns.update(small_sq=1.5, big_sq=1.125, b_small=4, b_big=16, seq_len=64)
    # |G|² = (16·1.125 − 4·1.5)/12 = 1, tr Σ = 0.375 / (1/4 − 1/16) = 2: one step, no smoothing
    assert first == pytest.approx({"noise_scale": 2.0, "noise_scale_tokens": 128.0,
                                   "grad_sq_est": 1.0, "grad_trace_est": 2.0})
    second = ns.update(small_sq=3.0, big_sq=2.25, b_small=4, b_big=16)  # twice both
    assert second["grad_sq_est"] == pytest.approx((0.9 * 0.1 * 1 + 0.1 * 2) / (1 - 0.81))
    assert second["noise_scale"] == pytest.approx(2.0)
    negative = NoiseScale().update(small_sq=1.0, big_sq=0.1, b_small=1, b_big=2)  # |G|² < 0
    assert negative["noise_scale"] is None and negative["noise_scale_tokens"] is None
    # |G|² = (16·0.25 − 4·1)/12 = 0 exactly: no ratio (not a division by zero), and tr Σ =
    # 0.75 / (3/16) = 4, through the average's (1 − d)·x / (1 − d): a few ulps, hence rel 1e-12
    zero = NoiseScale().update(small_sq=1.0, big_sq=0.25, b_small=4, b_big=16)
    assert zero == {"noise_scale": None, "noise_scale_tokens": None, "grad_sq_est": 0.0,
                    "grad_trace_est": pytest.approx(4.0, rel=1e-12)}
    with pytest.raises(ValueError, match="no step averaged yet"):
        NoiseScale().estimate()


def test_state_continues_exactly_through_json():
    """What a checkpoint keeps (``state_dict``, in extra.json): an estimator restored from it
    gives the uninterrupted estimator's records bit for bit; a fresh one does not."""
    # Not exactly representable in binary, so the JSON round trip must keep every bit.
    steps = [(1.5 + 0.1 * i, 1.1 + 0.07 * (i % 3), 4, 16) for i in range(8)]
    whole = NoiseScale()
    want = [whole.update(*s, seq_len=16) for s in steps]
    first = NoiseScale()
    for s in steps[:3]:
        first.update(*s, seq_len=16)
    resumed, fresh = NoiseScale(), NoiseScale()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.update(*s, seq_len=16) for s in steps[3:]] == want[3:]
    assert resumed.state_dict() == whole.state_dict() and whole.state_dict()["steps"] == 8
    assert fresh.update(*steps[3], seq_len=16) != want[3]
    empty = NoiseScale(decay=0.9)  # nothing averaged yet (steps 0): a state that loads
    fresh.load_state_dict(empty.state_dict())
    assert fresh.state_dict() == empty.state_dict()
    good = first.state_dict()
    for bad in ({}, [1.0], {**good, "decay": 1.0}, {**good, "decay": 0.0}, {**good, "steps": -1},
                {**good, "g_sq": "x"}, {**good, "trace": None}):
        with pytest.raises(ValueError, match="malformed noise-scale state"):
            fresh.load_state_dict(bad)
    assert fresh.state_dict() == empty.state_dict()  # a refused state changes nothing


def test_malformed_saved_state_is_a_checkpoint_error(tmp_path):
    """A checkpoint's extra.json whose noise-scale state does not parse is refused with its
    path (a one-line user error), before anything is read into the run."""
    from types import SimpleNamespace

    from tessera import checkpoint

    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / "extra.json").write_text(json.dumps({"noise_scale": {"decay": 0.99}}))
    engine = SimpleNamespace(noise=NoiseScale())
    where = re.escape(f"checkpoint {tmp_path / 'extra.json'}: malformed noise-scale state")
    with pytest.raises(checkpoint.CheckpointError, match=where):
        checkpoint.restore(tmp_path, None, engine, None, None, None)
    assert engine.noise.state_dict() == NoiseScale().state_dict()


def test_small_batch_bookkeeping():
    # dp 2 replicas, m = 3 micro-batches of 4: accumulated, one gradient of 12 per replica
    assert small_batch_sq(10.0, False, 3, 4, 2) == (5.0, 12)
    # per micro-batch: 6 gradients each scaled by 1/3: mean |ĝ|² = 10·9/6
    assert small_batch_sq(10.0, True, 3, 4, 2) == (15.0, 4)


def test_layouts_without_a_measurement():
    assert "dp >= 2" in noise_scale_unsupported(1, 1, 1, "allreduce")
    assert "cp" in noise_scale_unsupported(2, 2, 1, "allreduce")
    assert "ep" in noise_scale_unsupported(2, 1, 2, "allreduce")
    assert "dp_mode=ps" in noise_scale_unsupported(2, 1, 1, "ps")
    assert "dp_mode=ps-async" in noise_scale_unsupported(2, 1, 1, "ps-async")
    assert noise_scale_unsupported(2, 1, 1, "allreduce") is None
    line = critical_batch_line(64, 16.0)
    assert "1 + B/B_crit = 5.00x" in line and line.startswith("warning: global batch 64")


# -- 1. linear regression with a known noise scale ----------------------------------------------

D, SIGMA, B, STEPS, DECAY = 8, 1.0, 8, 600, 0.995
TRUE_B = D + 1 + D * SIGMA**2 / 1.0  # |δ| = 1


def _delta() -> torch.Tensor:
    return torch.ones(1, D) / D**0.5  # w − w*, |δ| = 1 (w* = 0, so w = δ)


def _sample(case: int, step: int, replica: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * case + 10 * step + replica)
    x = torch.randn(n, D, generator=g)
    return x, SIGMA * torch.randn(n, 1, generator=g)  # y = x·w* + ε = ε


def _groups(world: int, size: int, contiguous: bool) -> dist.ProcessGroup:
    """This rank's group among `world/size` groups of `size` ranks (every rank makes all)."""
    mine = None
    n = world // size
    for i in range(n):
        ranks = [i * size + j for j in range(size)] if contiguous else list(range(i, world, n))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _regression_case(case: int, kind: str, dp: int, tp: int, m: int) -> float:
    """STEPS steps at fixed weights; the estimator's B_simple after them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group = _groups(world, tp, contiguous=True) if tp > 1 else None
    dp_group = _groups(world, dp, contiguous=tp == 1)
    replica = rank // tp if tp > 1 else rank % dp if dp < world else rank
    if tp > 1:
        tp_ctx = TPContext(tp_group)
        half = D // tp
        lin = RowParallelLinear(_delta()[:, tp_ctx.rank * half:(tp_ctx.rank + 1) * half].clone(),
                                tp_ctx, ShardSpec(dim=1, chunks=tp, full_size=D))
        cols = slice(tp_ctx.rank * half, (tp_ctx.rank + 1) * half)
    else:
        tp_ctx, lin, cols = TPContext(None), nn.Linear(D, 1, bias=False), slice(None)
        with torch.no_grad():
            lin.weight.copy_(_delta())
    module = nn.Sequential(lin)
    if kind == "zero2":
        wrapper = ZeroModel(module, dp_group, stage=2, units=[("lin", [lin])])
    else:
        wrapper = DataParallel(module, dp_group)
    wrapper.measure_pre_reduction()
    ns = NoiseScale(decay=DECAY)
    per_mb = getattr(wrapper, "reduces_per_microbatch", False)
    record: dict[str, Any] = {}
    for step in range(STEPS):
        wrapper.pre_reduce_sq.zero_()
        x, y = _sample(case, step, replica, B * m)
        for k, (xk, yk) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            ctx = wrapper.no_sync() if k < m - 1 else torch.enable_grad()
            with ctx:
                loss = 0.5 * (wrapper(xk[:, cols]) - yk).pow(2).mean() / m
                loss.backward()
        wrapper.finish_gradient_sync()
        if kind == "zero2":
            big = wrapper.local_grad_sq()
            dist.all_reduce(big, group=dp_group)  # each rank holds its shard
        else:
            big = owned_grad_sq(module, tp_ctx)
        small = wrapper.pre_reduce_sq.clone()
        dist.all_reduce(small, group=dp_group)
        if tp_group is not None:
            dist.all_reduce(big, group=tp_group)
            dist.all_reduce(small, group=tp_group)
        small_sq, b_small = small_batch_sq(float(small), per_mb, m, B, dp)
        record = ns.update(small_sq, float(big), b_small, B * m * dp)
        if kind == "zero2":
            wrapper.zero_grad()
        else:
            module.zero_grad(set_to_none=True)
    return record["noise_scale"]


REGRESSION_CASES = {"dp 2": ("ddp", 2, 1, 1), "dp 4": ("ddp", 4, 1, 1),
                    "ZeRO-2 dp 2, 2 micro-batches": ("zero2", 2, 1, 2),
                    "dp 2 x tp 2": ("ddp", 2, 2, 1)}


def _regression_rank() -> dict[str, float]:
    return {name: _regression_case(i, *spec) for i, (name, spec)
            in enumerate(REGRESSION_CASES.items())}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_linear_regression_noise_scale_within_20_percent():
    results = run_ranks(_regression_rank, 4, timeout=600)
    for name in REGRESSION_CASES:
        got = results[0][name]
        assert all(r[name] == pytest.approx(got) for r in results), name
        assert abs(got / TRUE_B - 1) <= 0.2, f"{name}: B_simple {got:.2f} vs truth {TRUE_B}"


# -- 2. the transformer: the measured norms are the single-device model's, exactly ------------

GLOBAL_BATCH, SEQ = 8, 16
N_TOKENS = GLOBAL_BATCH * SEQ


def _cfg(dp: int, tp: int, pp: int, m: int, tie: bool = False, **parallel: Any) -> Config:
    return make_config(
        None, model=dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                         tie_embeddings=tie),
        data=dict(seq_len=SEQ), parallel=dict(dp=dp, tp=tp, pp=pp, **parallel),
        train=dict(lr=1e-3, warmup_steps=0, steps=1, grad_accum=m,
                   micro_batch_size=GLOBAL_BATCH // dp // m))


LAYOUTS: dict[str, tuple[Config, bool]] = {  # config, read per micro-batch
    "(2,2,1) sp ddp": (_cfg(2, 2, 1, m=2, sequence_parallel=True), False),
    # 4 micro-batches of 1 sequence: B_small (1) and the 1/m scaling (4) tell m from b apart
    "(2,1,2) zero2 tied": (_cfg(2, 1, 2, m=4, tie=True, zero_stage=2), True),
    "(2,2,1) zero3": (_cfg(2, 2, 1, m=2, zero_stage=3), True),
    "(2,1,2) bfs v2 zero3": (_cfg(2, 1, 2, m=2, schedule="bfs", virtual_stages=2,
                                  zero_stage=3), False),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _layout_rank(names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        cfg = LAYOUTS[name][0]
        topo = Topology.build(cfg.parallel)
        executor = build_executor(cfg, topo, torch.device("cpu"))
        model = executor.model
        m = cfg.train.grad_accum
        executor.forward_backward(rank_micro_batches(*_batch(), topo, m))
        executor.clip_grad_norm_(0.0)
        partial = {model.chunks[c].reference_name(n) for c, n, _ in model.named_chunk_parameters()
                   if model.partial_before_reduction(c, n)}
        every: list[set[str]] = [set()] * dist.get_world_size()
        dist.all_gather_object(every, partial)
        out[name] = (executor.last_noise, set().union(*every))
    return out


def _sq_norm(cfg: Config, x: torch.Tensor, y: torch.Tensor, skip: set[str]) -> float:
    model = build_model(cfg.model, cfg.train.seed)
    cross_entropy(model(x), y).backward()
    return sum(float(p.grad.double().pow(2).sum()) for n, p in model.named_parameters()
               if n not in skip)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_transformer_norms_are_the_single_device_models():
    names = list(LAYOUTS)
    results = run_ranks(_layout_rank, 4, args=(names,), timeout=600)
    x, y = _batch()
    for name in names:
        cfg, per_mb = LAYOUTS[name]
        record, skip = results[0][name]
        dp, m = cfg.parallel.dp, cfg.train.grad_accum
        # one step: |G|² may come out < 0. Every rank computes the estimate from the same
        # all-reduced sums (gloo hands each rank the same bits) by the same few double
        # operations: equal up to a few ulps, hence 1e-12
        for key in ("grad_sq_est", "grad_trace_est"):
            assert all(r[name][0][key] == pytest.approx(record[key], rel=1e-12)
                       for r in results), f"{name}: ranks disagree on {key}"
        if cfg.parallel.sequence_parallel:
            assert "layers.0.attention_norm.weight" in skip and "norm.weight" in skip
        elif cfg.model.tie_embeddings:
            assert skip == {"tok_embeddings.weight"}
        else:
            assert not skip
        pieces = dp * (m if per_mb else 1)
        b_small, b_big = GLOBAL_BATCH // pieces, GLOBAL_BATCH
        want_small = sum(_sq_norm(cfg, xs, ys, skip) for xs, ys in
                         zip(x.chunk(pieces), y.chunk(pieces), strict=True)) / pieces
        want_big = _sq_norm(cfg, x, y, skip)
        g_sq, trace = record["grad_sq_est"], record["grad_trace_est"]
        got_small, got_big = g_sq + trace / b_small, g_sq + trace / b_big
        assert_close_summed(got_small, want_small, terms=2 * N_TOKENS,
                            msg=f"{name} |G_small|²")
        assert_close_summed(got_big, want_big, terms=2 * N_TOKENS, msg=f"{name} |G_big|²")
        # The estimates are linear in the two squared norms: each norm's summation bound,
        # carried through the estimator's coefficients, bounds them (the differences amplify
        # the norms' round-off by up to B_big/(B_big - B_small)).
        e_small = summation_bound(2 * N_TOKENS, want_small)
        e_big = summation_bound(2 * N_TOKENS, want_big)
        want_g, want_t = unbiased_estimates(want_small, want_big, b_small, b_big)
        assert abs(g_sq - want_g) <= (b_big * e_big + b_small * e_small) / (b_big - b_small), name
        assert abs(trace - want_t) <= (e_small + e_big) / (1 / b_small - 1 / b_big), name


# -- the trainer: metrics, summary, the one-line notes -------------------------------------------


def _train_cfg(data: str, out, dp: int, steps: int) -> Config:
    return make_config("tiny", overrides=[f"data.path={data}", "data.seq_len=16",
                                          "data.val_tokens=512"],
                       parallel=dict(dp=dp),
                       train=dict(steps=steps, warmup_steps=2, lr=1e-3, eval_interval=0,
                                  sample_tokens=0, micro_batch_size=4, out_dir=str(out)))


def test_dp1_says_in_one_line_that_it_needs_dp2(tiny_data, tmp_path, capsys):
    from tessera.metrics import read_metrics
    from tessera.trainer import run

    run(_train_cfg(tiny_data, tmp_path, dp=1, steps=2), progress=False)
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if "noise scale" in ln] == [
        "noise scale: needs dp >= 2 (one replica has no second batch size to compare)"]
    assert not any("noise_scale" in r for r in read_metrics(tmp_path / "metrics.jsonl"))


def test_critical_batch_warning_once_settled_and_strictly_above(capsys):
    """``trainer.critical_batch_warning`` at global batch 8: nothing before SETTLED_STEPS
    steps of averaging, at B_simple = 8 (the batch is not above it) or without a B_simple;
    then rank 0 alone prints the line, once."""
    from types import SimpleNamespace

    from tessera.noise_scale import SETTLED_STEPS
    from tessera.trainer import critical_batch_warning

    cfg = make_config("tiny", parallel=dict(dp=2), train=dict(micro_batch_size=2, grad_accum=2))

    def warn(steps: int, scale: float | None, warned: bool = False, rank: int = 0) -> bool:
        run = SimpleNamespace(cfg=cfg, topo=SimpleNamespace(rank=rank),
                              executor=SimpleNamespace(noise=SimpleNamespace(steps=steps)))
        return critical_batch_warning(run, {"noise_scale": scale}, warned)

    assert not warn(SETTLED_STEPS - 1, 2.0)
    assert not warn(SETTLED_STEPS, 8.0)
    assert not warn(SETTLED_STEPS, None)
    assert warn(SETTLED_STEPS, 2.0, rank=1)  # every rank knows; only rank 0 prints
    assert capsys.readouterr().out == ""
    assert warn(SETTLED_STEPS, 7.5)
    assert warn(SETTLED_STEPS + 1, 2.0, warned=True)
    assert capsys.readouterr().out == critical_batch_line(8, 7.5) + "\n"


def _train_rank(cfg: Config) -> str:
    import contextlib
    import io

    from tessera.trainer import train

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(cfg, progress=False)
    return printed.getvalue()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp2_run_logs_the_noise_scale(tiny_data, tmp_path):
    """Every step's record holds the estimates; the summary states the last B_simple; the
    critical-batch warning comes once, after the settled steps, exactly when B_simple is
    below the global batch."""
    from tessera.metrics import read_metrics
    from tessera.noise_scale import SETTLED_STEPS

    steps = SETTLED_STEPS + 5
    out = run_ranks(_train_rank, 2, args=(_train_cfg(tiny_data, tmp_path, 2, steps),),
                    timeout=600)[0]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(rows) == steps
    assert all({"noise_scale", "noise_scale_tokens", "grad_sq_est", "grad_trace_est"} <= r.keys()
               for r in rows)
    last = rows[-1]
    assert last["grad_sq_est"] > 0  # after 55 steps of averaging (one step's may be < 0)
    assert last["noise_scale"] == pytest.approx(last["grad_trace_est"] / last["grad_sq_est"])
    assert last["noise_scale_tokens"] == pytest.approx(16 * last["noise_scale"])
    summary = [ln for ln in out.splitlines() if ln.startswith("noise scale B_simple")]
    assert summary == [f"noise scale B_simple = tr(Σ)/|G|² = {last['noise_scale']:,.0f} "
                       f"sequences ({last['noise_scale_tokens']:,.0f} tokens), last step's "
                       f"moving average; global batch 8"]
    saved = json.loads((tmp_path / "summary.json").read_text())["noise_scale"]
    assert saved == {k: last[k] for k in saved} and len(saved) == 4
    below = [r for r in rows if r["step"] >= SETTLED_STEPS and r["noise_scale"] is not None
             and r["noise_scale"] < 8]
    assert below  # the tiny corpus settles near 2 sequences: the warning path runs
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning: global batch 8")]
    assert warnings == [critical_batch_line(8, below[0]["noise_scale"])]


# -- checkpoints: the moving averages are saved and continue on resume ---------------------------

RESUME_STEPS, SAVED_AT = 6, 3
NOISE_FIELDS = ("noise_scale", "noise_scale_tokens", "grad_sq_est", "grad_trace_est")


def _ckpt_cfg(data: str, out, dp: int, parallel: dict | None = None, **train: Any) -> Config:
    """_train_cfg's run of RESUME_STEPS steps, saved every SAVED_AT."""
    return make_config("tiny", overrides=[f"data.path={data}", "data.seq_len=16",
                                          "data.val_tokens=512"],
                       parallel=dict(dp=dp, **(parallel or {})),
                       train=dict(steps=RESUME_STEPS, warmup_steps=2, lr=1e-3, eval_interval=0,
                                  sample_tokens=0, micro_batch_size=4, out_dir=str(out),
                                  checkpoint_interval=SAVED_AT, keep_checkpoints=0) | train)


_DROP = object()


def _strip_noise_state(src, dst, state: Any = _DROP) -> None:
    """A copy of checkpoint `src` as written before the noise scale was saved: extra.json
    without ``noise_scale`` (or, given `state`, with it set to that), the manifest's size and
    checksum of it updated."""
    import shutil

    from tessera.checkpoint_manifest import _sha256

    shutil.copytree(src, dst)
    extra = json.loads((dst / "extra.json").read_text())
    if state is _DROP:
        del extra["noise_scale"]
    else:
        extra["noise_scale"] = state
    (dst / "extra.json").write_text(json.dumps(extra, indent=1))
    meta = json.loads((dst / "meta.json").read_text())
    meta["files"]["extra.json"] = {"sha256": _sha256(dst / "extra.json"),
                                   "bytes": (dst / "extra.json").stat().st_size}
    (dst / "meta.json").write_text(json.dumps(meta, indent=1))


def _resume_rank(data: str, root: str) -> dict[str, str]:
    """Run a (dp 2, 6 steps, saved at 3); then from a's step 3: b (the same layout), old (a
    copy without the noise-scale state) and zero2 (ZeRO-2, 2 micro-batches of 2: B_small 2
    instead of 8, the same global batch). What each run printed."""
    from pathlib import Path

    from tessera.checkpoint import step_dir

    root_dir = Path(root)
    saved = step_dir(root_dir / "a" / "checkpoints", SAVED_AT)
    printed = {"a": _train_rank(_ckpt_cfg(data, root_dir / "a", 2))}
    if dist.get_rank() == 0:
        _strip_noise_state(saved, root_dir / "old-checkpoint")
    dist.barrier()
    for name, resume, extra in [
            ("b", saved, {}), ("old", root_dir / "old-checkpoint", {}),
            ("zero2", saved, dict(parallel=dict(zero_stage=2), grad_accum=2,
                                  micro_batch_size=2))]:
        printed[name] = _train_rank(_ckpt_cfg(data, root_dir / name, 2, resume=str(resume),
                                              **extra))
    return printed


def _noise_rows(out) -> dict[int, dict[str, float | None]]:
    from tessera.metrics import read_metrics

    return {r["step"]: {k: r.get(k) for k in NOISE_FIELDS}
            for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def _saved_noise(out, step: int = RESUME_STEPS) -> dict | None:
    from tessera.checkpoint import step_dir

    return json.loads((step_dir(out / "checkpoints", step) / "extra.json").read_text())[
        "noise_scale"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_continues_the_moving_averages(tiny_data, tmp_path):
    """dp 2, 6 steps vs 3 steps + resume to 6: the same noise-scale records at steps 4-6, bit
    for bit (the averages' state travels as JSON numbers, which keep every bit, and the resumed
    steps compute the same norms: tests/test_checkpoint.py). A checkpoint without the state (an
    older one) starts the averages over, in one printed line: its step-4 record is that step's
    unsmoothed estimate. Another measuring layout continues them; dp 1 drops them."""
    from tessera.trainer import run

    printed = run_ranks(_resume_rank, 2, args=(tiny_data, str(tmp_path)), timeout=600)[0]
    a, b, old = (_noise_rows(tmp_path / n) for n in ("a", "b", "old"))
    assert sorted(a) == list(range(1, RESUME_STEPS + 1))
    assert all(r["grad_sq_est"] is not None for r in a.values())
    assert b == {s: a[s] for s in range(SAVED_AT + 1, RESUME_STEPS + 1)}
    assert _saved_noise(tmp_path / "a", SAVED_AT)["steps"] == SAVED_AT
    assert _saved_noise(tmp_path / "b") == _saved_noise(tmp_path / "a")
    assert not [ln for ln in printed["b"].splitlines() if ln.startswith("noise scale:")]
    # `checkpoint inspect` states the last record's B_simple from the saved averages.
    from tessera.checkpoint import describe, step_dir

    shown = describe(step_dir(tmp_path / "a" / "checkpoints", RESUME_STEPS))
    assert (f"noise scale: B_simple ≈ {a[RESUME_STEPS]['noise_scale']:.4g} sequences after "
            f"{RESUME_STEPS} measured steps") in "\n".join(shown)

    # The older checkpoint: step 4's raw estimate, recovered from a's averages at steps 3
    # and 4 (avg_k·(1 − d^k) = d·avg_{k−1}·(1 − d^(k−1)) + (1 − d)·raw_k).
    d, k = EMA_DECAY, SAVED_AT + 1
    for key in ("grad_sq_est", "grad_trace_est"):
        raw = (a[k][key] * (1 - d**k) - d * a[k - 1][key] * (1 - d ** (k - 1))) / (1 - d)
        scale = max(abs(a[k][key]), abs(a[k - 1][key])) / (1 - d)
        # the recovery subtracts two terms of size `scale` in double: a few ulps of it
        assert old[k][key] == pytest.approx(raw, rel=0, abs=1e-12 * scale), key
        assert old[k][key] != a[k][key]
    assert _saved_noise(tmp_path / "old")["steps"] == RESUME_STEPS - SAVED_AT
    assert [ln for ln in printed["old"].splitlines() if ln.startswith("noise scale:")] == [
        f"noise scale: {tmp_path / 'old-checkpoint'} holds no moving averages (not measured "
        f"there, or saved before they were): they start over at step {k}"]

    # Another layout that measures (ZeRO-2, B_small 2): the averages continue.
    assert _saved_noise(tmp_path / "zero2")["steps"] == RESUME_STEPS
    assert all(r["grad_sq_est"] is not None for r in _noise_rows(tmp_path / "zero2").values())

    # dp 1 cannot measure: no noise-scale records, and its checkpoints hold no averages.
    run(_ckpt_cfg(tiny_data, tmp_path / "dp1", 1, grad_accum=2,
                  resume=str(step_dir(tmp_path / "a" / "checkpoints", SAVED_AT))),
        progress=False)
    assert all(v is None for r in _noise_rows(tmp_path / "dp1").values() for v in r.values())
    assert _saved_noise(tmp_path / "dp1") is None
    assert "noise scale: not measured" in describe(
        step_dir(tmp_path / "dp1" / "checkpoints", RESUME_STEPS))
