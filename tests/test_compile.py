"""Regional compilation (``train.compile``, ``tessera.parallel.compile``) against eager.

Layouts: (dp,tp,pp) = (2,2,2) 1F1B, (4,1,1) ZeRO-3 (with selective recomputation), (1,2,2)
SP with full recomputation, cp 2 ring (in bf16) and ep 2 (MoE) with torch's ``aot_eager``
backend; dp 2 ZeRO-3, dp 2 (DDP) and tp 2 SP with inductor. Each runs compiled and eager on
the same batches in the same ranks: the loss of every step and every parameter's first-step
gradient must agree, the blocks must be compiled (dynamo captured graphs), and the second
step must compile nothing. A checkpoint taken compiled resumes exactly through the trainer
(``aot_eager``).

Backends. ``aot_eager`` gives dynamo's graphs, graph breaks and guards and AOTAutograd's
forward/backward split, exactly as inductor receives them, without generating code: a layout
costs seconds. Inductor (the default backend; C++ kernels on a CPU) generates code for each
graph on each rank and builds it with g++, tens of CPU-seconds per layout, so it runs on two
ranks, on the layouts where its code meets the data-parallel and tensor-parallel machinery:
ZeRO-3, where one graph for the four blocks reads the parameters (views into the unit's flat
buffer) that the hooks gather before it and free after it, its backward graph reads them
again after the re-gather, and its gradients feed the reduce-scatter hooks; DDP, whose hooks
make each gradient a view of its bucket, into which the second micro-batch's backward graph's
gradients accumulate; tp 2 with SP, whose graphs end and start at the all-gathers and
reduce-scatters that read their outputs and feed their inputs. These also cover the
single-device model's path (three graphs: the blocks, the final norm, the compiled loss). The
pipeline, context- and expert-parallel layouts and recomputation run on ``aot_eager`` only.
The two inductor ranks share a cache directory made empty for each run (never an earlier
run's: they compile cold, as a fresh clone does): a kernel both ranks generate is built once
by g++, under a file lock the other rank waits on before it loads the library, and the DDP
layout loads the ZeRO-3 layout's graphs from the cache.

Tolerances. A compiled graph computes the same sums in another order: inductor fuses and
blocks its reductions (RMSNorm's mean over h, softmax over V, a weight gradient over the
batch's tokens) and AOTAutograd differentiates decomposed operators. Each value is a sum of at
most N = max(tokens of the global batch, vocabulary) terms per reduction, so its two
computations lie within the summation bound over N terms (``tessera.testing``): first-step
gradients per tensor with ``assert_close_summed(terms=N)``, losses per step with
``assert_curves_close(terms_per_step=N)`` (each step reorders one more batch). Bugs this
catches: a graph that drops a collective or a hook (ZeRO-3 computing on freed or stale
parameters, a missing TP all-reduce) is off by O(1) of the gradient; a stale guard that reuses
another block's graph with the wrong weights, likewise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.config_io import make_config
from tessera.testing import (
    assert_close_summed,
    assert_curves_close,
    rank_micro_batches,
    run_ranks,
)
from tessera.topology import Topology

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 2, 8, 16, 256
N_TERMS = max(GLOBAL_BATCH * SEQ, VOCAB)
"""The longest reduction any value sums (module docstring)."""


def _cfg(dp: int = 1, tp: int = 1, pp: int = 1, m: int = 2, model: dict | None = None,
         compile: bool = False, precision: str = "fp32", **parallel: Any):
    return make_config(
        None, model=dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                         vocab_size=VOCAB, **(model or {})),
        data=dict(seq_len=SEQ), parallel=dict(dp=dp, tp=tp, pp=pp, **parallel),
        train=dict(lr=1e-3, warmup_steps=0, steps=STEPS, grad_accum=m, grad_clip=0.0,
                   micro_batch_size=GLOBAL_BATCH // (dp * m), compile=compile,
                   precision=precision))


MOE = dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden=32)
LAYOUTS: dict[str, dict[str, Any]] = {
    "(2,2,2) 1f1b": dict(dp=2, tp=2, pp=2, schedule="1f1b"),
    "(4,1,1) zero3 selective": dict(dp=4, zero_stage=3, recompute="selective"),
    "(1,2,2) sp full recompute": dict(tp=2, pp=2, sequence_parallel=True, recompute="full"),
    "dp2 cp2 ring bf16": dict(dp=2, cp=2, cp_method="ring", precision="bf16"),
    "dp4 ep2 moe": dict(dp=4, ep=2, model=MOE),
    "dp2 zero3": dict(dp=2, zero_stage=3),
    "tp2 sp": dict(tp=2, sequence_parallel=True),
    "dp2": dict(dp=2),
}
LAUNCHES = {8: ["(2,2,2) 1f1b"],
            4: ["(4,1,1) zero3 selective", "(1,2,2) sp full recompute", "dp2 cp2 ring bf16",
                "dp4 ep2 moe"]}
"""The aot_eager launches: world size -> layouts."""
INDUCTOR_GRAPHS = {"dp2 zero3": 3, "dp2": 3, "tp2 sp": 9}
"""The inductor launch (two ranks, module docstring): layout -> dynamo graphs on each rank."""


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _run(layout: dict[str, Any], compile: bool) -> dict[str, Any]:
    """STEPS AdamW steps; the losses, the first step's gradients (reference names, every rank
    gathers) and, compiled, dynamo's graph count after each step, the compiled modules and
    the seconds spent compiling."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tessera.parallel.compile import compile_seconds
    from tessera.step import build_executor

    torch._dynamo.reset()  # every layout traces its own graphs, within the recompile limit
    counters.clear()
    before = compile_seconds()
    cfg = _cfg(compile=compile, **layout)
    topo = Topology.build(cfg.parallel)
    executor = build_executor(cfg, topo, torch.device("cpu"))
    opt = executor.optimizer(cfg.train)
    m = cfg.train.grad_accum
    out: dict[str, Any] = {"losses": [], "graphs": [], "compiled": sum(
        getattr(mod, "compiled", False) for chunk in executor.model.chunks.values()
        for mod in chunk.modules())}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out["losses"].append(executor.forward_backward(rank_micro_batches(*_batch(step), topo, m)))
        if step == 0:
            out["grads"] = executor.model.full_grads()
        opt.step()
        out["graphs"].append(_graphs())
    # Each recompilation of a code object records why its guards failed.
    from torch._dynamo.utils import guard_failures

    out["recompiles"] = [r for reasons in guard_failures.values() for r in reasons]
    out["compile_s"] = compile_seconds() - before
    return out


def _layouts_rank(names: list[str], backend: str = "aot_eager",
                  cache_dir: str | None = None) -> dict[str, Any]:
    import tessera.parallel.compile as compile_module

    if backend == "inductor":
        assert compile_module.BACKEND == "inductor"  # the default, as a training run has it
        if cache_dir is not None:  # the ranks' shared cache (module docstring)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    else:
        compile_module.BACKEND = backend
    return {name: (_run(LAYOUTS[name], False), _run(LAYOUTS[name], True)) for name in names}


def _check_layouts(results: list[dict[str, Any]]) -> None:
    for rank, by_layout in enumerate(results):
        for name, (eager, compiled) in by_layout.items():
            label = f"{name} rank {rank}"
            # Every block on the rank and the last chunk's final norm.
            assert compiled["compiled"] >= 1, label
            assert compiled["graphs"][0] > 0, f"{label}: nothing was compiled"
            assert compiled["graphs"][-1] == compiled["graphs"][0], (
                f"{label}: steps after the first compiled again: graphs {compiled['graphs']}")
            # Every block of a chunk (two or four here) runs the first block's graphs: a guard on
            # something per block (an id, a partial's arguments) would recompile each. The
            # only recompiles allowed are for another shape (static shapes: under tp, wo's
            # and w2's row-parallel inputs run one code with two widths).
            other = [r for r in compiled["recompiles"] if "size mismatch" not in r]
            assert other == [], f"{label}: recompiled: {other[:3]}"
            assert eager["graphs"] == [0] * STEPS, label
            assert compiled["compile_s"] > 0 and eager["compile_s"] == 0, label
            assert compiled["grads"].keys() == eager["grads"].keys(), label
            if LAYOUTS[name].get("precision") == "bf16":
                _check_bf16(label, compiled, eager)
                continue
            assert_curves_close(compiled["losses"], eager["losses"], terms_per_step=N_TERMS,
                                msg=f"{label} losses")
            for k, want in eager["grads"].items():
                assert_close_summed(compiled["grads"][k], want, terms=N_TERMS,
                                    msg=f"{label} step-1 grad {k}")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAUNCHES, reverse=True))
def test_compiled_layouts_match_eager(world):
    # A rank waits on its peers while they compile (a minute on a loaded 2-core host).
    _check_layouts(run_ranks(_layouts_rank, world, args=(LAUNCHES[world],), timeout=900,
                             collective_timeout=300))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_inductor_layouts_match_eager(tmp_path):
    """Inductor's C++ kernels on two gloo ranks (module docstring): dp 2 ZeRO-3, whose blocks
    compile as one graph reading the parameters its hooks gather and free; dp 2 with DDP's
    buckets (the same graphs: loaded from the cache); tp 2 with sequence parallelism, whose
    graphs end and start at its collectives. The checks of the aot_eager layouts, and the
    exact graph count: without tp one serves the four blocks, one the final norm and one the
    loss; the tp chunk compiles nine (its loss is the eager vocabulary-parallel one)."""
    results = run_ranks(_layouts_rank, 2, args=(list(INDUCTOR_GRAPHS), "inductor",
                                                str(tmp_path / "inductor_cache")),
                        timeout=900, collective_timeout=300)
    _check_layouts(results)
    for rank, by_layout in enumerate(results):
        for name, graphs in INDUCTOR_GRAPHS.items():
            compiled = by_layout[name][1]
            assert compiled["compiled"] == 5, f"{name} rank {rank}"  # four blocks, final norm
            assert compiled["graphs"] == [graphs] * STEPS, f"{name} rank {rank}"


def _check_bf16(label: str, compiled: dict[str, Any], eager: dict[str, Any]) -> None:
    """bf16: every activation between two operations is rounded to bf16 (u = 2⁻⁸), and a fused
    kernel keeps some of them in fp32 instead, so the two runs differ by a few u of the
    magnitudes flowing into each value, not by reordered fp32 sums. The bounds are
    tests/test_composition.py's for bf16 against fp32 (its docstring): the step-1 gradient
    model-wide, ‖Δg‖ ≤ 4u·‖g‖ and every element within 6u of the largest; the loss of step k
    within k·4u of itself."""
    u = 2.0 ** -8
    diff = [compiled["grads"][k].float() - g.float() for k, g in eager["grads"].items()]
    norm = sum(float(g.float().pow(2).sum()) for g in eager["grads"].values()) ** 0.5
    largest = max(float(g.float().abs().max()) for g in eager["grads"].values())
    assert sum(float(d.pow(2).sum()) for d in diff) ** 0.5 <= 4 * u * norm, label
    assert max(float(d.abs().max()) for d in diff) <= 6 * u * largest, label
    for k, (got, want) in enumerate(zip(compiled["losses"], eager["losses"], strict=True), 1):
        assert abs(got - want) <= k * 4 * u * abs(want), f"{label} loss step {k}"


# ---------------------------------------------------------------------------------------------
# Through the trainer: a checkpoint taken compiled resumes exactly.

def _train_cfg(data: str, out: Path, **train: Any):
    overrides = [f"data.path={data}", "data.seq_len=16", "data.val_tokens=64",
                 "model.d_model=32", "model.n_layers=2", "model.max_seq_len=16",
                 "train.steps=4", "train.checkpoint_interval=2", "train.keep_checkpoints=0",
                 "train.sample_tokens=0", "train.eval_interval=0", "train.grad_accum=2",
                 "train.micro_batch_size=4", f"train.out_dir={out}", "train.compile=true"]
    overrides += [f"train.{k}={v}" for k, v in train.items()]
    return make_config("tiny", overrides=overrides)


def _metrics(out: Path) -> dict[int, dict[str, Any]]:
    from tessera.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow
def test_compiled_checkpoint_resumes_exactly(tiny_data, tmp_path, monkeypatch):
    """Through the trainer (aot_eager, as most layouts above): a run resumed from a compiled
    run's step-2 checkpoint, compiled again, logs the same steps 3-4 (tolerance 0: the same
    graphs on the same numbers) and ends with the same model; compile_s is logged for step 1
    only (later steps compile nothing) and in summary.json."""
    import torch._dynamo

    import tessera.parallel.compile as compile_module
    from tessera.checkpoint import load_model, step_dir
    from tessera.trainer import run

    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    a, b = tmp_path / "a", tmp_path / "b"
    result = run(_train_cfg(tiny_data, a), progress=False)
    run(_train_cfg(tiny_data, b, resume=str(step_dir(a / "checkpoints", 2))), progress=False)
    ra, rb = _metrics(a), _metrics(b)
    assert ra[1]["compile_s"] > 0 and result.compile_s >= ra[1]["compile_s"]
    assert [ra[s]["compile_s"] for s in (2, 3, 4)] == [0.0] * 3, "a later step compiled"
    assert json.loads((a / "summary.json").read_text())["compile_s"] == result.compile_s
    assert sorted(rb) == [3, 4]
    for s in (3, 4):
        assert (rb[s]["loss"], rb[s]["grad_norm"]) == (ra[s]["loss"], ra[s]["grad_norm"]), s
    models = [load_model(step_dir(r / "checkpoints", 4))[1] for r in (a, b)]
    assert models[0].keys() == models[1].keys()
    for name, value in models[0].items():
        torch.testing.assert_close(models[1][name], value, rtol=0, atol=0, msg=name)


def test_a_cpu_run_without_a_cpp_compiler_is_refused_at_start_up(monkeypatch):
    from tessera.errors import ConfigError
    from tessera.preflight import check_options

    cfg = make_config("tiny", overrides=["train.compile=true"])
    check_options(cfg, "cpu")  # this machine has g++
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"train.compile=True: needs a C\+\+ compiler on a "
                                          r"CPU \(inductor builds C\+\+ kernels\)"):
        check_options(cfg, "cpu")
    check_options(cfg, "cuda")  # Triton's compiler ships with torch
