"""Layout-free checkpoints: train in layout A, save, resume in layout B.

Checks per pair (A → B), against the run that never stopped and against independent code:

1. **The state moves exactly.** Layout B loads A's step-4 checkpoint (each rank reading only the
   boxes it holds) and saves it again at once; consolidated offline, every tensor of the two
   checkpoints (weights, fp32 masters, both Adam moments, step counts) is equal bit for bit.
   Resharding copies numbers, it computes nothing: tolerance 0. And the weights layout B holds
   after loading, gathered by ``full_state_dict`` (all-gathers over tp, dp shards and pp),
   equal the offline consolidation of A's checkpoint (``load_model``: eval, generate, export).
2. **Training continues.** The resumed run's losses and gradient norms at steps 5-8 equal the
   uninterrupted run's in A within ``assert_curves_close``: step k after the resume within the
   summation bound of k global batches of tokens (G·T = 8·16 = 128 per step). The runs start
   step 5 from bit-identical state (check 1) and differ only in how layout B orders the sums of
   each step (other ranks, shards, micro-batches), whose round-off moves the weights a little
   more every step (tessera.testing explains why k·terms). Measured: at most 0.15% of the
   bound on AVX-512, default and AVX2 kernels; a swapped TP shard uses 1490x.

The vocabulary (257) is padded to 258 under tp 2, so TP boxes are clipped to the reference
shape and ZeRO ranges cut the embedding at odd rows. The global batch (dp × micro-batches ×
micro-batch size = 8 sequences) is the same in every layout, so B continues on exactly the
samples A would have seen next. Runs: one 2-rank job (the 2-rank A's, then the B's resuming
them), one process (A, and B from dp2), one 4-rank job (the 4-rank A's, then the B's).
Precision changes (state only) and a tied head on another pipeline rank are covered too.

Mixture of experts (its own test, 4 jobs of 1, 4, 2 and 1 ranks): ep2 → 1 process,
1 process → ep2 × edp2 ZeRO-1 (expert units sharded over edp) and ep2 × pp2 → ep2, each with
checks 1 and 2; the routing biases are state like the weights. And ep2 → ep2 continues
exactly (tolerance 0: losses, gradient norms and the whole step-8 checkpoint).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tessera.checkpoint import (
    find,
    load_model,
    load_tensors,
    read_manifest,
    step_dir,
)
from tessera.checkpoint_read import read_metadata
from tessera.config import Config
from tessera.config_io import make_config
from tessera.metrics import read_metrics
from tessera.testing import assert_curves_close, run_ranks

STEPS, SAVED = 8, 4
GLOBAL_BATCH, SEQ, MBS = 8, 16, 2
TOKENS = GLOBAL_BATCH * SEQ

TOP_K = 2
MOE = {"model.moe_experts": 4, "model.moe_top_k": TOP_K, "model.moe_ffn_hidden": 32,
       "model.moe_router_bias_rate": 0.01}

LAYOUTS: dict[str, dict] = {
    "1 process": {},
    "dp2": dict(dp=2),
    "dp2 zero3": dict(dp=2, zero_stage=3),
    "tp2 pp2": dict(tp=2, pp=2, schedule="1f1b"),
    "dp2 tp2": dict(dp=2, tp=2),
    "dp4 zero1": dict(dp=4, zero_stage=1),
    # ZeRO ranges over TP shards: boxes cut on the TP-local shape, then offset into the global.
    "dp2 tp2 zero3": dict(dp=2, tp=2, zero_stage=3),
    "pp2 interleaved v2": dict(pp=2, schedule="interleaved", virtual_stages=2),
    "pp2 1f1b": dict(pp=2, schedule="1f1b"),
    "cp2": dict(cp=2, cp_method="ring"),
    # A tied head on the last pipeline rank is a copy of the embedding: loaded, never written.
    "pp2 tied": {"pp": 2, "schedule": "1f1b", "model.tie_embeddings": True},
    "dp2 zero3 tied": {"dp": 2, "zero_stage": 3, "model.tie_embeddings": True},
    "dp2 zero2 bf16": {"dp": 2, "zero_stage": 2, "train.precision": "bf16"},
    "dp4 zero3 bf16": {"dp": 4, "zero_stage": 3, "train.precision": "bf16"},
    # Mixture of experts (MOE: 4 experts of every block, routing biases that move each step).
    "moe 1 process": dict(MOE),
    "moe dp2 ep2": {"dp": 2, "ep": 2, **MOE},
    "moe dp2 ep2 pp2": {"dp": 2, "ep": 2, "pp": 2, "schedule": "1f1b", **MOE},
    # ep2 x edp2: ZeRO-1's expert units are sharded over edp, ranges cut into boxes.
    "moe dp4 ep2 zero1": {"dp": 4, "ep": 2, "zero_stage": 1, **MOE},
}

PAIRS = [("dp2", "1 process"), ("1 process", "dp2 tp2"), ("dp2 zero3", "tp2 pp2"),
         ("tp2 pp2", "dp4 zero1"), ("pp2 interleaved v2", "pp2 1f1b"), ("cp2", "dp2"),
         ("pp2 tied", "dp2 zero3 tied"), ("dp2 tp2 zero3", "dp4 zero1")]

MOE_PAIRS = [("moe dp2 ep2", "moe 1 process"), ("moe 1 process", "moe dp4 ep2 zero1"),
             ("moe dp2 ep2 pp2", "moe dp2 ep2")]
MOE_TERMS = TOKENS * TOP_K
"""An expert weight's gradient adds one term per assignment routed to it: at most G·T·k per
step (dense gradients add G·T), so the MoE curves are bounded over k times the tokens."""

PRECISION_PAIRS = [("dp2 zero2 bf16", "1 process"), ("dp2", "dp4 zero3 bf16")]
"""Another training precision keeps the fp32 masters: state moved only (a bf16 run's losses
are not an fp32 run's within fp32 round-off)."""


def _world(layout: str) -> int:
    p = LAYOUTS[layout]
    return p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1)


def _cfg(data: str, out: Path, layout: str, **train) -> Config:
    parallel = LAYOUTS[layout]
    dp = parallel.get("dp", 1)
    overrides = [f"data.path={data}", f"data.seq_len={SEQ}", "data.val_tokens=64",
                 "model.d_model=32", "model.n_layers=4", f"model.max_seq_len={SEQ}",
                 # 257 rows: tp 2 pads the vocabulary to 258, a padding row saves must clip
                 "model.vocab_size=257",
                 f"train.steps={STEPS}", f"train.checkpoint_interval={SAVED}",
                 "train.keep_checkpoints=0", "train.sample_tokens=0", "train.eval_interval=0",
                 "train.warmup_steps=2", f"train.micro_batch_size={MBS}",
                 f"train.grad_accum={GLOBAL_BATCH // (dp * MBS)}", f"train.out_dir={out}"]
    overrides += [f"{k}={v}" if "." in k else f"parallel.{k}={v}"
                  for k, v in {"dp": dp, **parallel}.items()]
    overrides += [f"train.{k}={v}" for k, v in train.items()]
    return make_config("tiny", overrides=overrides)


def _dir(root: str, layout: str) -> Path:
    return Path(root) / layout.replace(" ", "_")


def _train_a(data: str, root: str, layout: str) -> None:
    from tessera.trainer import train

    train(_cfg(data, _dir(root, layout), layout), progress=False)


def _resume_b(data: str, root: str, a: str, b: str) -> dict[str, torch.Tensor]:
    """Layout B: resume A's step-4 checkpoint and train on; and load it and save it again at
    once (under <B dir>/moved), for the exact comparison. Returns the loaded weights as
    ``full_state_dict`` gathers them in layout B."""
    from tessera.trainer import train

    ckpt = step_dir(_dir(root, a) / "checkpoints", SAVED)
    out = _dir(root, a) / f"to_{b.replace(' ', '_')}"
    train(_cfg(data, out, b, resume=str(ckpt)), progress=False)
    return _load_and_save(_cfg(data, out / "moved", b), ckpt, out / "moved")


def _load_and_save(cfg: Config, ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """What the trainer does up to its first step (parallelize, optimizer, scheduler, loader,
    restore), then a save: the checkpoint as layout B holds it. Returns the weights gathered
    by ``full_state_dict`` (an independent path: all-gathers over tp, dp shards and pp)."""
    import torch.distributed as dist

    from tessera import checkpoint
    from tessera.data.loader import BatchLoader, TokenDataset
    from tessera.optim import lr_lambda
    from tessera.parallelize import parallelize
    from tessera.step import Executor
    from tessera.topology import Topology

    topo = Topology.build(cfg.parallel)
    torch.manual_seed(cfg.train.seed)
    executor = Executor(parallelize(cfg, topo, torch.device("cpu")))
    optimizer = executor.optimizer(cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    loader = BatchLoader(TokenDataset(cfg.data.path).train, cfg.data.seq_len,
                         cfg.train.micro_batch_size, cfg.train.grad_accum, topo.coords()["dp"],
                         topo.dp, cfg.data.seed)
    checkpoint.verify(ckpt, cfg, topo.world_size)
    step = checkpoint.restore(ckpt, cfg, executor, optimizer, scheduler, loader)
    checkpoint.save(out, step, cfg, executor, optimizer, scheduler, loader, topo.rank,
                    topo.world_size)
    gathered = executor.full_state_dict()
    dist.barrier()
    return gathered


def _job(data: str, root: str, trains: list[str], resumes: list[tuple[str, str]],
         moves: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    for layout in trains:
        _train_a(data, root, layout)
    gathered = {(a, b): _resume_b(data, root, a, b) for a, b in resumes}
    for a, b in moves:
        out = _dir(root, a) / f"to_{b.replace(' ', '_')}" / "moved"
        _load_and_save(_cfg(data, out, b), step_dir(_dir(root, a) / "checkpoints", SAVED), out)
    return gathered


def _records(out: Path) -> dict[int, tuple[float, float]]:
    rows = read_metrics(out / "metrics.jsonl")
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    read_manifest(path)
    keys = [k for k in read_metadata(path).state_dict_metadata if not k.startswith("rng.")]
    return load_tensors(path, keys)


def _check_pair(root: Path, a: str, b: str, gathered: dict[str, torch.Tensor],
                terms_per_step: int = TOKENS) -> None:
    label = f"{a} -> {b}"
    # The offline consolidation (tessera eval / generate / checkpoint export) of A's checkpoint
    # equals what layout B holds after loading it, gathered the old way.
    _, consolidated, _ = load_model(step_dir(_dir(str(root), a) / "checkpoints", SAVED))
    assert consolidated.keys() == gathered.keys(), label
    for key, value in consolidated.items():
        torch.testing.assert_close(gathered[key], value, rtol=0, atol=0, msg=f"{label}: {key}")
    out = _dir(str(root), a) / f"to_{b.replace(' ', '_')}"
    saved = _all_tensors(step_dir(_dir(str(root), a) / "checkpoints", SAVED))
    moved = _all_tensors(find(out / "moved"))
    assert saved.keys() == moved.keys(), label
    for key, value in saved.items():
        torch.testing.assert_close(moved[key], value, rtol=0, atol=0, msg=f"{label}: {key}")
    ra, rb = _records(_dir(str(root), a)), _records(out)
    assert sorted(rb) == list(range(SAVED + 1, STEPS + 1)), label
    for what, i in (("loss", 0), ("grad norm", 1)):
        assert_curves_close([rb[s][i] for s in sorted(rb)],
                            [ra[s][i] for s in sorted(rb)], terms_per_step=terms_per_step,
                            msg=f"{label} {what}")
    meta = json.loads((step_dir(out / "checkpoints", STEPS) / "meta.json").read_text())
    assert meta["layout"]["world_size"] == _world(b), label


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_in_another_layout(tiny_data, tmp_path):
    # Ordered so every A exists before a B resumes it: 2 ranks, then 1, then 4.
    gathered = {}
    sources = {a for a, _ in PAIRS + PRECISION_PAIRS}
    for world in (2, 1, 4):
        trains = [a for a in LAYOUTS if a in sources and _world(a) == world]
        resumes = [(a, b) for a, b in PAIRS if _world(b) == world]
        moves = [(a, b) for a, b in PRECISION_PAIRS if _world(b) == world]
        gathered |= run_ranks(_job, world, args=(tiny_data, str(tmp_path), trains, resumes,
                                                 moves), timeout=600)[0]
    for a, b in PAIRS:
        _check_pair(tmp_path, a, b, gathered[(a, b)])
    for a, b in PRECISION_PAIRS:
        _check_precision_move(tmp_path, a, b)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_resume_in_another_layout(tiny_data, tmp_path):
    """Experts (boxes of the stacked (E, ...) tensors, whatever the ep degree) and routing
    biases move between ep, pp, dp and ZeRO layouts bit for bit; training continues within the
    bound over the assignments (MOE_TERMS). Jobs ordered so every A exists before its B."""
    jobs = [(1, ["moe 1 process"], []),
            (4, ["moe dp2 ep2 pp2"], [("moe 1 process", "moe dp4 ep2 zero1")]),
            (2, ["moe dp2 ep2"], [("moe dp2 ep2 pp2", "moe dp2 ep2"),
                                  ("moe dp2 ep2", "moe dp2 ep2")]),
            (1, [], [("moe dp2 ep2", "moe 1 process")])]
    gathered = {}
    for world, trains, resumes in jobs:
        gathered |= run_ranks(_job, world, args=(tiny_data, str(tmp_path), trains, resumes,
                                                 []), timeout=600)[0]
    for a, b in MOE_PAIRS:
        _check_pair(tmp_path, a, b, gathered[(a, b)], terms_per_step=MOE_TERMS)
    # The same layout continues exactly: the same kernels on the same numbers in the same
    # order (tolerance 0), experts and routing biases included.
    a = _dir(str(tmp_path), "moe dp2 ep2")
    ra, rb = _records(a), _records(a / "to_moe_dp2_ep2")
    assert sorted(rb) == list(range(SAVED + 1, STEPS + 1))
    assert all(rb[s] == ra[s] for s in rb), (ra, rb)
    ends = [_all_tensors(step_dir(d / "checkpoints", STEPS)) for d in (a, a / "to_moe_dp2_ep2")]
    assert ends[0].keys() == ends[1].keys()
    for key, value in ends[0].items():
        assert torch.equal(ends[1][key], value), key
    # The routing biases moved in training (else restoring them would prove nothing), and
    # the experts of an ep2 run were written as one box per ep rank.
    ckpt = step_dir(_dir(str(tmp_path), "moe dp2 ep2") / "checkpoints", SAVED)
    metadata = read_metadata(ckpt).state_dict_metadata
    bias = _all_tensors(ckpt)["buffer.layers.1.feed_forward.expert_bias"]
    assert bias.abs().sum() > 0
    w1 = metadata["model.layers.1.feed_forward.experts.w1"]
    assert tuple(w1.size) == (4, 32, 32)
    assert sorted(tuple(c.offsets) for c in w1.chunks) == [(0, 0, 0), (2, 0, 0)]


def test_moe_inspect_and_export(tiny_data, tmp_path):
    """`tessera checkpoint inspect` lists an MoE checkpoint's experts and routing biases;
    `export --format torch` writes a state dict the reference MoE model loads strictly, equal
    to ``load_model``'s; HF export (no Llama layout for experts) is refused with the way out."""
    from typer.testing import CliRunner

    from cli_errors import cli_error
    from tessera.cli import app
    from tessera.model import Transformer

    cfg = _cfg(tiny_data, tmp_path / "a", "moe 1 process")
    cfg.train.steps = 1
    cfg.train.checkpoint_interval = 1
    from tessera.trainer import train

    train(cfg, progress=False)
    ckpt = step_dir(tmp_path / "a" / "checkpoints", 1)
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(ckpt)])
    assert result.exit_code == 0, result.output
    assert "model.layers.3.feed_forward.experts.w2" in result.output
    assert "(4, 32, 32)" in result.output
    assert "buffer.layers.0.feed_forward.expert_bias" in result.output
    result = CliRunner().invoke(app, ["checkpoint", "export", str(ckpt), "--to",
                                      str(tmp_path / "pt"), "--format", "torch"])
    assert result.exit_code == 0, result.output
    exported = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    model_cfg, state, _ = load_model(ckpt)
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], state[k]) for k in state)
    Transformer(model_cfg).load_state_dict(exported, strict=True)
    line = cli_error(["checkpoint", "export", str(ckpt), "--to", str(tmp_path / "hf")])
    assert "mixture-of-experts" in line and "--format torch" in line


def _check_precision_move(root: Path, a: str, b: str) -> None:
    """fp32 masters survive a change of training precision bit for bit: bf16 -> fp32 makes
    the masters the weights, fp32 -> bf16 makes the weights the masters (and the bf16 weights
    their rounding); Adam's moments and steps move unchanged."""
    label = f"{a} -> {b}"
    saved = _all_tensors(step_dir(_dir(str(root), a) / "checkpoints", SAVED))
    moved = _all_tensors(find(_dir(str(root), a) / f"to_{b.replace(' ', '_')}" / "moved"))
    refs = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    for ref in refs:
        fp32_a = saved.get(f"master.{ref}", saved[f"model.{ref}"])
        fp32_b = moved.get(f"master.{ref}", moved[f"model.{ref}"])
        assert fp32_a.dtype == fp32_b.dtype == torch.float32, (label, ref)
        assert torch.equal(fp32_b, fp32_a), (label, ref)
        assert torch.equal(moved[f"model.{ref}"],
                           fp32_a.to(moved[f"model.{ref}"].dtype)), (label, ref)
    optim = [k for k in saved if k.startswith("optim.")]
    assert optim and sorted(optim) == sorted(k for k in moved if k.startswith("optim.")), label
    for key in optim:
        assert torch.equal(moved[key], saved[key]), (label, key)


def test_flat_ranges_cut_into_boxes():
    """Every flat range of a row-major tensor becomes boxes that hold exactly its elements, in
    order, each a contiguous run (ZeRO shards cut parameters anywhere, mid-row included)."""
    from tessera.sharded_state import flat_range_boxes

    for shape in [(7,), (3, 5), (4, 3, 2), (2, 3, 4, 2)]:
        n = math.prod(shape)
        flat = torch.arange(n)
        full = flat.view(shape)
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                boxes = flat_range_boxes(shape, lo, hi)
                assert len(boxes) <= 2 * (len(shape) - 1) + 1, (shape, lo, hi)
                got = torch.cat([full[tuple(slice(o, o + s) for o, s in zip(off, size,
                                                                            strict=True))]
                                 .flatten() for off, size in boxes])
                assert torch.equal(got, flat[lo:hi]), (shape, lo, hi, boxes)
