"""The planner and tessera's engine agree (issue 11): on what exists, and on the bytes per rank.

1. Every layout the planner's search space proposes for a small tessera model on 8 ranks is one
   ``layout.validate`` (hence ``tessera train``) accepts, and every layout tessera accepts is
   one the planner proposes: the two sets are enumerated independently and compared.
2. The planner evaluates and ranks parameter-server layouts, refused exactly where tessera
   refuses them.
3. (8 gloo ranks) For (dp, tp, pp) = (2, 2, 2) and (2, 1, 4) with ZeRO-3, in fp32 and bf16,
   and zb-v's V placement with tied embeddings, each rank's model-state bytes, counted from
   the storages it allocated, equal the planner's prediction exactly, and the activation bytes
   the pipeline runtime measured (autograd's saved tensors, peak over the step) are within 15%
   of the planner's estimate for that rank.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tessera.config import DP_MODES, Config, ParallelConfig
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.pipeline.schedules import SCHEDULES
from tessera.planner import engine
from tessera.planner.estimate import PlanError, estimate, memory_by_rank
from tessera.planner.hardware import load_hardware
from tessera.planner.models import expressible, load_model
from tessera.planner.search import SearchSpace, divisors, enumerate_layouts, search
from tessera.planner.workload import PARALLEL_FIELDS, RECOMPUTE, Layout, Workload
from tessera.testing import run_ranks

HW = load_hardware("A100-80GB")
WORLD, BATCH = 8, 16
VIRTUAL = (1, 2, 4, 8)


def canonical(dp, tp, pp, cp, v, schedule, zero, sp, recompute, dp_mode, m) -> tuple:
    """A layout's key, with the fields tessera ignores in their one canonical value: a single
    chunk (pp = v = 1) runs F0 B0 F1 B1 ... whatever the schedule's name, and sequence
    parallelism at tp = 1 changes nothing."""
    if pp == 1 and v == 1:
        schedule = "1f1b"
    return dp, tp, pp, cp, v, schedule, zero, sp and tp > 1, recompute, dp_mode, m


def tessera_accepts(preset: str, precision: str) -> set[tuple]:
    """Every layout of 8 ranks that tessera's Config accepts for `preset`'s model, BATCH
    sequences per step: dp·tp·pp·cp = 8, v, schedule, ZeRO stage, SP, recomputation, dp mode,
    m micro-batches of BATCH/(dp·m) sequences."""
    base = make_config(preset)
    accepted = set()
    for dp, tp, pp, cp in itertools.product(divisors(WORLD), repeat=4):
        if dp * tp * pp * cp != WORLD:
            continue
        for v, schedule, zero, sp, recompute, dp_mode in itertools.product(
                VIRTUAL, SCHEDULES, (0, 1, 2, 3), (False, True), RECOMPUTE, DP_MODES):
            try:
                parallel = type(base.parallel)(dp=dp, tp=tp, pp=pp, cp=cp, virtual_stages=v,
                                               schedule=schedule, zero_stage=zero,
                                               sequence_parallel=sp, recompute=recompute,
                                               dp_mode=dp_mode)
            except ConfigError:
                continue
            for m in divisors(BATCH // dp):
                train = type(base.train)(micro_batch_size=BATCH // (dp * m), grad_accum=m,
                                         precision=precision)
                try:
                    validate(Config(model=base.model, parallel=parallel, train=train,
                                    data=base.data), WORLD)
                except ConfigError:
                    continue
                accepted.add(canonical(dp, tp, pp, cp, v, schedule, zero, sp, recompute,
                                       dp_mode, m))
    return accepted


def planner_proposes(preset: str, precision: str) -> set[tuple]:
    """Every layout the planner's enumeration yields over the same values."""
    spec = load_model(preset)
    w = Workload(model=spec, hardware=HW, gpus=WORLD, global_batch=BATCH,
                 seq_len=spec.max_seq_len, precision=precision)
    space = SearchSpace(cp=None, virtual_stages=VIRTUAL, micro_batch=divisors(BATCH),
                        dp_mode=DP_MODES, tp_within_node=False)
    return {(L.dp, L.tp, L.pp, L.cp, L.virtual_stages, L.schedule, L.zero_stage,
             L.sequence_parallel, L.recompute, L.dp_mode, L.microbatches(BATCH))
            for L in enumerate_layouts(w, space)}


@pytest.mark.parametrize("preset, precision", [("tiny", "fp32"), ("demo", "bf16")])
def test_planner_proposes_exactly_what_tessera_runs(preset, precision):
    """tiny (2 layers, 4 heads, 2 kv heads: tp = 4 replicates kv heads) in fp32, where the
    parameter server exists; demo (4 layers, 6 heads) in bf16, where it does not."""
    proposed = planner_proposes(preset, precision)
    accepted = tessera_accepts(preset, precision)
    assert proposed == accepted, (sorted(proposed - accepted)[:5], sorted(accepted - proposed)[:5])
    # What the sets contain: context parallelism (default cp_method, ring), with sequence
    # parallelism too, never with the parameter server; the parameter server only with pure
    # data parallelism in fp32, pp = 1 with several chunks, every schedule.
    assert any(key[3] > 1 for key in proposed)
    assert any(key[3] > 1 and key[7] for key in proposed)
    assert all(key[9] == "allreduce" for key in proposed if key[3] > 1)
    servers = {key for key in proposed if key[9] != "allreduce"}
    assert (len(servers) > 0) == (precision == "fp32")
    assert all(key[1] == key[2] == 1 and key[6] == 0 for key in servers)
    assert any(key[2] == 1 and key[4] > 1 for key in proposed)
    # Interleaving and the V shapes need two chunks per rank, so pp = 2 needs 4 layers: tiny
    # has 2.
    interleavable = load_model(preset).layers >= 4
    assert {key[5] for key in proposed if key[2] > 1} == set(SCHEDULES) - (
        set() if interleavable else {"interleaved", "interleaved-lean", "zb-v", "dualpipev"})


def test_catalog_models_keep_the_planners_rules():
    """GPT-form catalog models are not tessera's: their checks are the planner's (and allow
    context parallelism); Llama 3 is tessera-expressible, and tessera runs cp > 1 for it."""
    gpt = Workload(model=load_model("gpt3-1.3b"), hardware=HW, gpus=16, global_batch=64,
                   seq_len=2048)
    llama = Workload(model=load_model("llama3-8b"), hardware=HW, gpus=16, global_batch=64,
                     seq_len=2048)
    assert not expressible(gpt.model) and expressible(llama.model)
    estimate(gpt, Layout(dp=4, tp=2, cp=2))
    estimate(llama, Layout(dp=4, tp=2, cp=2))
    estimate(llama, Layout(dp=2, tp=2, cp=4, sequence_parallel=True))
    with pytest.raises(PlanError, match="dp_mode"):
        estimate(llama, Layout(dp=8, cp=2, dp_mode="ps"))
    # The planner's own parameter-server rule for them mirrors tessera's.
    gpt32 = Workload(model=gpt.model, hardware=HW, gpus=16, global_batch=64, seq_len=2048,
                     precision="fp32")
    assert estimate(gpt32, Layout(dp=16, dp_mode="ps")).costs.ps_time > 0
    for bad in (Layout(dp=8, tp=2, dp_mode="ps"), Layout(dp=16, zero_stage=1, dp_mode="ps-async")):
        with pytest.raises(PlanError, match="needs tp=pp=cp=1, zero=0, fp32 and dp >= 2"):
            estimate(gpt32, bad)
    with pytest.raises(PlanError, match="needs tp=pp=cp=1, zero=0, fp32"):
        estimate(gpt, Layout(dp=16, dp_mode="ps"))
    # Tessera's cost-balanced split: the heavy LM head leaves the last stage fewer blocks.
    assert engine.blocks_per_chunk(llama.model, 4, 2048) == (8, 9, 9, 6)


def test_parameter_server_layouts_are_ranked_and_refused_as_tessera_refuses():
    spec = load_model("demo")
    w = Workload(model=spec, hardware=HW, gpus=4, global_batch=64, seq_len=128,
                 precision="fp32")
    plan = search(w, SearchSpace(dp=(4,), virtual_stages=(1,), micro_batch=(16,),
                                 recompute=("none",), dp_mode=DP_MODES), top=20)
    modes: dict = {}  # the best layout of each mode
    for e in plan.ranked:
        modes.setdefault(e.layout.dp_mode, e)
    assert set(modes) == set(DP_MODES)
    # The server moves (N−1)·(2S + P + 5) fp32 values one message at a time; a ring all-reduce
    # moves 2(N−1)/N·S per rank, overlapped with the backward: the all-reduce wins.
    assert modes["allreduce"].step_time < modes["ps"].step_time
    assert modes["ps"].costs.ps_time > 0 == modes["allreduce"].costs.ps_time
    for bad, rule in ((Layout(dp=2, tp=2, dp_mode="ps"), "parallel.tp=2: dp_mode='ps'"),
                      (Layout(dp=2, pp=2, dp_mode="ps-async"), "parallel.pp=2"),
                      (Layout(dp=4, zero_stage=1, dp_mode="ps"), "parallel.zero_stage=1")):
        with pytest.raises(PlanError, match=rule):
            estimate(w, bad)
    with pytest.raises(PlanError, match="train.precision='bf16'"):
        estimate(Workload(model=spec, hardware=HW, gpus=4, global_batch=64, seq_len=128),
                 Layout(dp=4, dp_mode="ps"))


# -- bytes per rank, measured ----------------------------------------------------------------

MEMORY_CASES = [
    # (dp, tp, pp, zero, precision, tied embeddings)
    (2, 2, 2, 0, "fp32", False),  # DDP buckets and torch AdamW
    (2, 2, 2, 0, "bf16", True),  # ZeRO's flat units at stage 0, a tied copy on the last stage
    (2, 1, 4, 3, "fp32", True),
    (2, 1, 4, 3, "bf16", False),
    (2, 2, 2, 0, "bf16", True, "zb-v"),  # the V's rank 0 holds the embedding and its tied head
]
MICROBATCHES, MICRO_BATCH, SEQ = 4, 2, 32


def memory_config(dp: int, tp: int, pp: int, zero: int, precision: str, tied: bool,
                  schedule: str = "1f1b") -> Config:
    """A small model whose vocabulary (255) is padded to a multiple of tp = 2 and whose single
    key/value head is replicated on both tp ranks; 1F1B (or `schedule`) over m = 4
    micro-batches."""
    virtual = SCHEDULES[schedule].chunks_per_rank or 1
    cfg = make_config("tiny", model=dict(vocab_size=255, d_model=64, n_layers=4, n_heads=4,
                                         n_kv_heads=1, max_seq_len=SEQ, tie_embeddings=tied),
                      parallel=dict(dp=dp, tp=tp, pp=pp, zero_stage=zero, schedule=schedule,
                                    virtual_stages=virtual),
                      train=dict(precision=precision, grad_accum=MICROBATCHES,
                                 micro_batch_size=MICRO_BATCH),
                      data=dict(seq_len=SEQ))
    return validate(cfg, dp * tp * pp)


def _measure_memory(cases: list[tuple]) -> list[dict]:
    """On each rank: build each layout, run one training step, read what is allocated."""
    from tessera.step import build_executor
    from tessera.topology import Topology

    out = []
    for case in cases:
        cfg = memory_config(*case)
        topo = Topology.build(cfg.parallel)
        executor = build_executor(cfg, topo, torch.device("cpu"), measure_memory=True)
        optimizer = executor.optimizer()
        g = torch.Generator().manual_seed(topo.coords()["dp"])
        batches = [tuple(torch.randint(0, cfg.model.vocab_size, (MICRO_BATCH, SEQ), generator=g)
                         for _ in range(2)) for _ in range(MICROBATCHES)]
        optimizer.zero_grad()
        executor.forward_backward(batches)
        executor.clip_grad_norm_(cfg.train.grad_clip)
        optimizer.step()
        out.append(dict(pp=topo.coords()["pp"],
                        state=executor.model.allocated_model_state(optimizer),
                        activations=executor.last_record.peak_activation_bytes))
    return out


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    return run_ranks(_measure_memory, 8, args=(MEMORY_CASES,), timeout=300)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: "dp{}tp{}pp{}-zero{}-{}-{}{}".format(
    *c[:5], "tied" if c[5] else "untied", "".join(f"-{s}" for s in c[6:])))
def test_bytes_per_rank_match_the_planner(measured, case):
    cfg = memory_config(*case)
    w = Workload.from_config(cfg, HW)
    est = estimate(w, engine.layout_of(cfg), simulate=False)
    predicted = memory_by_rank(est)
    index = MEMORY_CASES.index(case)
    for rank, per_case in enumerate(measured):
        got = per_case[index]
        want = predicted[got["pp"]]
        # Model state: exactly what the planner predicts, category by category.
        assert got["state"] == {"params": want.params, "grads": want.grads,
                                "optimizer": want.optimizer}, (rank, got, want)
        # Activations: within 15% (the bound); the count is in fact exact under 1F1B,
        # since the planner counts the tensors tessera's block saves and 1F1B's in-flight peak
        # (zb-v's rank 0: 3% under).
        assert got["activations"] == pytest.approx(want.activations, rel=0.15), (rank, got, want)
        print(f"{case} rank {rank} (pp {got['pp']}): state {sum(got['state'].values())} B "
              f"= predicted; activations measured {got['activations']} B, predicted "
              f"{want.activations:.0f} B")


@pytest.mark.parametrize("kernels", ["tessera", "fused"])
@pytest.mark.parametrize("schedule, v, shared", [("1f1b", 1, False), ("interleaved", 2, False),
                                                 ("zb-v", 2, True), ("dualpipev", 2, True)])
def test_a_tied_head_copies_the_embedding_only_on_another_rank(kernels, schedule, v, shared):
    """``parallelize`` builds a tied head from chunk 0's embedding when both chunks are on one
    rank (the V shapes' rank 0 holds chunks 0 and 2p−1), and as a copy on another rank (1F1B's
    and interleaved's last rank). Tied minus untied parameters per pipeline rank: one
    vocabulary matrix less on the V shapes' rank 0, nothing elsewhere (the copy is as large as
    an untied head) — for tessera's units and for the generic count alike."""
    from tessera.planner.cost import layout_costs
    from tessera.planner.models import from_model_config
    from tessera.planner.pipeline import rank_chunks

    def params_by_rank(tied: bool) -> list[float]:
        cfg = make_config("tiny", model=dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4,
                                             n_kv_heads=1, max_seq_len=SEQ, tie_embeddings=tied))
        w = Workload(model=from_model_config("tiny", cfg.model, SEQ), hardware=HW, gpus=2,
                     global_batch=8, seq_len=SEQ, kernels=kernels)
        L = Layout(pp=2, virtual_stages=v, schedule=schedule)
        chunks = layout_costs(w, L).chunks
        return [sum(chunks[c].params for c in rank_chunks(schedule, 2, v, r)) for r in range(2)]

    vocab_matrix = 256 * 64
    want = [-vocab_matrix if shared else 0, 0]
    tied, untied = params_by_rank(True), params_by_rank(False)
    assert [a - b for a, b in zip(tied, untied, strict=True)] == want


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses", "hybrid"])
def test_planner_prices_the_context_parallel_bytes_tessera_sends(method):
    """The planner's CP traffic per layer is ``context_parallel.bytes_per_layer`` (whose
    formulas tessera's tests check against the bytes the methods count) over the link: with
    α = 0 the seconds times the bandwidth are those bytes. And a cp_method survives the
    planner → tessera config → planner round trip."""
    from tessera.parallel.context_parallel import bytes_per_layer
    from tessera.planner.comm import context_parallel_times
    from tessera.planner.hardware import Link

    spec = load_model("llama3-8b")
    w = Workload(model=spec, hardware=HW, gpus=16, global_batch=64, seq_len=4096)
    link = Link(alpha=0.0, bandwidth=1e9)
    fwd, bwd, _, _ = context_parallel_times(w, 2, 4, 1, method, link)
    want = bytes_per_layer(method, 4, 1, spec.heads // 2, spec.kv_heads // 2, 1024,
                           spec.head_dim, w.bytes[3])
    assert fwd * 1e9 == pytest.approx(want["forward"])
    assert bwd * 1e9 == pytest.approx(want["backward"])
    L = Layout(dp=2, tp=2, cp=4, cp_method=method)
    assert engine.layout_of(engine.to_config(w, L)) == L
    assert estimate(w, L).step_time > 0


def test_planner_refuses_ulysses_heads_for_catalog_models():
    """GPT-3 175B: 96 heads, 12 per rank at tp = 8, which 8 Ulysses ranks cannot split."""
    gpt = Workload(model=load_model("gpt3-175b"), hardware=HW, gpus=64, global_batch=64,
                   seq_len=2048)
    with pytest.raises(PlanError, match=r"heads per tp rank \(12\) must be divisible by the "
                                        "Ulysses degree 8"):
        estimate(gpt, Layout(dp=1, tp=8, cp=8, cp_method="ulysses"))


def test_layout_names_its_settings_as_parallel_config_does():
    """One name per setting: every Layout field but the micro-batch size (``train``'s) is a
    ParallelConfig field of the same name, and a layout with each of them off its default
    survives the planner → tessera config → planner round trip."""
    parallel = {f.name for f in dataclasses.fields(ParallelConfig)}
    assert {f.name for f in dataclasses.fields(Layout)} - {"micro_batch"} <= parallel
    assert set(PARALLEL_FIELDS) == {f.name for f in dataclasses.fields(Layout)} - {
        "micro_batch", "stage_layout"}
    w = Workload(model=load_model("llama3-8b"), hardware=HW, gpus=64, global_batch=64,
                 seq_len=2048)
    L = Layout(dp=4, tp=2, pp=4, cp=4, virtual_stages=2, microbatch_group=8, micro_batch=2,
               zero_stage=1, recompute="selective", schedule="interleaved",
               sequence_parallel=True, cp_method="hybrid", cp_ulysses=4,
               stage_layout=(3, 4, 4, 4, 4, 4, 4, 5))
    assert engine.layout_of(engine.to_config(w, L)) == L


def test_hybrid_context_parallelism_is_its_two_pure_forms():
    """Hybrid CP (``parallel.cp_ulysses`` = u) is priced as the runtime runs it: Ulysses'
    all-to-alls over u ranks, the ring over cp/u. At u = cp it is pure Ulysses, at u = 1 pure
    ring, message steps, bytes, overlap and all; in between each phase is on its own group's
    link (Llama 3 8B, tp = 2, cp = 8 on 8-GPU nodes: the Ulysses pairs inside a node, the
    ring across nodes)."""
    from tessera.parallel.context_parallel import bytes_per_layer
    from tessera.planner.comm import context_parallel_times, p2p_link
    from tessera.planner.compute import block_costs

    spec = load_model("llama3-8b")
    w = Workload(model=spec, hardware=HW, gpus=16, global_batch=16, seq_len=8192)
    t, cp, b = 2, 8, 1

    def comm(method, u=2):
        blk = block_costs(w, t, cp, b, False, "none", method, u)
        return blk.cp_forward, blk.cp_backward, blk.cp_total

    assert comm("hybrid", cp) == comm("ulysses")
    assert comm("hybrid", 1) == comm("ring")
    assert comm("ring") != comm("ulysses")  # the two checks above compare different things
    # The whole estimate of the layout tessera runs at u = cp is pure Ulysses'.
    hybrid = Layout(dp=1, tp=t, cp=cp, cp_method="hybrid", cp_ulysses=cp)
    assert estimate(w, hybrid).step_time == estimate(
        w, dataclasses.replace(hybrid, cp_method="ulysses")).step_time
    # u = 2: the Ulysses pair's bytes on the intra-node link plus the ring of 4 (8 query
    # heads and 4·2/2 kv heads of 2·1024 tokens per rank) on the inter-node one (α = 0 to
    # compare bytes; the link passed is the cp group's, the Ulysses group's is given apart).
    intra, inter = p2p_link(HW, t * 2), p2p_link(HW, t * cp)
    assert intra.bandwidth != inter.bandwidth
    heads, kv, e = spec.heads // t, spec.kv_heads // t, w.bytes[3]
    ulysses = bytes_per_layer("ulysses", 2, b, heads, kv, 1024, spec.head_dim, e)
    ring = bytes_per_layer("ring", cp // 2, b, heads // 2, kv // 2, 2048, spec.head_dim, e)
    fwd, bwd, ring_fwd, ring_bwd = context_parallel_times(
        w, t, cp, b, "hybrid", dataclasses.replace(inter, alpha=0.0), 2,
        dataclasses.replace(intra, alpha=0.0))
    assert ring_fwd == pytest.approx(ring["forward"] * inter.beta)
    assert ring_bwd == pytest.approx(ring["backward"] * inter.beta)
    assert fwd - ring_fwd == pytest.approx(ulysses["forward"] * intra.beta)
    assert bwd - ring_bwd == pytest.approx(ulysses["backward"] * intra.beta)


def test_cp_ulysses_travels_with_the_layout():
    """parallel.cp_ulysses arrives in the planner's Layout from a run's config (the one
    conversion, ``engine.layout_of``, which ``report.planner_workload`` uses), goes back by
    ``engine.to_config``, and ``--layout`` reads it."""
    from tessera.planner.cli import parse_layout
    from tessera.report import planner_workload

    cfg = make_config("tiny", overrides=["parallel.cp=4", "parallel.cp_method=hybrid",
                                         "parallel.cp_ulysses=4"])
    w, L = planner_workload(cfg, 4, HW)
    assert (L.cp, L.cp_method, L.cp_ulysses) == (4, "hybrid", 4)
    assert engine.to_config(w, L).parallel.cp_ulysses == 4
    assert engine.layout_of(engine.to_config(w, L)) == L
    assert "cp_ulysses=4" in L.describe()
    assert parse_layout("cp=4,cp_method=hybrid,cp_ulysses=4", 8, 2).cp_ulysses == 4


def test_search_tries_the_ulysses_degrees_tessera_runs():
    """For hybrid CP the search tries every Ulysses degree, keeping exactly those
    ``layout.validate`` accepts (tiny: 4 heads, 2 kv heads; cp = 4 on 8 ranks: u = 2 and 4 at
    tp = 1, only 2 at tp = 2, where a rank has 2 heads); a catalog model of another shape keeps
    the planner's own rule."""
    from collections import Counter

    spec = load_model("tiny")
    w = Workload(model=spec, hardware=HW, gpus=8, global_batch=8, seq_len=spec.max_seq_len,
                 precision="fp32")
    space = SearchSpace(cp=(4,), cp_method=("hybrid",), pp=(1,), micro_batch=(1,),
                        zero_stage=(0,), recompute=("none",), sequence_parallel=(False,),
                        virtual_stages=(1,), tp_within_node=False)
    refused: Counter[str] = Counter()
    proposed = {(L.tp, L.cp_ulysses) for L in enumerate_layouts(w, space, refused)}
    accepted = set()
    for tp, u in itertools.product((1, 2), divisors(4)):
        L = Layout(dp=8 // (4 * tp), tp=tp, cp=4, cp_method="hybrid", cp_ulysses=u)
        if engine.refusal(w, L) is None:
            accepted.add((tp, u))
    assert proposed == accepted == {(1, 2), (1, 4), (2, 2)}
    assert any("parallel.cp_ulysses=1" in why for why in refused)
    gpt = Workload(model=load_model("gpt3-1.3b"), hardware=HW, gpus=16, global_batch=64,
                   seq_len=2048)
    with pytest.raises(PlanError, match="cp_ulysses=4 must be >= 2 and divide cp=2"):
        estimate(gpt, Layout(dp=4, tp=2, cp=2, cp_method="hybrid", cp_ulysses=4))
    estimate(gpt, Layout(dp=2, tp=2, cp=4, cp_method="hybrid", cp_ulysses=4))
