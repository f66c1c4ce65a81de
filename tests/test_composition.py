"""The composition parity matrix: every layout of issue 11 against the single-device model.

Each layout runs 10 AdamW steps (clipping active) through ``parallelize`` + ``Executor`` on
gloo ranks, on the same global batches as one process running the reference model, and must
give the reference's first-step gradients (every parameter, gathered by reference name), the
loss and global gradient norm of every step, and the final parameters.

Tolerances (fp32; ε = 2⁻²⁴ ≈ 6e-8, unit round-off):

- First-step gradients: each element is a sum over the N = 8·16 = 128 tokens of the batch
  that a layout adds in another order (micro-batches, dp means, TP partial sums, pipeline
  hand-offs): ``tessera.testing.assert_close_summed(terms=N)``, i.e. 4·N·ε·max|g_ref| ≈
  3e-5·max|g_ref| per tensor (Higham's n·ε·Σ|terms|, the tensor's largest magnitude as its
  scale). Measured: ≤ 1e-7·max|g|. A real bug (a missing dp half, a gradient scaled by 2, a
  TP piece not summed) is off by ≥ 10% of max|g|.
- Loss and grad norm per step: a mean over N terms of size O(1) summed in another order
  (≤ N·ε ≈ 8e-6 relative) plus the parameter differences below fed through; bound 1e-5
  relative, measured ≤ 2e-7.
- Final parameters: Adam divides each update by √v, so an element with a tiny gradient turns
  an ε-level difference into a visible one. Each step moves an element by at most ~lr = 1e-3;
  bound 5e-5 absolute = 5% of one such step, measured ≤ 8e-6 after 10 steps. (lr = 1e-3: at
  1e-2 this learnable data makes Adam amplify rounding chaotically, 4e-4 in every layout, DDP
  included.) Adam is invariant to gradient scale, which is why the gradients and norms above
  are checked directly.
- bf16 (parameters and gradients in bf16, fp32 masters): every weight and every activation
  between operations is rounded to bf16 (unit round-off u = 2⁻⁸), so each gradient carries
  errors of a few u times the magnitudes that flow into it. A norm gain's gradient is a sum
  over tokens that cancels to far less than those magnitudes, so a per-tensor bound scaled by
  the tensor's own max is the wrong yardstick (it failed under ATEN_CPU_CAPABILITY=default at
  2.8% while avx512 gave 1.5%). The bounds are model-wide instead: ‖g − g_ref‖ ≤ 4u·‖g_ref‖
  over all parameters (measured 1.8u on default and avx512 kernels) and every element within
  6u of the model's largest gradient (measured 2.3u); the loss within 1% and falling. These
  check the bf16 policy (masters, casts, fp32 reductions); the mechanisms' own bugs are caught
  by the fp32 entries of the same layouts, with the tight bounds above.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from tessera.config import Config, ConfigError, make_config
from tessera.data.loader import cp_shard
from tessera.layout import check_layout
from tessera.model import build_model, cross_entropy
from tessera.optim import adamw
from tessera.step import build_executor
from tessera.testing import assert_close_summed, assert_curves_close, run_ranks
from tessera.topology import Topology

STEPS, GLOBAL_BATCH, SEQ, CLIP, LR = 10, 8, 16, 0.5, 1e-3
N_TOKENS = GLOBAL_BATCH * SEQ
BF16_U = 2.0 ** -8  # bf16 unit round-off
PARAM_ATOL = 5e-5


def _cfg(dp: int = 1, tp: int = 1, pp: int = 1, m: int = 2, precision: str = "fp32",
         **parallel: Any) -> Config:
    return make_config(
        None, model=dict(d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, max_seq_len=SEQ),
        data=dict(seq_len=SEQ),
        parallel=dict(dp=dp, tp=tp, pp=pp, **parallel),
        train=dict(lr=LR, warmup_steps=0, steps=STEPS, grad_accum=m, grad_clip=CLIP,
                   micro_batch_size=GLOBAL_BATCH // dp // m, precision=precision))


MATRIX: dict[str, Config] = {
    "(2,2,2) 1f1b": _cfg(2, 2, 2, m=2, schedule="1f1b"),
    "(1,2,4) interleaved v2": _cfg(1, 2, 4, m=4, schedule="interleaved", virtual_stages=2),
    "(2,1,4) bfs v2 zero3": _cfg(2, 1, 4, m=4, schedule="bfs", virtual_stages=2, zero_stage=3),
    "(4,2,1) zero3": _cfg(4, 2, 1, m=2, zero_stage=3),
    "(2,2,2) zero1": _cfg(2, 2, 2, m=2, zero_stage=1),
    "(2,2,2) zero2": _cfg(2, 2, 2, m=2, zero_stage=2),
    "(2,2,2) zero3": _cfg(2, 2, 2, m=2, zero_stage=3),
    "(1,2,2) sp full recompute": _cfg(1, 2, 2, m=2, sequence_parallel=True, recompute="full"),
    "(2,2,2) bf16": _cfg(2, 2, 2, m=2, precision="bf16"),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (+1 mod 256 from a random start) so the loss visibly falls."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 256, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % 256
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> dict[str, Any]:
    cfg = _cfg()
    model = build_model(cfg.model, cfg.train.seed)
    opt = adamw(model.parameters(), cfg.train)
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        out["losses"].append(loss.item())
        opt.step()
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _run_layout(cfg: Config) -> dict[str, Any]:
    topo = Topology.build(cfg.parallel)
    executor = build_executor(cfg, topo, torch.device("cpu"))
    opt = executor.optimizer(cfg.train)
    dp, d, m = topo.dp, topo.coords()["dp"], cfg.train.grad_accum
    cp, c = topo.cp, topo.coords()["cp"]
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(STEPS):
        x, y = _batch(step)
        rows = slice(d * GLOBAL_BATCH // dp, (d + 1) * GLOBAL_BATCH // dp)
        opt.zero_grad(set_to_none=True)
        out["losses"].append(executor.forward_backward(
            [cp_shard(mb, c, cp) for mb in zip(x[rows].chunk(m), y[rows].chunk(m), strict=True)]))
        if step == 0:
            out["grads"] = executor.model.full_grads()
        out["norms"].append(executor.clip_grad_norm_(CLIP))
        opt.step()
    out["params"] = executor.full_state_dict()
    return out


# Context parallelism (issue 13), (dp, tp, pp, cp): each rank holds the zig-zag half of every
# sequence (SEQ = 16 = 4·2·cp tokens); same bounds (the cp ranks' losses and gradients are one
# more level of the same sums, the ring's log-sum-exp merge a few ε per block).
CP_MATRIX: dict[str, Config] = {
    "(1,2,2,2) ring": _cfg(1, 2, 2, m=2, cp=2, cp_method="ring"),
    "(2,1,2,2) allgather": _cfg(2, 1, 2, m=2, cp=2, cp_method="allgather"),
    "(2,2,1,2) ulysses zero2": _cfg(2, 2, 1, m=2, cp=2, cp_method="ulysses", zero_stage=2),
    "(1,1,4,2) ring": _cfg(1, 1, 4, m=4, cp=2, cp_method="ring"),
    # cp = 4: chunks of 2 tokens; Ulysses replicates the 2 kv heads to 4 ranks
    "(1,1,1,4) ulysses": _cfg(1, 1, 1, m=2, cp=4, cp_method="ulysses"),
    "(1,2,1,4) allgather zero1": _cfg(1, 2, 1, m=2, cp=4, cp_method="allgather", zero_stage=1),
    "(2,1,1,4) hybrid selective": _cfg(2, 1, 1, m=2, cp=4, cp_method="hybrid",
                                       recompute="selective"),
    # Megatron-SP inside each cp rank: the rank's 8 tokens split again over tp
    "(1,2,2,2) ring sp": _cfg(1, 2, 2, m=2, cp=2, cp_method="ring", sequence_parallel=True),
    # bf16 (ZeRO's flat buffers, fp32 masters): the ring's blocks in bf16, merged in fp32
    "(1,2,2,2) ring bf16": _cfg(1, 2, 2, m=2, cp=2, cp_method="ring", precision="bf16"),
}
MATRIX.update(CP_MATRIX)


def _matrix_rank(names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: _run_layout(MATRIX[name]) for name in names}


def _check(name: str, rank: int, got: dict[str, Any], ref: dict[str, Any]) -> None:
    bf16 = MATRIX[name].train.precision == "bf16"
    name = f"{name} rank {rank}"
    assert got["grads"].keys() == ref["grads"].keys(), name
    if bf16:
        diff = {k: got["grads"][k].float() - want for k, want in ref["grads"].items()}
        norm_err = sum(float(d.pow(2).sum()) for d in diff.values()) ** 0.5
        norm_ref = sum(float(w.pow(2).sum()) for w in ref["grads"].values()) ** 0.5
        assert norm_err <= 4 * BF16_U * norm_ref, f"{name} step-1 grads: ‖Δg‖ {norm_err:.3g}" \
                                                  f" > 4u·‖g‖ {4 * BF16_U * norm_ref:.3g}"
        largest = max(float(w.abs().max()) for w in ref["grads"].values())
        for k, d in diff.items():
            err = float(d.abs().max())
            assert err <= 6 * BF16_U * largest, f"{name} step-1 grad {k}: {err:.3g} > " \
                                                f"6u·{largest:.3g}"
    else:
        for k, want in ref["grads"].items():
            assert_close_summed(got["grads"][k].float(), want, terms=N_TOKENS,
                                msg=f"{name} step-1 grad {k}")
    if bf16:
        assert got["losses"] == pytest.approx(ref["losses"], rel=0.01), name
        assert got["losses"][-1] < got["losses"][0], name
        return
    # Free-running curves: step k reorders k global batches' sums (tessera.testing).
    assert_curves_close(got["losses"], ref["losses"], terms_per_step=N_TOKENS,
                        msg=f"{name} losses")
    assert_curves_close(got["norms"], ref["norms"], terms_per_step=N_TOKENS,
                        msg=f"{name} grad norms")
    assert ref["norms"][0] > CLIP  # clipping is exercised
    for k, want in ref["params"].items():
        torch.testing.assert_close(got["params"][k], want, rtol=0, atol=PARAM_ATOL,
                                   msg=f"{name} param {k}")


@pytest.fixture(scope="module")
def reference_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save(_reference(), buffer)
    return buffer.getvalue()


GROUPS = {8: [n for n, c in MATRIX.items() if c.parallel.world_size == 8 and n not in CP_MATRIX],
          4: [n for n, c in MATRIX.items() if c.parallel.world_size == 4]}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(GROUPS))
def test_every_layout_matches_the_single_device_model(world, reference_bytes):
    ref = torch.load(io.BytesIO(reference_bytes))
    assert ref["losses"][-1] < ref["losses"][0]  # the reference itself learns
    results = run_ranks(_matrix_rank, world, args=(GROUPS[world],), timeout=600)
    for rank, per_layout in enumerate(results):
        for name, got in per_layout.items():
            _check(name, rank, got, ref)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CP_MATRIX))
def test_context_parallel_layouts_match_the_single_device_model(name, reference_bytes):
    ref = torch.load(io.BytesIO(reference_bytes))
    results = run_ranks(_matrix_rank, CP_MATRIX[name].parallel.world_size, args=([name],),
                        timeout=600)
    for rank, per_layout in enumerate(results):
        _check(name, rank, per_layout[name], ref)


def test_parameter_server_with_tensor_parallelism_is_refused():
    cfg = _cfg(2, 2, 1, dp_mode="ps")
    with pytest.raises(ConfigError, match=r"^parallel.tp=2: dp_mode='ps' composes only with "
                                          r"data parallelism"):
        check_layout(cfg)


def test_the_matrix_layouts_pass_the_layout_check():
    for name, cfg in MATRIX.items():
        check_layout(cfg)
        assert cfg.parallel.world_size in GROUPS, name
