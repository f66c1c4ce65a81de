"""Tensor parallelism (Megatron) and sequence parallelism (Megatron-SP) against the reference.

Every multi-process check runs on 4 gloo ranks in one `run_ranks` call that builds several
layouts in turn: tp=4 (dp=1), tp=2 (dp=2: two independent tp groups) and tp=1 (dp=4). The
model is tiny (d_model 32, 4 heads, 2 layers, seq 16) with a vocabulary of 251 so that tp=2 and
tp=4 both pad it (to 252).

Tolerances (tessera.testing's summation bound): tensor parallelism only reassociates sums.
Row-parallel partial products over the MLP's hidden units (FFN = 96) or the attention heads
are added by an all-reduce, and the loss's sum of exponentials over the vocabulary (VOCAB =
251) is summed per shard and then across shards, a sum every logit's gradient divides by. So
logits differ from the reference by the bound over FFN terms, the loss and the gradients by
the bound over VOCAB terms, each relative to the tensor's largest magnitude; a wrong shard, a
missing collective or a double-counted replica gives O(1) errors. Initialization and gathered
state dicts are compared exactly: a shard is a copy of a slice of the same full tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dp_parity import ADAM_ROUNDINGS, Shadow
from tessera.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from tessera.model import Transformer, build_model, cross_entropy
from tessera.optim import lr_lambda
from tessera.parallel import sequence_parallel as sp
from tessera.parallel.comm import CommStats, ring_bytes_sent
from tessera.parallel.tensor_parallel import (
    ShardSpec,
    TPContext,
    f,
    g,
    gather_full,
    gather_state_dict,
    owned_grad_sq,
    param_specs,
    shard,
    sync_partial_grads,
)
from tessera.parallel.tp_plan import apply_tensor_parallel, build_tensor_parallel_model
from tessera.parallel.vocab_parallel_loss import gather_logits, vocab_parallel_cross_entropy
from tessera.step import Executor, build_executor
from tessera.testing import assert_close_summed, run_ranks, summation_error
from tessera.topology import Topology

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 251, 32, 4, 2, 16, 2
FFN = 96  # model_cfg's ffn_hidden (32 · ceil(⌊8·32/3⌋ / 32))


def model_cfg(n_kv_heads: int, tie: bool) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=LAYERS, n_heads=HEADS,
                       n_kv_heads=n_kv_heads, max_seq_len=32, tie_embeddings=tie)


def batch(seed: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def topology(dp: int, tp: int, sequence_parallel: bool) -> Topology:
    return Topology.build(ParallelConfig(dp=dp, tp=tp, sequence_parallel=sequence_parallel))


# ---------------------------------------------------------------------------------------------
# One forward/backward: logits, loss, gradients, init, state dict, norms, bytes.

# (dp, tp, n_kv_heads, tie, sequence_parallel, regather): tp in {4, 2, 1}; kv heads split
# (kv >= tp) and replicated (kv < tp); tied and untied; SP with and without the re-gather.
PARITY_CASES = [
    (1, 4, 4, False, False, True),
    (1, 4, 2, True, False, True),
    (1, 4, 2, True, True, True),
    (1, 4, 1, False, True, True),
    (1, 4, 4, True, True, False),
    (2, 2, 2, True, False, True),
    (2, 2, 1, False, True, True),
    (2, 2, 4, False, True, False),
    (4, 1, 2, True, False, True),
    (4, 1, 4, False, True, True),
]


def _one_case(dp, t, kv, tie, sequence_parallel, regather) -> dict:
    cfg = model_cfg(kv, tie)
    topo = topology(dp, t, sequence_parallel)
    stats = CommStats()
    tp = TPContext(group=topo.group("tp"), sequence_parallel=sequence_parallel,
                   regather=regather, stats=stats)
    x, y = batch(seed=7)
    ref = build_model(cfg, seed=3)
    ref_logits = ref(x)
    ref_loss = cross_entropy(ref_logits, y)
    ref_loss.backward()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))

    model = build_tensor_parallel_model(cfg, seed=3, tp=tp)
    specs = param_specs(model, tp)
    init_err = max(float((p - shard(ref_params[n], specs[n], tp)).abs().max())
                   for n, p in model.named_parameters(remove_duplicate=False))
    logits = model(x)  # (B, T, 252/t): never the full vocabulary
    loss = vocab_parallel_cross_entropy(logits, y, VOCAB, tp)
    loss.backward()
    sync_partial_grads(model, tp)
    where = f"rank {dist.get_rank()} case {(dp, t, kv, tie, sequence_parallel, regather)}"
    # Shares of the summation bound used (module docstring): <= 1 passes.
    grad_errs = {n: summation_error(gather_full(p.grad, specs[n], tp), ref_params[n].grad,
                                    terms=VOCAB, msg=f"{where} grad {n}")
                 for n, p in model.named_parameters(remove_duplicate=False)}
    padded_rows = [p.grad[VOCAB - tp.rank * p.shape[0]:] for n, p in model.named_parameters()
                   if n in ("tok_embeddings.weight", "output.weight")]
    sq = owned_grad_sq(model, tp)
    if tp.size > 1:
        dist.all_reduce(sq, group=tp.group)
    ref_sq = sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters())
    state = gather_state_dict(model, tp)
    ref_state = ref.state_dict()
    return {
        "local_vocab": logits.shape[-1],
        "init_err": init_err,
        "logits_err": summation_error(gather_logits(logits, VOCAB, tp), ref_logits, terms=FFN,
                                      msg=f"{where} logits"),
        "loss_err": summation_error(loss, ref_loss, terms=VOCAB, msg=f"{where} loss"),
        "grad_errs": grad_errs,
        "padded_grad_max": max((float(r.abs().max()) for r in padded_rows if r.numel()),
                               default=0.0),
        # ‖g + δ‖ − ‖g‖ <= ‖δ‖: the gradients' bound (the fp64 sums add nothing at this size).
        "grad_norm_err": summation_error(sq.sqrt(), ref_sq ** 0.5, terms=VOCAB,
                                         msg=f"{where} grad norm"),
        "state_keys_equal": sorted(state) == sorted(ref_state),
        "state_err": max(float((state[k] - v).abs().max()) for k, v in ref_state.items()),
        "bytes": {prefix: stats.bytes_sent(prefix) for prefix in
                  ("layers.0.", "layers.1.", "tok_embeddings", "output", "loss", "grad_sync")},
        "regather_bytes": stats.bytes_sent("layers.0.", contains=":regather"),
        "layer_fwd": stats.bytes_sent("layers.0.", phase="forward"),
        "layer_bwd": stats.bytes_sent("layers.0.", phase="backward"),
    }


class Stage(nn.Module):
    """A pipeline-stage-like module: blocks [lo, hi) of a reference model, with the embedding
    on the first stage and the final norm and head on the last."""

    def __init__(self, ref: Transformer, lo: int, hi: int):
        super().__init__()
        if lo == 0:
            self.tok_embeddings = copy.deepcopy(ref.tok_embeddings)
        self.layers = nn.ModuleList(copy.deepcopy(ref.layers[i]) for i in range(lo, hi))
        if hi == len(ref.layers):
            self.norm, self.output = copy.deepcopy(ref.norm), copy.deepcopy(ref.output)

    def forward(self, x, cos, sin):
        if hasattr(self, "tok_embeddings"):
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x)) if hasattr(self, "output") else x


def _stages_case(dp, t, sequence_parallel) -> dict:
    """apply_tensor_parallel on two stage modules holding parts of an untied model; the second
    stage starts past the embedding and receives (B, T/t, h) activations under SP."""
    cfg = model_cfg(2, tie=False)
    topo = topology(dp, t, sequence_parallel)
    x, y = batch(seed=11)
    ref = build_model(cfg, seed=5)
    ref_loss = cross_entropy(ref(x), y)
    ref_loss.backward()
    stages = [Stage(ref, 0, 1), Stage(ref, 1, LAYERS)]
    for stage in stages:
        stage.zero_grad()
        apply_tensor_parallel(stage, topo.group("tp"), sequence_parallel)
    tp = TPContext(group=topo.group("tp"), sequence_parallel=sequence_parallel)
    cos, sin = ref.rope_cos[:SEQ], ref.rope_sin[:SEQ]  # the full sequence's tables, also under SP
    hidden = stages[0](x, cos, sin)
    logits = stages[1](hidden, cos, sin)
    loss = vocab_parallel_cross_entropy(logits, y, VOCAB, tp)
    loss.backward()
    where = f"rank {dist.get_rank()} stages dp={dp} tp={t} sp={sequence_parallel}"
    errs = {}
    for stage, offset in zip(stages, (0, 1), strict=True):
        sync_partial_grads(stage, tp)
        specs = param_specs(stage, tp)
        for name, p in stage.named_parameters():
            ref_name = name
            if name.startswith("layers."):
                i, rest = name[len("layers."):].split(".", 1)
                ref_name = f"layers.{int(i) + offset}.{rest}"
            errs[ref_name] = summation_error(gather_full(p.grad, specs[name], tp),
                                             ref.get_parameter(ref_name).grad, terms=VOCAB,
                                             msg=f"{where} grad {ref_name}")
    return {"hidden_len": hidden.shape[1],
            "loss_err": summation_error(loss, ref_loss, terms=VOCAB, msg=f"{where} loss"),
            "grad_errs": errs}


def _conjugates(t: int) -> dict:
    """f, g, SP's g, ḡ and scatter against their definitions, on a tp group of t ranks."""
    topo = topology(4 // t, t, False)
    group, r = topo.group("tp"), topo.local_rank_in("tp")
    gen = torch.Generator().manual_seed(0)
    # Every rank's inputs and upstream gradients, known to all: chunks (B, L, H), full
    # sequences (B, t·L, H).
    small, big = torch.randn(t, 2, 3, 5, generator=gen), torch.randn(t, 2, 3 * t, 5, generator=gen)
    w_small, w_big = torch.randn_like(small), torch.randn_like(big)
    def expect(small, big, w_small, w_big):
        """op: (input, upstream gradient, expected output, expected input gradient)."""
        return {
            "f": (f, big[r], w_big[r], big[r], w_big.sum(0)),
            "g": (g, big[r], w_big[r], big.sum(0), w_big[r]),
            "sp.g": (sp.g, small[r], w_big[r], torch.cat(list(small), dim=1),
                     w_big.sum(0).chunk(t, 1)[r]),
            "sp.g_bar": (sp.g_bar, big[r], w_small[r], big.sum(0).chunk(t, 1)[r],
                         torch.cat(list(w_small), dim=1)),
            "sp.scatter": (sp.scatter, big[0], w_small[r], big[0].chunk(t, 1)[r],
                           torch.cat(list(w_small), dim=1)),
        }

    # The same expressions on magnitudes give Σ|xᵢ| of every element, the exact scale of
    # Higham's bound: sums of t terms (a copy has one).
    magnitudes = expect(small.abs(), big.abs(), w_small.abs(), w_big.abs())
    out = {}
    for name, (op, x, w, y_expected, grad_expected) in expect(small, big, w_small,
                                                              w_big).items():
        *_, y_scale, grad_scale = magnitudes[name]
        x = x.clone().requires_grad_()
        y = op(x, group)
        y.backward(w)
        where = f"rank {dist.get_rank()} t={t} {name}"
        out[name] = (summation_error(y.detach(), y_expected, terms=t, scale=y_scale,
                                     msg=f"{where} forward"),
                     summation_error(x.grad, grad_expected, terms=t, scale=grad_scale,
                                     msg=f"{where} backward"))
    # A sequence that does not split into t equal chunks is refused, not chunked unevenly.
    try:
        sp.sequence_chunk(torch.zeros(1, 2 * t + 1, 5), group)
        out["uneven_refused"] = None
    except ValueError as e:
        out["uneven_refused"] = str(e)
    return out


def large_logits(shift: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, VOCAB) logits around `shift`, each row with a spike `shift` higher in a random
    column (so the row maximum lives on one tp shard), and targets half at the spike."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=g) * 3 + shift
    spike = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    logits.scatter_add_(-1, spike[..., None], torch.full((BATCH, SEQ, 1), float(shift)))
    targets = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.5, spike,
                          torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
    return logits, targets


LARGE_SHIFTS = (100.0, 1000.0)  # exp(100) already overflows fp32: the loss needs its max


def _large_logit_losses(t: int) -> dict[float, tuple[float, float]]:
    """vocab_parallel_cross_entropy on t ranks' shards of large logits against the reference
    cross-entropy: shares of the summation bound used by the loss and the logits' gradient."""
    topo = topology(4 // t, t, False)
    tp = TPContext(group=topo.group("tp"))
    out = {}
    for shift in LARGE_SHIFTS:
        logits, y = large_logits(shift)
        padded = torch.cat([logits, torch.zeros(BATCH, SEQ, 252 - VOCAB)], dim=-1)
        local = padded.chunk(t, dim=-1)[tp.rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, y, VOCAB, tp)
        loss.backward()
        ref_logits = logits.clone().requires_grad_()
        ref = cross_entropy(ref_logits, y)
        ref.backward()
        width = local.shape[-1]
        ref_grad = torch.cat([ref_logits.grad, torch.zeros(BATCH, SEQ, 252 - VOCAB)], dim=-1)
        where = f"rank {dist.get_rank()} t={t} shift={shift}"
        # The loss sums the exponentials of the vocabulary's logits, shifted by their maximum.
        out[shift] = (summation_error(loss, ref, terms=VOCAB, msg=f"{where} loss"),
                      summation_error(local.grad, ref_grad[..., tp.rank * width:
                                                           (tp.rank + 1) * width],
                                      terms=VOCAB, scale=float(ref_logits.grad.abs().max()),
                                      msg=f"{where} grad"))
    return out


def shard_edges(t: int) -> torch.Tensor:
    """Every vocabulary id at the first or last row of a tp shard (252/t rows each)."""
    width = 252 // t
    ids = {i for k in range(1, t + 1) for i in (k * width - 1, k * width)} | {0, VOCAB - 1}
    return torch.tensor(sorted(i for i in ids if i < VOCAB))


TINY_VOCAB = 5  # padded to 8 on 4 ranks: 2 columns each, rank 3's both past the vocabulary


def _vocab_edges(t: int) -> dict[str, float]:
    """The vocabulary-parallel embedding and loss at the shards' edges, where an off-by-one in
    which rank owns an id shows: tokens and targets at the first and last id of every shard
    (random ids rarely land there), and a vocabulary of 5 on t ranks (on 4, rank 3 holds only
    padding). Returns the embedding's largest difference (exact: one rank's row plus zeros)
    and the shares of the summation bound used by the losses and logit gradients."""
    topo = topology(4 // t, t, False)
    tp = TPContext(group=topo.group("tp"))
    where = f"rank {dist.get_rank()} t={t}"
    ids = shard_edges(t)[None]  # (1, n)
    emb = nn.Embedding(VOCAB, 8)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(1)))
    want = emb(ids)
    out = {"embedding": float((apply_tensor_parallel(emb, tp.group)(ids) - want).abs().max())}
    gen = torch.Generator().manual_seed(2)
    for name, vocab, targets in (("edges", VOCAB, ids),
                                 ("tiny", TINY_VOCAB, torch.randint(0, TINY_VOCAB, (2, 8),
                                                                    generator=gen))):
        padded_vocab = t * -(-vocab // t)
        logits = torch.randn(*targets.shape, vocab, generator=gen) * 3
        # Padding columns hold 0, what the head's zero rows give.
        padded = torch.cat([logits, torch.zeros(*targets.shape, padded_vocab - vocab)], dim=-1)
        local = padded.chunk(t, dim=-1)[tp.rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, vocab, tp)
        loss.backward()
        ref_logits = logits.clone().requires_grad_()
        ref = cross_entropy(ref_logits, targets)
        ref.backward()
        width = local.shape[-1]
        ref_grad = torch.cat([ref_logits.grad, torch.zeros(*targets.shape, padded_vocab - vocab)],
                             dim=-1)[..., tp.rank * width:(tp.rank + 1) * width]
        # The loss sums the vocabulary's exponentials per shard and then across shards.
        out[f"{name} loss"] = summation_error(loss, ref, terms=vocab, msg=f"{where} {name} loss")
        out[f"{name} grad"] = summation_error(local.grad, ref_grad, terms=vocab,
                                              scale=float(ref_logits.grad.abs().max()),
                                              msg=f"{where} {name} grad")
    return out


def _parity_worker() -> dict:
    return {
        "cases": [_one_case(*case) for case in PARITY_CASES],
        "stages": [_stages_case(1, 4, True), _stages_case(2, 2, False), _stages_case(1, 4, False)],
        "conjugates": {t: _conjugates(t) for t in (2, 4)},
        "large_logits": {t: _large_logit_losses(t) for t in (2, 4)},
        "vocab_edges": {t: _vocab_edges(t) for t in (2, 4)},
    }


@pytest.fixture(scope="module")
def parity() -> list[dict]:
    return run_ranks(_parity_worker, 4, timeout=240)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_conjugate_operators(parity):
    """f: identity / all-reduce; g: all-reduce / identity; SP's g: all-gather / reduce-scatter
    along the sequence; ḡ: reduce-scatter / all-gather; scatter (replicated to sequence chunks):
    chunk / all-gather. Inputs are reconstructed exactly on
    every rank, so the only error is the order of summation (fp32 round-off)."""
    for rank_result in parity:
        for t, ops in rank_result["conjugates"].items():
            assert ops.pop("uneven_refused") == \
                f"sequence length {2 * t + 1} is not divisible by tp={t}"
            for name, (fwd_err, bwd_err) in ops.items():
                # Shares of the summation bound over the t ranks' terms.
                assert fwd_err <= 1 and bwd_err <= 1, (t, name, fwd_err, bwd_err)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(PARITY_CASES)),
                         ids=[f"dp{c[0]}-tp{c[1]}-kv{c[2]}-{'tied' if c[3] else 'untied'}-"
                              f"{'sp' if c[4] else 'nosp'}{'' if c[5] else '-store'}"
                              for c in PARITY_CASES])
def test_parity_with_reference(parity, i):
    dp, t, kv, tie, sequence_parallel, regather = PARITY_CASES[i]
    for rank, rank_result in enumerate(parity):
        r = rank_result["cases"][i]
        where = f"rank {rank}"
        assert r["local_vocab"] == (252 // t if t > 1 else VOCAB), where  # padded, then split
        assert r["init_err"] == 0.0, where  # shards are slices of init_tensor's full tensors
        # Shares of the summation bounds (module docstring) used: <= 1 passes.
        assert r["logits_err"] <= 1, (where, r["logits_err"])
        assert r["loss_err"] <= 1, (where, r["loss_err"])
        bad = {n: e for n, e in r["grad_errs"].items() if not e <= 1}
        assert not bad, (where, bad)
        assert len(r["grad_errs"]) == len(Transformer(model_cfg(kv, tie)).state_dict())
        assert r["padded_grad_max"] == 0.0, where  # padding rows never receive gradient
        # The global norm counts shards once each and replicas once (a replica counted twice
        # is off by O(1)); the gradients' bound.
        assert r["grad_norm_err"] <= 1, (where, r["grad_norm_err"])
        assert r["state_keys_equal"] and r["state_err"] == 0.0, where


@pytest.mark.multiprocess
@pytest.mark.slow
def test_communication_volume_matches_megatron(parity):
    """Bytes each rank sends per layer per micro-batch (fp32, 4 bytes): the paper's
    8·b·s·h·(t−1)/t elements, forward and backward split evenly, with and without SP; SP's
    optional re-gather of the stored input adds its 2·b·s·h·(t−1)/t."""
    bsh = BATCH * SEQ * D_MODEL
    for i, (_dp, t, _kv, _tie, sequence_parallel, regather) in enumerate(PARITY_CASES):
        r = parity[0]["cases"][i]
        paper = 8 * bsh * (t - 1) / t * 4
        extra = 2 * bsh * (t - 1) / t * 4 if sequence_parallel and regather else 0
        for layer in ("layers.0.", "layers.1."):
            assert r["bytes"][layer] == paper + extra, (i, layer, r["bytes"])
        assert r["regather_bytes"] == extra
        assert r["layer_fwd"] == paper / 2 and r["layer_bwd"] == paper / 2 + extra
        # Outside the layers: the embedding's exit (all-reduce, or reduce-scatter forward and
        # all-gather backward), the head's entry likewise, and the loss's all-reduces of
        # 3·b·s numbers (max, then sum of exponentials and target logit).
        act = bsh * 4
        assert r["bytes"]["tok_embeddings"] == ring_bytes_sent("all_reduce", bsh, 4, t)
        assert r["bytes"]["output"] == ring_bytes_sent("all_reduce", bsh, 4, t) + (
            act * (t - 1) / t if sequence_parallel and regather else 0)
        assert r["bytes"]["loss"] == ring_bytes_sent("all_reduce", 3 * BATCH * SEQ, 4, t)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipeline_stage_subsets(parity):
    """apply_tensor_parallel on modules holding a subset of blocks, with or without the
    embedding and head (how the pipeline composes TP): loss and all gradients match."""
    for rank_result in parity:
        for r, sequence_parallel, t in zip(rank_result["stages"], (True, False, False),
                                           (4, 2, 4), strict=True):
            assert r["hidden_len"] == (SEQ // t if sequence_parallel else SEQ)
            assert r["loss_err"] <= 1, r["loss_err"]  # shares of the summation bound
            bad = {n: e for n, e in r["grad_errs"].items() if not e <= 1}
            assert not bad and len(r["grad_errs"]) == len(
                dict(build_model(model_cfg(2, False)).named_parameters())), bad


# ---------------------------------------------------------------------------------------------
# Ten optimizer steps through the engine against the single-process reference.

# (dp, tp, n_kv_heads, tie, sequence_parallel)
CURVE_CASES = [(1, 4, 2, True, True), (2, 2, 1, False, True), (2, 2, 4, True, False)]
STEPS, ACCUM, MBS = 10, 2, 2


def run_cfg(dp, t, kv, tie, sequence_parallel) -> Config:
    return Config(model=model_cfg(kv, tie),
                  parallel=ParallelConfig(dp=dp, tp=t, sequence_parallel=sequence_parallel),
                  train=TrainConfig(steps=STEPS, grad_accum=ACCUM, micro_batch_size=MBS,
                                    lr=3e-3, warmup_steps=2, grad_clip=0.5, seed=1),
                  data=DataConfig(path="unused", seq_len=SEQ))


def _global_batch(step: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable sequences (each token is the previous plus 7, mod the vocabulary) from random
    starts, so ten steps visibly lower the loss."""
    n = dp * ACCUM * MBS
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(step))
    tokens = (starts + 7 * torch.arange(SEQ + 1)) % VOCAB  # (n, T+1)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return list(zip(x.split(MBS), y.split(MBS), strict=True))


def _gathered_grads(engine: Executor) -> dict[str, torch.Tensor]:
    """The step's gradients by reference name, TP pieces gathered (ParallelModel.full_grads)."""
    return engine.model.full_grads()


def _curve_worker() -> list[dict]:
    """Each case trains STEPS steps through build_executor next to a Shadow
    (tests/dp_parity.py): every step, the single-device model started from the engine's own
    gathered parameters. Returns the shares of the summation bounds each comparison used."""
    out = []
    cpu = torch.device("cpu")
    for case in CURVE_CASES:
        dp, t, kv, tie, sequence_parallel = case
        cfg = run_cfg(*case)
        topo = topology(dp, t, sequence_parallel)
        engine = build_executor(cfg, topo, cpu)
        opt = engine.optimizer(cfg.train)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train))
        shadow = Shadow(cfg, schedule=True)
        d, where = topo.coords()["dp"], f"rank {dist.get_rank()} case {case}"
        # The sums reassociated: the vocabulary's (the loss, and every gradient through the
        # softmax; module docstring) and the global batch's tokens (dp ranks' partial means).
        # Their bounds add.
        terms = VOCAB + dp * ACCUM * MBS * SEQ
        used: dict[str, float] = dict.fromkeys(("loss", "norm", "grad", "param"), 0.0)
        losses, norms = [], []
        for step in range(STEPS):
            batches = _global_batch(step, dp)
            before = engine.full_state_dict()
            twin = shadow.gradients(before, batches)
            opt.zero_grad(set_to_none=True)
            losses.append(engine.forward_backward(batches[d * ACCUM:(d + 1) * ACCUM]))
            norms.append(engine.clip_grad_norm_(cfg.train.grad_clip))
            clipped = _gathered_grads(engine)
            opt.step()
            sched.step()
            after, want = engine.full_state_dict(), shadow.optimizer_step(before, clipped)
            label = f"{where} step {step}"
            checks = [("loss", losses[-1], twin["loss"], terms),
                      ("norm", norms[-1], twin["norm"], terms),
                      *(("grad", clipped[n], g, terms) for n, g in twin["clipped"].items()),
                      # AdamW on shards against AdamW on whole tensors, same inputs.
                      *(("param", after[k], w, ADAM_ROUNDINGS) for k, w in want.items())]
            assert after.keys() == want.keys(), where
            for kind, got, expected, n in checks:
                used[kind] = max(used[kind], summation_error(got, expected, terms=n,
                                                             msg=f"{label} {kind}"))
        val = _global_batch(99, dp)
        shadow.model.load_state_dict(engine.full_state_dict())
        with torch.no_grad():
            ref_val = sum(float(cross_entropy(shadow.model(x), y)) * y.numel() for x, y in val)
        got_val, count = engine.eval_loss(val[d * ACCUM:(d + 1) * ACCUM])
        used["val"] = summation_error(got_val / count, ref_val / count, terms=terms,
                                      msg=f"{where} val")
        out.append(dict(used=used, losses=losses, norms=norms, val_count=count,
                        ref_val_count=sum(y.numel() for _, y in val)))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ten_steps_match_reference_curve():
    """Ten AdamW steps through the engine (clipping active: the first norm is above the clip,
    0.5), each against the single-device model started from the engine's own parameters: loss,
    global grad norm and clipped gradients within the summation bound, the optimizer's step
    within AdamW's roundings; then the validation loss. (Against a free-running single-device
    run, Adam would turn round-off in near-zero gradient entries into visible drift.)"""
    for rank_result in run_ranks(_curve_worker, 4, timeout=240):
        for case, r in zip(CURVE_CASES, rank_result, strict=True):
            assert all(v <= 1 for v in r["used"].values()), (case, r["used"])
            assert r["norms"][0] > 0.5  # the clip (0.5) did scale the first step
            assert r["losses"][-1] < r["losses"][0] - 0.1  # and it trained
            assert r["val_count"] == r["ref_val_count"]


# ---------------------------------------------------------------------------------------------
# Single-process pieces.


def test_shard_pads_vocabulary_and_gathers_back():
    tp = TPContext(group=None)
    spec = ShardSpec(dim=0, chunks=1, full_size=5, pad=True)
    full = torch.arange(10.0).view(5, 2)
    assert torch.equal(shard(full, spec, tp), full)
    assert torch.equal(gather_full(full, spec, tp), full)
    # Four pieces of a 5-row tensor: 8 rows after padding, zeros past the vocabulary.
    spec4 = ShardSpec(dim=0, chunks=4, full_size=5, pad=True)
    assert spec4.padded_size == 8 and spec4.index(3, 4) == 3 and spec4.owns(3, 4)
    kv = ShardSpec(dim=0, chunks=2, full_size=16, partial_grad=True)  # 2 kv heads, tp=4
    assert [kv.index(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [kv.owns(r, 4) for r in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="size 5 of dim 0 is not divisible into 2"):
        shard(full, ShardSpec(dim=0, chunks=2, full_size=5), TPContext(group=None))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_vocab_parallel_loss_of_large_logits(parity):
    """Logits near 100 and 1000 (fp32's exp overflows past 88.7), the row maximum on one shard:
    the loss and its gradient equal the reference cross-entropy's on t = 2 and 4 ranks."""
    for rank_result in parity:
        for t, by_shift in rank_result["large_logits"].items():
            for shift, (loss_used, grad_used) in by_shift.items():
                assert loss_used <= 1 and grad_used <= 1, (t, shift, loss_used, grad_used)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_vocab_parallel_edges(parity):
    """Ids at the first and last row of every shard are looked up and scored by the one rank
    that holds them (a `<=` for a `<` at a shard's end double-counts or misses them), and a
    shard holding only padding adds nothing to the loss (t = 2 and 4)."""
    assert shard_edges(4).tolist() == [0, 62, 63, 125, 126, 188, 189, 250]
    for rank_result in parity:
        for t, r in rank_result["vocab_edges"].items():
            assert r.pop("embedding") == 0.0, t  # one rank's row plus exact zeros
            # Shares of the summation bound over the vocabulary: <= 1 passes.
            assert all(used <= 1 for used in r.values()), (t, r)


@pytest.mark.parametrize("shift", LARGE_SHIFTS)
def test_vocab_parallel_loss_of_large_logits_one_rank(shift):
    logits, y = large_logits(shift)
    loss = vocab_parallel_cross_entropy(logits, y, VOCAB, TPContext(group=None))
    assert_close_summed(loss, cross_entropy(logits, y), terms=VOCAB, msg=f"shift {shift}")


def test_single_rank_tp_is_the_reference():
    """tp=1 (no group) runs the same code path with identity collectives: exact results."""
    cfg = model_cfg(2, tie=True)
    x, y = batch(seed=3)
    ref = build_model(cfg, seed=2)
    tp = TPContext(group=None, sequence_parallel=True)
    model = build_tensor_parallel_model(cfg, seed=2, tp=tp)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    # The vocabulary-parallel loss on one rank is an ordinary cross-entropy (same formula,
    # different kernel: a few ulp).
    logits = ref(x).detach()
    assert float(vocab_parallel_cross_entropy(logits, y, VOCAB, tp)) == pytest.approx(
        float(cross_entropy(logits, y)), rel=1e-6)


def test_rope_tables_must_cover_the_full_sequence():
    cfg = model_cfg(4, tie=False)
    model = build_tensor_parallel_model(cfg, seed=0, tp=TPContext(group=None))
    x, _ = batch(seed=0)
    block = model.layers[0]
    h = model.tok_embeddings(x)
    with pytest.raises(ValueError, match="RoPE tables cover 8 positions but attention sees 16"):
        block(h, model.rope_cos[:8], model.rope_sin[:8])


def test_apply_to_a_lone_embedding_or_head_returns_the_parallel_layer():
    emb, head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB, bias=False)
    new_emb = apply_tensor_parallel(emb, None)
    new_head = apply_tensor_parallel(head, None)
    assert type(new_emb).__name__ == "VocabParallelEmbedding"
    assert type(new_head).__name__ == "ColumnParallelLinear"
    tokens = torch.arange(6).view(1, 6)
    torch.testing.assert_close(new_emb(tokens), emb(tokens), rtol=0, atol=0)
    h = torch.randn(1, 6, 8)
    torch.testing.assert_close(new_head(h), head(h), rtol=0, atol=0)


class _GatedMLP(nn.Module):
    """Not tessera's model: a plan, not new layers, makes it tensor-parallel."""

    def __init__(self):
        super().__init__()
        self.n_groups = 3
        self.up, self.gate = nn.Linear(8, 6, bias=False), nn.Linear(8, 6, bias=False)
        self.down = nn.Linear(6, 8, bias=False)

    def forward(self, x):
        return self.down(self.up(x) * torch.sigmoid(self.gate(x)))


def test_apply_plan_on_a_model_of_its_own():
    """apply_plan swaps exactly the named linears (a suffix names them under any parent; names
    the module lacks are skipped), each column-parallel linear gets its own output from the
    shared region entry, and one rank reproduces the reference exactly."""
    from tessera.parallel.tensor_parallel import (
        ColwiseParallel,
        RowwiseParallel,
        apply_plan,
    )

    ref = nn.Sequential()
    ref.add_module("mlp", _GatedMLP())
    ref.add_module("lockdown", nn.Linear(8, 8, bias=False))  # "down" is not a suffix of it
    x = torch.randn(2, 5, 8)
    want = ref(x)
    plan = {"mlp.up": ColwiseParallel(), "gate": ColwiseParallel(units="n_groups"),
            "down": RowwiseParallel(), "missing": RowwiseParallel()}
    model = apply_plan(copy.deepcopy(ref), plan, TPContext(group=None))
    assert [type(m).__name__ for m in (model.mlp.up, model.mlp.gate, model.mlp.down,
                                       model.lockdown)] == \
        ["ColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "Linear"]
    assert model.mlp.up.shared is model.mlp.gate.shared
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    # A linear called alone with a new input gets that input's output, not one left pending
    # from the last input the shared region entered with.
    x2 = torch.randn(2, 5, 8)
    model.mlp.up(x)  # the gate's output for x is now pending
    torch.testing.assert_close(model.mlp.gate(x2), ref.mlp.gate(x2), rtol=0, atol=0)
    torch.testing.assert_close(model(x2), ref(x2), rtol=0, atol=0)


def test_apply_plan_takes_replicated_parameters_from_the_source():
    """With `full_tensor`, every parameter comes from it, the ones the plan leaves whole (a
    norm gain) too, not only the sharded ones; on one rank each equals its source exactly."""
    from tessera.parallel.tensor_parallel import ColwiseParallel, RowwiseParallel, apply_plan

    def module():
        return nn.Sequential(nn.LayerNorm(8, bias=False), _GatedMLP())

    source = module()
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(torch.randn_like(p))
    full = dict(source.named_parameters())
    model = apply_plan(module(), {"up": ColwiseParallel(), "gate": ColwiseParallel(),
                                  "down": RowwiseParallel()}, TPContext(group=None),
                       lambda name, shape: full[name].detach())
    got = dict(model.named_parameters())
    assert got.keys() == full.keys()
    for name, p in got.items():
        assert torch.equal(p, full[name]), name


def test_colwise_spec_refuses_what_it_cannot_split():
    """Column-parallel rows in groups (heads): tp must divide the groups, or, with
    `replicate`, be a multiple of them (each group then held by tp/groups ranks whose
    gradients are partial); anything else is refused, naming the count."""
    from tessera.parallel.tensor_parallel import ColwiseParallel

    owner = _GatedMLP()  # 3 groups of the gate's 6 rows
    split, replicated = ColwiseParallel(units="n_groups"), ColwiseParallel("n_groups", True)
    assert split.spec(owner.gate, "gate", owner, 3) == ShardSpec(dim=0, chunks=3, full_size=6)
    assert replicated.spec(owner.gate, "gate", owner, 3) == split.spec(owner.gate, "gate",
                                                                       owner, 3)
    assert replicated.spec(owner.gate, "gate", owner, 6) == ShardSpec(
        dim=0, chunks=3, full_size=6, partial_grad=True)
    with pytest.raises(ValueError, match=r"^tp=6 must divide n_groups=3$"):
        split.spec(owner.gate, "gate", owner, 6)  # replicas only when asked for
    with pytest.raises(ValueError, match=r"^tp=4 must divide n_groups=3 or be a multiple of it$"):
        replicated.spec(owner.gate, "gate", owner, 4)
    with pytest.raises(ValueError, match=r"^tp=4 must divide up.out_features=6$"):
        ColwiseParallel().spec(owner.up, "up", owner, 4)


@pytest.mark.parametrize("name", ["up", "down", ""], ids=["column", "row", "vocab-head"])
def test_plan_refuses_a_linear_with_bias(name):
    """A bias would be dropped by the parallel layers (or, kept in a row-parallel linear, added
    once per rank by the all-reduce), so every style refuses a linear that has one."""
    from tessera.parallel.tensor_parallel import (
        ColwiseParallel,
        RowwiseParallel,
        VocabParallel,
        apply_plan,
    )

    mlp = _GatedMLP()
    if name:
        setattr(mlp, name, nn.Linear(getattr(mlp, name).in_features,
                                     getattr(mlp, name).out_features, bias=True))
        plan = {"up": ColwiseParallel(), "gate": ColwiseParallel(), "down": RowwiseParallel()}
        module = mlp
    else:  # an LM head, vocabulary-parallel
        module, plan = nn.Linear(8, VOCAB, bias=True), {"": VocabParallel()}
    with pytest.raises(ValueError,
                       match=rf"^{name}: tensor parallelism here supports linears without bias$"):
        apply_plan(module, plan, TPContext(group=None))
