"""Breadth-first pipelining with ZeRO-3 (Lamy-Poirier, MLSys 2023): the schedule carries the
data-parallel collectives.

- IR: ``add_sharding_actions`` for bfs and 1f1b, the string form round trip, and the validator
  rejecting a compute outside UNSHARD..RESHARD and a REDUCE_GRAD before the last backward;
  the simulator and ``tessera schedule --zero-stage 3`` show the actions.
- Parity: (dp, tp, pp) = (2, 1, 4), bfs v = 2, ZeRO-3, 8 ranks, against the single-device model.
- Counted all-gathers per step (the real collectives, counted where ZeRO calls them): breadth-
  first gathers each chunk twice per step (its forwards, its backwards) and the rank's last
  chunk once, whatever m; depth-first 1F1B under ZeRO-3 (the per-micro-batch hooks) grows with m.
- Timing: a chunk's reduce-scatter starts before the rank's last backward of the step ends.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from dp_parity import ADAM_ROUNDINGS, Shadow
from tessera.cli import app
from tessera.config_io import make_config
from tessera.model import build_model, cross_entropy
from tessera.optim import adamw
from tessera.pipeline.schedule import (
    Action,
    Kind,
    ScheduleError,
    add_sharding_actions,
    lower_comms,
    parse,
)
from tessera.pipeline.schedules import build_schedule
from tessera.pipeline.simulator import StageCosts, peak_unsharded, simulate, unshard_counts
from tessera.pipeline.validator import validate
from tessera.testing import assert_close_summed, assert_curves_close, run_ranks
from tessera.topology import Topology

SEQ, VOCAB, GLOBAL_BATCH, STEPS = 16, 64, 8, 10


# ---------------------------------------------------------------------------------------------
# The IR


def test_bfs_lowering_gathers_each_chunk_per_run_with_prefetch():
    s = add_sharding_actions(build_schedule("bfs", 2, 4, 2))
    assert s.to_string().splitlines()[1] == (
        "rank 0: 0UNSHARD 0F0 0F1 0F2 2UNSHARD 0F3 0RESHARD 2F0 2F1 2F2 2F3 2B0 2B1 2B2 "
        "0UNSHARD 2B3 2REDUCE_GRAD 2RESHARD 0B0 0B1 0B2 0B3 0REDUCE_GRAD 0RESHARD")
    # Twice per chunk per step (forwards, backwards), once for the rank's last chunk (its
    # backwards follow its forwards), for any m; at most two chunks gathered (prefetch).
    for m in (1, 2, 4, 8, 16):
        for pp, v in ((2, 2), (4, 2), (2, 4)):
            sharded = add_sharding_actions(build_schedule("bfs", pp, m, v))
            for r, counts in enumerate(unshard_counts(sharded)):
                last = max(sharded.chunks_of(r))
                assert counts == {c: 1 if c == last else 2 for c in sharded.chunks_of(r)}
            assert peak_unsharded(sharded) == [2] * pp


def test_1f1b_lowering_keeps_its_one_chunk_gathered_all_step():
    # Depth-first with one chunk per rank: no run ends before the step does, so the IR form
    # keeps all of the rank's parameters gathered (what training does instead: the hooks).
    s = add_sharding_actions(build_schedule("1f1b", 2, 4, 1))
    assert s.to_string().splitlines()[1:] == [
        "rank 0: 0UNSHARD 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0REDUCE_GRAD 0RESHARD",
        "rank 1: 1UNSHARD 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1REDUCE_GRAD 1RESHARD"]
    # Interleaved (depth-first, v = 2) regathers as m grows.
    counts = [sum(sum(c.values()) for c in unshard_counts(
        add_sharding_actions(build_schedule("interleaved", 2, m, 2)))) for m in (2, 4, 8)]
    assert counts[0] < counts[1] < counts[2], counts


@pytest.mark.parametrize("name,pp,m,v", [("bfs", 2, 3, 2), ("bfs", 4, 8, 2), ("1f1b", 4, 8, 1),
                                         ("interleaved", 2, 4, 2), ("gpipe", 3, 2, 1)])
def test_sharded_schedules_round_trip_and_validate(name, pp, m, v):
    compute = build_schedule(name, pp, m, v)
    sharded = validate(add_sharding_actions(compute))
    lowered = validate(lower_comms(sharded))
    assert add_sharding_actions(lower_comms(compute)) == lowered  # either order of the passes
    for s in (sharded, lowered):
        assert parse(s.to_string()) == s
        assert all(str(Action.parse(str(a))) == str(a) for acts in s.actions for a in acts)
    assert Action.parse("3REDUCE_GRAD") == Action(3, Kind.REDUCE_GRAD)
    with pytest.raises(ScheduleError, match="already has sharding actions"):
        add_sharding_actions(sharded)


GOOD = "rank 0: 0UNSHARD 0F0 0F1 0B0 0B1 0REDUCE_GRAD 0RESHARD"


@pytest.mark.parametrize("text,message", [
    ("rank 0: 0UNSHARD 0F0 0RESHARD 0F1 0UNSHARD 0B0 0B1 0REDUCE_GRAD 0RESHARD",
     "0F1 runs while chunk 0 is sharded"),
    ("rank 0: 0F0 0UNSHARD 0F1 0B0 0B1 0REDUCE_GRAD 0RESHARD", "0F0 runs while chunk 0 is"),
    ("rank 0: 0UNSHARD 0F0 0F1 0B0 0REDUCE_GRAD 0B1 0RESHARD",
     "0REDUCE_GRAD comes before 0B1"),
    ("rank 0: 0UNSHARD 0F0 0F1 0B0 0B1 0RESHARD", "no 0REDUCE_GRAD after its last backward"),
    ("rank 0: 0UNSHARD 0F0 0F1 0B0 0B1 0REDUCE_GRAD", "still unsharded at the end"),
    ("rank 0: 0UNSHARD 0F0 0UNSHARD 0F1 0B0 0B1 0REDUCE_GRAD 0RESHARD", "already unsharded"),
    ("rank 0: 0UNSHARD 0F0 0F1 0B0 0B1 0REDUCE_GRAD 0REDUCE_GRAD 0RESHARD", "appears twice"),
])
def test_validator_rejects_bad_sharding(text, message):
    validate(parse(GOOD))
    with pytest.raises(ScheduleError, match=message):
        validate(parse(text))


def test_simulator_times_gathers_and_reductions():
    s = add_sharding_actions(build_schedule("bfs", 2, 4, 2))
    result = simulate(s, StageCosts(forward=1.0, backward=2.0, unshard=0.5, dp_reduce=0.75))
    events = {(e.rank, e.kind, e.chunk, e.microbatch): e for e in result.timeline}
    assert events[(0, "F", 0, 0)].start == 0.5  # the first forward waits for its all-gather
    gathers = [e for e in result.timeline if e.kind == "unshard" and e.rank == 0]
    assert [e.chunk for e in gathers] == [0, 2, 0] and all(e.end - e.start == 0.5
                                                           for e in gathers)
    reduce2 = events[(0, "reduce", 2, -1)]
    assert reduce2.start == events[(0, "B", 2, 3)].end  # right after the chunk's last backward
    assert reduce2.end < events[(0, "B", 0, 3)].end  # hidden behind chunk 0's backwards
    assert not any(e.kind == "dp" for e in result.timeline)  # REDUCE_GRAD replaces it


def test_schedule_command_zero_stage_3(tmp_path):
    result = CliRunner().invoke(app, ["schedule", "--schedule", "bfs", "--pp", "2",
                                      "--microbatches", "8", "--virtual", "2",
                                      "--zero-stage", "3", "--gather", "1",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "rank 0: 0UNSHARD 0F0" in result.output
    assert "rank 0: chunk 0: 2, chunk 2: 1 (3 all-gathers, 2 reduce-scatters), at most 2 of 2" \
        in result.output
    assert (tmp_path / "bfs_pp2_v2_m8.png").read_bytes()[:4] == b"\x89PNG"
    assert "all-gather chunk 2" in (tmp_path / "bfs_pp2_v2_m8.trace.json").read_text()


# ---------------------------------------------------------------------------------------------
# Running it


def config(pp: int, schedule: str, v: int, m: int, layers: int, dp: int = 2, lr: float = 1e-2):
    return make_config(
        None,
        model=dict(vocab_size=VOCAB, d_model=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                   max_seq_len=SEQ),
        data=dict(seq_len=SEQ),
        parallel=dict(dp=dp, pp=pp, schedule=schedule, virtual_stages=v, zero_stage=3),
        train=dict(grad_accum=m, micro_batch_size=GLOBAL_BATCH // dp // m, lr=lr,
                   steps=STEPS, warmup_steps=0, grad_clip=1.0))


def global_batch(step: int, rows: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # (G, T) each


def local_micro_batches(step: int, dp_rank: int, dp: int, m: int, rows: int = GLOBAL_BATCH):
    x, y = global_batch(step, rows)
    per = rows // dp
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return list(zip(x.chunk(m), y.chunk(m), strict=True))


def train_parallel(cfg) -> dict:
    """STEPS steps; rank 0 returns per step the loss, the gradients before and after clipping,
    the norm, and the parameters before every step and after the last (all gathered by
    reference name), and the token-summed validation loss of the final weights."""
    from tessera.step import build_executor

    topo = Topology.build(cfg.parallel)
    ex = build_executor(cfg, topo, torch.device("cpu"))
    assert ex.model.schedule_driven
    opt = ex.optimizer()
    out: dict = dict(losses=[], grads=[], norms=[], clipped=[], states=[ex.full_state_dict()])
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        micro = local_micro_batches(step, topo.coords()["dp"], cfg.parallel.dp,
                                    cfg.train.grad_accum)
        out["losses"].append(ex.forward_backward(micro))
        out["grads"].append(ex.model.full_grads())
        out["norms"].append(ex.clip_grad_norm_(cfg.train.grad_clip))
        out["clipped"].append(ex.model.full_grads())
        opt.step()
        out["states"].append(ex.full_state_dict())
    out["val"], _ = ex.eval_loss(local_micro_batches(STEPS, topo.coords()["dp"],
                                                     cfg.parallel.dp, cfg.train.grad_accum))
    return out if topo.rank == 0 else None


def train_reference(cfg) -> list[float]:
    """The free-running single-device run's loss per step."""
    model = build_model(cfg.model, cfg.train.seed)
    opt = adamw(model.parameters(), cfg.train)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = global_batch(step)
        loss = cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bfs_zero3_dp2_pp4_matches_single_device():
    cfg = config(pp=4, schedule="bfs", v=2, m=4, layers=8, lr=1e-3)
    run = run_ranks(train_parallel, cfg.parallel.world_size, args=(cfg,), timeout=240)[0]
    tokens = GLOBAL_BATCH * SEQ
    # Losses: the same fp32 sums in another order (2 dp halves x 4 micro-batches, each a mean,
    # against one mean over the batch), plus the weights' drift from every earlier step's
    # reordered gradient sums: step k within the summation bound of k global batches' tokens.
    assert_curves_close(run["losses"], train_reference(cfg), terms_per_step=tokens,
                        msg="bfs zero-3 losses")
    # Every step against the single-device model teacher-forced onto the run (tests/
    # dp_parity.py's Shadow, the pattern of assert_matches_reference): from the run's
    # parameters before the step, its loss, gradients and norm sum the batch's `tokens` tokens
    # in another order (2 dp halves x 4 micro-batches, ZeRO-3's reduce-scatter), so the
    # summation bound over `tokens` terms, each tensor's largest magnitude as its scale; a
    # missing micro-batch or dp rank, or a missing 1/N, is off by far more. Then torch's AdamW
    # from the run's parameters with the run's own clipped gradients: the same elementwise
    # arithmetic on the same inputs (ZeRO's shards vectorized elsewhere), ADAM_ROUNDINGS
    # roundings of values as large as the parameters. This leaves out the free-running
    # parameters' distance, which Adam's division by sqrt(v) makes chaotic in entries whose
    # gradient is round-off sized (tessera.testing's docstring): no fixed tolerance on it.
    shadow = Shadow(cfg)
    for step in range(STEPS):
        before, after = run["states"][step], run["states"][step + 1]
        twin = shadow.gradients(before, [global_batch(step)])
        label = f"bfs zero-3 step {step}"
        assert_close_summed(run["losses"][step], twin["loss"], terms=tokens, msg=f"{label} loss")
        # | ‖g + δ‖ − ‖g‖ | <= ‖δ‖: the gradients' bound.
        assert_close_summed(run["norms"][step], twin["norm"], terms=tokens, msg=f"{label} norm")
        assert run["grads"][step].keys() == twin["grads"].keys()
        for name, want in twin["grads"].items():
            assert_close_summed(run["grads"][step][name], want, terms=tokens,
                                msg=f"{label} grad {name}")
        want_after = shadow.optimizer_step(before, run["clipped"][step])
        assert after.keys() == want_after.keys()
        for name, want in want_after.items():
            assert_close_summed(after[name], want, terms=ADAM_ROUNDINGS,
                                msg=f"{label} param {name}")
    # Evaluation runs the breadth-first forwards with their own UNSHARD / RESHARD. The run's
    # token-summed validation loss of its final weights against the single-device model's on
    # those same weights: a sum of GLOBAL_BATCH·SEQ positive per-token losses in another order
    # (per dp half, per micro-batch), so the summation bound over that many terms, the sum
    # itself as the scale.
    final = build_model(cfg.model, cfg.train.seed)
    final.load_state_dict(run["states"][-1])
    with torch.no_grad():
        x, y = global_batch(STEPS)
        want_val = float(cross_entropy(final(x), y)) * y.numel()
    assert_close_summed(run["val"], want_val, terms=y.numel(), msg="bfs zero-3 validation")


def count_collectives(cfg, ms: tuple[int, ...]) -> dict:
    """Per m: the unit all-gathers and reduce-scatters ZeRO issued during one step (counted at
    the collectives ZeRO calls), this rank's events of that step, and its chunks' unit counts."""
    import tessera.parallel.zero as zero
    from tessera.step import build_executor

    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    zero.all_gather_single = counted("all_gather", zero.all_gather_single)
    zero.reduce_scatter_single = counted("reduce_scatter", zero.reduce_scatter_single)
    topo = Topology.build(cfg.parallel)
    ex = build_executor(cfg, topo, torch.device("cpu"))
    opt = ex.optimizer()
    out: dict = {"units": {c: len(ex.model.wrappers[c].units) for c in ex.model.wrappers},
                 "driven": ex.model.schedule_driven}
    for m in ms:
        for step in range(2):  # the second step is counted (the first builds and caches)
            opt.zero_grad(set_to_none=True)
            micro = local_micro_batches(step, topo.coords()["dp"], cfg.parallel.dp, m,
                                        rows=2 * m)
            counts.update(all_gather=0, reduce_scatter=0)
            ex.forward_backward(micro)
            opt.step()
        out[m] = dict(counts, events=ex.last_record.events)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gathers_per_step_bfs_constant_depth_first_grows_and_reduce_overlaps():
    ms = (4, 8)
    bfs = run_ranks(count_collectives, 4, args=(config(2, "bfs", 2, 4, layers=4), ms))
    dfs = run_ranks(count_collectives, 4, args=(config(2, "1f1b", 1, 4, layers=4), ms))
    for rank in range(4):
        got, units = bfs[rank], bfs[rank]["units"]
        assert got["driven"] and not dfs[rank]["driven"]
        last = max(units)
        # Breadth-first: each unit of a chunk gathered twice per step (its run of forwards, its
        # run of backwards), the rank's last chunk once; one reduce-scatter per unit per step.
        want_gathers = sum(n * (1 if c == last else 2) for c, n in units.items())
        for m in ms:
            assert got[m]["all_gather"] == want_gathers, (rank, m, got[m]["all_gather"])
            assert got[m]["reduce_scatter"] == sum(units.values())
        # Depth-first 1F1B under ZeRO-3 (hooks): every micro-batch gathers each unit for its
        # forward and, except the embedding and the unit kept from forward into backward, for
        # its backward: 2U - 1 - E per micro-batch (E = 1 on the embedding's rank), and reduce-
        # scatters each unit after every backward: U per micro-batch.
        (c,) = dfs[rank]["units"]
        u, e = dfs[rank]["units"][c], int(c == 0)
        for m in ms:
            assert dfs[rank][m]["all_gather"] == m * (2 * u - 1 - e), (rank, m, dfs[rank][m])
            assert dfs[rank][m]["reduce_scatter"] == m * u
        # The reduce-scatter of every chunk but the rank's last-reduced one starts before the
        # rank's last backward of the step ends (it overlaps the later chunks' backwards).
        for m in ms:
            events = got[m]["events"]
            last_backward_end = max(e.end for e in events if e.kind == "B")
            reduces = sorted((e for e in events if e.kind == "reduce"), key=lambda e: e.start)
            assert [e.chunk for e in reduces] == sorted(units, reverse=True)
            for e in reduces:
                own_last = max(b.end for b in events if b.kind == "B" and b.chunk == e.chunk)
                assert e.start >= own_last
            assert all(e.start < last_backward_end for e in reduces[:-1]), reduces
