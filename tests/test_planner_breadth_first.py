"""Breadth-first pipeline parallelism (Lamy-Poirier 2022, "Breadth-First Pipeline
Parallelism") as the planner sees it, on the paper's hardware: 64 V100-32GB in 8 DGX-1 nodes
(InfiniBand), its 52B GPT (64 layers, h 8192, 64 heads) and 6.6B GPT (32 layers, h 4096,
32 heads), sequence 2048.

What the planner reproduces, and what it does not (docs/planner.md, "Breadth-first"):

- Fig. 2 (tp = pp = 8, dp = 1, micro-batch 1): breadth-first gains more from looping than
  depth-first (interleaved). The mechanism is the point-to-point transfer: depth-first runs
  each chunk over a group of p micro-batches, so the data a rank needs next was made by its
  neighbour in the slot just before, and every hop of every loop waits for one transfer;
  breadth-first runs all m > p micro-batches on a chunk, and the transfers arrive while the
  rank still works. The simulator times both from the same costs, and the transfers it
  exposes grow with the loops under depth-first only.
- Over a free search the paper's lead of breadth-first at small batch per GPU is NOT
  reproduced: at batch per GPU <= 1/4 the two tie or breadth-first leads by < 2%. At m = p
  Megatron's interleaved order *is* breadth-first's, and the planner's depth-first has what
  the paper's baseline (Megatron-LM, 2022) lacked: non-blocking sends, gradient reductions
  overlapped chunk by chunk, and a sharded optimizer (ZeRO-1). For the 52B model at batch 32
  and 64 breadth-first falls behind: holding all m·v activation sets, it needs full
  recomputation in 32 GB.
"""

from __future__ import annotations

from functools import lru_cache

from tessera.planner.estimate import Estimate, estimate, pipeline_comm_exposed
from tessera.planner.hardware import load_hardware
from tessera.planner.models import CATALOG
from tessera.planner.pipeline import build
from tessera.planner.search import SearchSpace, search
from tessera.planner.workload import Layout, Workload

V100 = load_hardware("V100")
GPT_52B = CATALOG["gpt-52b"]
GPT_6_6B = CATALOG["gpt-6.6b"]
DEPTH_FIRST = ("interleaved", "interleaved-lean")


def fig2(batch: int, schedule: str, v: int, recompute: str) -> Estimate:
    w = Workload(model=GPT_52B, hardware=V100, gpus=64, global_batch=batch, seq_len=2048)
    return estimate(w, Layout(dp=1, tp=8, pp=8, virtual_stages=v, micro_batch=1,
                              schedule=schedule if v > 1 else "1f1b", recompute=recompute,
                              sequence_parallel=True))


def test_fig2_breadth_first_gains_more_from_loops():
    """TP = PP = 8, DP = 1, micro-batch 1, sequence parallelism (breadth-first holds all m·v
    activation sets: in 32 GB at batch 16 only with the activations split over tp, at batch
    64 only with full recomputation, used for both schedules there). The planner's MFU from 1
    to 8 loops: batch 16, interleaved 37.4% -> 48.3%, breadth-first 37.4% -> 49.9%; batch 64,
    36.4% -> 39.5% and 36.4% -> 39.6%. Depth-first's exposed transfers grow with the loops
    (0.012 -> 0.103 s), breadth-first's stay those of the first fill (0.012 s)."""
    for batch, recompute in ((16, "none"), (64, "full")):
        gains = {}
        for schedule in ("interleaved", "bfs"):
            one, eight = fig2(batch, schedule, 1, recompute), fig2(batch, schedule, 8, recompute)
            assert eight.headroom > 0, (schedule, batch)
            gains[schedule] = eight.mfu - one.mfu
            exposed = [pipeline_comm_exposed(fig2(batch, schedule, v, recompute))
                       for v in (1, 2, 8)]
            print(f"batch {batch} {schedule}: MFU {100 * one.mfu:.1f}% -> "
                  f"{100 * eight.mfu:.1f}%, transfers exposed {exposed} s")
            if schedule == "bfs":
                assert max(exposed) < 1.01 * exposed[0]
            else:
                assert exposed[0] < exposed[1] < exposed[2] and exposed[2] > 4 * exposed[0]
        assert gains["bfs"] > gains["interleaved"] > 0


@lru_cache(maxsize=32)
def best(model_name: str, batch: int, schedules: tuple[str, ...]) -> Estimate:
    model = GPT_52B if model_name == "52b" else GPT_6_6B
    w = Workload(model=model, hardware=V100, gpus=64, global_batch=batch, seq_len=2048)
    return search(w, SearchSpace(schedule=schedules), top=1).best


def test_free_search_breadth_first_ties_at_small_batch_per_gpu():
    """The planner's figures (best breadth-first step time over best depth-first, free
    search): 52B: batch 8 1.000x, 16 1.017x; 6.6B: batch 8 and 16 1.000x. The paper's lead of
    10% or more at the smallest batch is not reproduced (module docstring)."""
    for name in ("52b", "6.6b"):
        for batch in (8, 16):
            bf, df = best(name, batch, ("bfs",)), best(name, batch, DEPTH_FIRST)
            lead = df.step_time / bf.step_time
            print(f"{name} batch {batch}: breadth-first {bf.layout.describe()} "
                  f"{100 * bf.mfu:.1f}%, depth-first {df.layout.describe()} "
                  f"{100 * df.mfu:.1f}%: lead {lead:.3f}")
            assert 0.999 <= lead < 1.05


def test_interleaved_at_m_equal_p_is_breadth_first():
    """Megatron's interleaved schedule runs its chunks over groups of p micro-batches, with a
    warm-up of 2(p - r - 1) + (v - 1)p forwards: at m = p every forward comes before any
    backward, in breadth-first's order, so at the smallest batches the two are one
    schedule."""
    for p, v in ((4, 2), (8, 4)):
        assert build("interleaved", p, p, v).actions == build("bfs", p, p, v).actions
    assert build("interleaved", 4, 8, 2).actions != build("bfs", 4, 8, 2).actions


def test_breadth_first_needs_recomputation_at_larger_batch_in_32_gb():
    """52B at batch 32: breadth-first holds all m·v activation sets, so its best layout in
    32 GB recomputes everything, and depth-first (holding about p) leads (planner: breadth-
    first at 0.80x depth-first's throughput)."""
    bf, df = best("52b", 32, ("bfs",)), best("52b", 32, DEPTH_FIRST)
    print(f"batch 32: breadth-first {bf.layout.describe()}, depth-first {df.layout.describe()}")
    assert bf.layout.recompute == "full" and df.layout.recompute != "full"
    assert bf.step_time > 1.1 * df.step_time


def _megatron_2022(est: Estimate) -> None:
    """Time a depth-first estimate as the paper's baseline ran (an experiment, not the
    planner's model): each pipeline exchange holds the rank until its transfer is done
    (Megatron-LM's p2p_communication waits on every batch_isend_irecv), so a chunk's forward
    and backward each carry one transfer and the data arrives when they end; gradients are
    reduced after the whole backward (its DDP of 2022). Breadth-first stays as the planner
    times it (the paper's own implementation overlaps both)."""
    from tessera.pipeline.simulator import StageCosts
    from tessera.planner.estimate import _per_chunk, run_simulation
    from tessera.planner.pipeline import time_pipeline

    L, costs = est.layout, est.costs
    if L.schedule == "bfs" or L.pp == 1:
        run_simulation(est)
        return
    fs, bs, ds = _per_chunk(costs)
    t = costs.p2p_latency + costs.p2p_bytes / costs.p2p_bandwidth
    n = len(fs)
    sim = StageCosts(forward=[f + t * (c < n - 1) for c, f in enumerate(fs)],
                     backward=[b + t * (c > 0) for c, b in enumerate(bs)],
                     dp_reduce=ds, dp_overlap=False)
    timing = time_pipeline(L.schedule, L.pp, est.m, L.virtual_stages, sim,
                           group=L.microbatch_group)
    est.step_time = timing.step_time + costs.optimizer_time + costs.sync_time
    est.makespan, est.busy = timing.makespan, timing.compute_time
    est.exposed_dp, est.simulated_m = timing.exposed_dp, timing.simulated_m


def test_against_the_papers_baseline_the_lead_grows_but_not_to_the_published_size(monkeypatch):
    """Pricing the paper's baseline (Megatron-LM 2022: blocking exchanges, reductions after
    the backward, no ZeRO) instead of the planner's depth-first, breadth-first's best leads
    by 1.08x (52B) and 1.22x (6.6B) at batch 16 (the planner's figures; the docs give batch
    8 and 32 too): the implementation accounts for part of the published lead, not for 10%
    at the 52B model's smallest batch nor for up to 43%."""
    import tessera.planner.search as search_module

    monkeypatch.setattr(search_module, "run_simulation", _megatron_2022)
    leads = {}
    for name, model in (("52b", GPT_52B), ("6.6b", GPT_6_6B)):
        w = Workload(model=model, hardware=V100, gpus=64, global_batch=16, seq_len=2048)
        bf = search(w, SearchSpace(schedule=("bfs",)), top=1).best
        df = search(w, SearchSpace(schedule=DEPTH_FIRST, zero_stage=(0,)), top=1).best
        leads[name] = df.step_time / bf.step_time
    print(leads)
    assert 1.03 < leads["52b"] < 1.10 < 1.12 < leads["6.6b"] < 1.35
