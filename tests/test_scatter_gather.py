"""Scatter/gather between pipeline stages (``tessera.pipeline.scatter_gather``).

- The boundary's arithmetic without processes: which slice a rank sends (of a non-contiguous
  tensor too), the identity with one part (tp 1, sequence parallelism, the option off), the
  refusal of a tensor t does not divide and of a received piece of the wrong size.
- One 4-rank launch (tp 2 × pp 2, gloo) runs one step of several layouts: every point-to-point
  send the runtime records carries 1/t of the (B, T, h) fp32 tensor with scatter/gather and all
  of it without, under 1F1B and interleaving; under sequence parallelism 1/t either way (each
  rank's own tokens); the receiving stages' all-gathers are counted in the tp group's stats,
  an activation's as forward and a gradient's as backward traffic;
  and the loss and every parameter's gradient match the single-device model's.
  The 10-step parity of (1,2,2) 1F1B, (1,2,4) interleaved and (1,2,2) with sequence parallelism
  (scatter/gather on, the default) is in tests/test_composition.py's matrix.

Tolerance: each gradient element sums the 8·16 = 128 tokens of the batch in another order
(micro-batches, tp partial sums, the hand-offs): ``assert_close_summed(terms=128)``, as in
tests/test_composition.py. Gathering slices moves bits without arithmetic, so on and off agree
within the same bound (a wrong slice or a swapped rank order is off by O(max|g|)).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tessera.config import Config
from tessera.config_io import make_config
from tessera.config_warnings import ignored_options
from tessera.model import build_model, cross_entropy
from tessera.parallel.comm import CommStats
from tessera.pipeline.scatter_gather import StageBoundary
from tessera.pipeline.schedule import Kind, lower_comms
from tessera.step import build_executor
from tessera.testing import assert_close_summed, run_ranks
from tessera.topology import Topology

BATCH, SEQ, D_MODEL, M = 8, 16, 32, 2
N_TOKENS = BATCH * SEQ
FULL_BYTES = (BATCH // M) * SEQ * D_MODEL * 4  # one micro-batch's (B, T, h) in fp32


def test_a_rank_sends_its_slice_of_the_flattened_tensor():
    x = torch.arange(24.0).view(2, 3, 4)  # (B, T, h)
    first, second = StageBoundary(parts=2, rank=0), StageBoundary(parts=2, rank=1)
    assert torch.equal(first.scatter(x), torch.arange(12.0))
    assert torch.equal(second.scatter(x), torch.arange(12.0, 24.0))
    assert second.wire_shape((2, 3, 4)) == (12,)
    assert second.scatter(x).data_ptr() == x.data_ptr() + 12 * 4  # a view: no copy


def test_a_non_contiguous_tensor_is_sliced_in_its_logical_order():
    # An input gradient may come out of autograd with any strides: the slice is of the
    # tensor's row-major order, as the receiver's gather and view rebuild it.
    x = torch.arange(24.0).view(4, 3, 2).transpose(0, 2)  # (2, 3, 4), not contiguous
    assert not x.is_contiguous()
    for rank in (0, 1):
        got = StageBoundary(parts=2, rank=rank).scatter(x)
        assert torch.equal(got, x.reshape(-1)[rank * 12:(rank + 1) * 12])


def test_a_piece_of_the_wrong_size_is_refused_before_gathering():
    boundary = StageBoundary(parts=2, rank=0)
    with pytest.raises(ValueError, match=r"a piece of 8 elements is not 1/2 of shape "
                                         r"\(2, 3, 4\)"):
        boundary.gather(torch.zeros(8), (2, 3, 4))


def test_one_part_is_the_identity():
    x = torch.randn(2, 3, 4)
    for boundary in (StageBoundary(),
                     StageBoundary.over_tp(None, sequence_parallel=False, enabled=True)):
        assert boundary.parts == 1
        assert boundary.scatter(x) is x
        assert boundary.gather(x, (2, 3, 4)) is x
        assert boundary.wire_shape((2, 3, 4)) == (2, 3, 4)


def test_a_tensor_that_does_not_split_evenly_is_refused():
    boundary = StageBoundary(parts=4, rank=1)
    with pytest.raises(ValueError, match=r"shape \(1, 3, 3\) \(9 elements\) does not split "
                                         r"into 4 equal parts"):
        boundary.scatter(torch.zeros(1, 3, 3))
    with pytest.raises(ValueError, match="does not split into 4"):
        boundary.wire_shape((1, 3, 3))


def test_switching_it_off_where_it_does_nothing_is_reported():
    def warned(**parallel) -> list[str]:
        cfg = make_config(None, parallel={"scatter_gather": False, **parallel})
        return [w for w in ignored_options(cfg) if "scatter_gather" in w]

    assert warned(tp=1, pp=2) == ["parallel.scatter_gather=False: no effect, no tensor "
                                  "parallelism (parallel.tp=1)"]
    assert "one pipeline stage" in warned(tp=2, pp=1)[0]
    assert "sequence parallelism already" in warned(tp=2, pp=2, sequence_parallel=True)[0]
    assert warned(tp=2, pp=2) == []


def _cfg(**parallel) -> Config:
    return make_config(
        None, model=dict(d_model=D_MODEL, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ),
        data=dict(seq_len=SEQ), parallel=dict(dp=1, tp=2, pp=2, **parallel),
        train=dict(grad_accum=M, micro_batch_size=BATCH // M, warmup_steps=0))


CASES: dict[str, Config] = {
    "1f1b on": _cfg(),
    "1f1b off": _cfg(scatter_gather=False),
    "interleaved on": _cfg(schedule="interleaved", virtual_stages=2),
    "interleaved off": _cfg(schedule="interleaved", virtual_stages=2, scatter_gather=False),
    "sp on": _cfg(sequence_parallel=True),
    "sp off": _cfg(sequence_parallel=True, scatter_gather=False),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _one_step(name: str) -> dict:
    cfg = CASES[name]
    topo = Topology.build(cfg.parallel)
    stats = CommStats()
    executor = build_executor(cfg, topo, torch.device("cpu"), tp_stats=stats)
    x, y = _batch()
    loss = executor.forward_backward(list(zip(x.chunk(M), y.chunk(M), strict=True)))
    gathers = [r for r in stats.records if r.tag == "pipeline:gather"]
    received = lower_comms(executor.model.schedule).actions[executor.pp_rank]
    return {"loss": loss, "grads": executor.model.full_grads(),
            "sent": executor.last_record.sent_bytes,
            "gathered": {(r.phase, r.numel) for r in gathers}, "gathers": len(gathers),
            "phases": Counter(r.phase for r in gathers),
            "receives": Counter({"forward": sum(a.kind is Kind.RECV_F for a in received),
                                 "backward": sum(a.kind is Kind.RECV_B for a in received)})}


def _cases_rank() -> dict[str, dict]:
    return {name: _one_step(name) for name in CASES}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sends_carry_one_tp_share_and_training_matches_the_single_device_model():
    cfg = _cfg()
    model = build_model(cfg.model, cfg.train.seed)
    x, y = _batch()
    ref_loss = cross_entropy(model(x), y)
    ref_loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    results = run_ranks(_cases_rank, 4, timeout=600)
    for rank, per_case in enumerate(results):
        for name, got in per_case.items():
            label = f"{name} rank {rank}"
            sg = CASES[name].parallel.scatter_gather
            sp = CASES[name].parallel.sequence_parallel
            # 1F1B and interleaving both send M activations and M gradients per boundary
            # crossing this rank takes part in; every one of them 1/t of the tensor or all of it
            share = FULL_BYTES // 2 if sg or sp else FULL_BYTES
            assert got["sent"] and set(got["sent"]) == {share}, (label, got["sent"])
            if sg and not sp:  # every receive gathers the full tensor over tp (as many
                # receives as sends on each rank at pp 2)
                assert {n for _, n in got["gathered"]} == {FULL_BYTES // 4}, label
                assert got["gathers"] == len(got["sent"]), label
                # an activation's gather is counted as forward traffic, a gradient's as
                # backward (the tp group's stats by phase)
                assert got["phases"] == got["receives"], label
            else:
                assert got["gathers"] == 0, label
            assert_close_summed(got["loss"], ref_loss.item(), terms=N_TOKENS, msg=label)
            assert got["grads"].keys() == ref.keys(), label
            for k, want in ref.items():
                assert_close_summed(got["grads"][k], want, terms=N_TOKENS, msg=f"{label} {k}")
