"""Context-parallel attention (ring, all-gather, Ulysses, hybrid) against ``AttentionCore``.

Each rank holds its zig-zag (or contiguous) share of q, k, v of one causal attention over the
whole sequence; the output and the q/k/v gradients, put back in sequence order, must equal the
reference core's on the whole sequence (SDPA, fp32, causal, grouped-query heads).

Tolerance: the methods compute the same softmax by another association: ring and all-gather
merge per-block results by log-sum-exp (one exp and one rescale per block, error a few ε
relative each, ε = 2⁻²⁴), Ulysses runs the reference SDPA on reordered tokens (exact up to
summation order). Each output element is a convex combination of v entries over T ≤ 40 keys,
so reassociation moves it by ≤ T·ε·max|v| ≈ 40·6e-8·4 ≈ 1e-5 in the worst case; gradients are
sums over T queries of products of such terms, same order. We bound every tensor by
TOL = 2e-5 × max|reference| (measured ≤ 1e-6); a missing block, a wrong mask or a gradient
that never made it back around the ring is an O(1)·max error.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.model import AttentionCore
from tessera.parallel.comm import CommStats
from tessera.parallel.context_parallel import (
    ContextParallelAttention,
    CPContext,
    bytes_per_layer,
    hybrid_groups,
    sequence_positions,
    shard_sequence,
    ulysses_kv_repeat,
    unshard_sequence,
)
from tessera.parallel.ring_attention import explicit_block_backward, explicit_block_forward
from tessera.testing import run_ranks

B, HEADS, HD = 2, 4, 8
TOL = 2e-5  # relative to max|reference|, see the module docstring


def _inputs(T: int, n_kv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, T, HD, generator=g)
    k = torch.randn(B, n_kv, T, HD, generator=g)
    v = torch.randn(B, n_kv, T, HD, generator=g)
    dout = torch.randn(B, HEADS, T, HD, generator=g)
    return q, k, v, dout


def _reference(T: int, n_kv: int):
    q, k, v, dout = _inputs(T, n_kv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    y = AttentionCore()(q, k, v)
    (y * dout).sum().backward()
    return y.detach(), q.grad, k.grad, v.grad


def saved_bytes(fn):
    """(bytes of the distinct storages autograd saves while fn runs, fn())."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _cp_rank(cases, ulysses=2, explicit=False):
    """Runs on each cp rank: every case's local output and q/k/v gradients, and the logs
    (hybrid with Ulysses groups of `ulysses` ranks). `explicit`: every block takes the
    masked-matmul path that runs off CPU (the fused CPU kernel is switched off in this rank's
    process), so the ring's and all-gather's own backward inputs (delta) are used."""
    if explicit:
        from tessera.parallel import ring_attention

        ring_attention._fused_causal = lambda q, q_pos, k_pos: None
    cp, rank = dist.get_world_size(), dist.get_rank()
    u_group, r_group = hybrid_groups([list(range(cp))], ulysses, rank)
    results = []
    for method, layout, T, n_kv in cases:
        q, k, v, dout = (shard_sequence(t, 2, cp, rank, layout) for t in _inputs(T, n_kv))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        ctx = CPContext(dist.group.WORLD, method, layout, ulysses_group=u_group,
                        ring_group=r_group, stats=CommStats())
        saved, y = saved_bytes(lambda: ContextParallelAttention(ctx)(q, k, v))  # noqa: B023
        (y * dout).sum().backward()
        results.append({"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                        "products": ctx.work.products,
                        "skipped": ctx.work.skipped, "stats": ctx.stats, "saved": saved})
    return results


CASES = [("ring", "zigzag", 32, 4), ("ring", "zigzag", 32, 2), ("ring", "contiguous", 32, 1),
         ("allgather", "zigzag", 32, 2), ("ulysses", "zigzag", 32, 4),
         ("ulysses", "zigzag", 32, 1), ("hybrid", "zigzag", 32, 2),
         # T = 8: at cp = 4 chunks of one token, where a diagonal block's only key is its only
         # query (a skip rule with >= for > drops it)
         ("ring", "zigzag", 8, 2), ("allgather", "zigzag", 8, 2)]


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_parity(cp):
    """Output and q/k/v gradients of every method equal the reference core's (cp 2 and 4;
    GQA with kv heads equal to, fewer than, and (Ulysses) fewer than cp)."""
    per_rank = run_ranks(_cp_rank, cp, args=(CASES,))
    for i, (method, layout, T, n_kv) in enumerate(CASES):
        ref = dict(zip(("y", "dq", "dk", "dv"), _reference(T, n_kv), strict=True))
        for name, want in ref.items():
            got = unshard_sequence([r[i][name] for r in per_rank], 2, layout)
            err = (got - want).abs().max().item()
            assert err <= TOL * want.abs().max().item(), (method, layout, n_kv, name, err)
        # communication: the bytes counted per rank equal the module's formulas (exactly)
        want = bytes_per_layer(method, cp, B, HEADS, n_kv, T // cp, HD)
        for r in per_rank:
            for phase in ("forward", "backward"):
                assert r[i]["stats"].bytes_sent(phase=phase) == pytest.approx(want[phase]), \
                    (method, phase)


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_parity_on_the_explicit_block_path(cp):
    """Ring, all-gather and hybrid with every block on the masked-matmul path (the path off
    CPU): output and q/k/v gradients equal the reference core's (TOL, module docstring). On
    CPU the fused kernel computes its own rowsum(dO·O), so a wrong delta in the ring's or
    all-gather's backward passed every other parity test."""
    cases = [c for c in CASES if c[0] in ("ring", "allgather", "hybrid")]
    per_rank = run_ranks(_cp_rank, cp, args=(cases,), kwargs={"explicit": True})
    for i, (method, layout, T, n_kv) in enumerate(cases):
        ref = dict(zip(("y", "dq", "dk", "dv"), _reference(T, n_kv), strict=True))
        for name, want in ref.items():
            got = unshard_sequence([r[i][name] for r in per_rank], 2, layout)
            err = (got - want).abs().max().item()
            assert err <= TOL * want.abs().max().item(), (method, layout, T, name, err)


def _ring_bf16_bytes():
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = (shard_sequence(t, 2, cp, rank).bfloat16() for t in _inputs(16, 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ctx = CPContext(dist.group.WORLD, "ring", stats=CommStats())
    (ContextParallelAttention(ctx)(q, k, v) * dout).sum().backward()
    return {phase: ctx.stats.bytes_sent(phase=phase) for phase in ("forward", "backward")}


def test_ring_bytes_in_bf16_count_the_fp32_gradient_accumulators():
    """Ring in bf16 (cp = 2): K/V travel in bf16, the dK/dV accumulators in fp32, so backward
    sends (cp−1)·|KV| + cp·2·|KV| bytes; the counted bytes equal ``bytes_per_layer`` with
    element_size 2 (exactly). Every other test runs fp32, where the accumulators' factor
    4/element_size is 1."""
    per_rank = run_ranks(_ring_bf16_bytes, 2)
    want = bytes_per_layer("ring", 2, B, HEADS, 2, 8, HD, element_size=2)
    kv = 2 * B * 2 * 8 * HD * 2  # |K|+|V| local in bf16
    assert want == {"forward": kv, "backward": kv + 2 * 2 * kv}
    for got in per_rank:
        assert got == want  # byte counts: integers, exact


@pytest.mark.multiprocess
def test_hybrid_over_the_whole_cp_group():
    """Hybrid with cp_ulysses = cp = 4 (the ring over one rank): output and gradients equal
    the reference core's, and the bytes counted are ``bytes_per_layer`` at that degree (the
    planner's price), which are pure Ulysses' bytes."""
    case = ("hybrid", "zigzag", 32, 2)
    per_rank = run_ranks(_cp_rank, 4, args=([case], 4))
    ref = dict(zip(("y", "dq", "dk", "dv"), _reference(32, 2), strict=True))
    for name, want in ref.items():
        got = unshard_sequence([r[0][name] for r in per_rank], 2, "zigzag")
        assert (got - want).abs().max().item() <= TOL * want.abs().max().item(), name
    want = bytes_per_layer("hybrid", 4, B, HEADS, 2, 8, HD, ulysses=4)
    assert want == bytes_per_layer("ulysses", 4, B, HEADS, 2, 8, HD)
    for r in per_rank:
        for phase in ("forward", "backward"):
            assert r[0]["stats"].bytes_sent(phase=phase) == pytest.approx(want[phase]), phase


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balance(cp):
    """Zig-zag: every rank computes 2·cp+1 chunk-pair products (differ by 0 ≤ 1); contiguous:
    rank r computes 4r+3, the last rank 4·cp−1 against the first's 3. Each rank's 2 query
    chunks meet all 2·cp key chunks, so the pairs it skips are the other 4·cp − products."""
    cases = [("ring", "zigzag", 8 * cp, 2), ("ring", "contiguous", 8 * cp, 2)]
    per_rank = run_ranks(_cp_rank, cp, args=(cases,))
    zigzag = [r[0]["products"] for r in per_rank]
    contiguous = [r[1]["products"] for r in per_rank]
    assert zigzag == [2 * cp + 1] * cp
    assert max(zigzag) - min(zigzag) <= 1
    assert contiguous == [4 * r + 3 for r in range(cp)]
    for i in range(2):
        assert [r[i]["products"] + r[i]["skipped"] for r in per_rank] == [4 * cp] * cp
    print(f"cp={cp} chunk-pair products per rank: zig-zag {zigzag}, contiguous {contiguous}")


def test_positions_zigzag_and_refusal():
    assert sequence_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    x = torch.arange(24).view(1, 24)
    parts = [shard_sequence(x, 1, 3, r) for r in range(3)]
    assert torch.equal(unshard_sequence(parts, 1), x)
    with pytest.raises(ValueError, match="multiple of 2\\*cp=4"):
        sequence_positions(10, 2, 0)
    with pytest.raises(ValueError, match="must be divisible by the Ulysses degree 4"):
        ulysses_kv_repeat(6, 2, 4)
    with pytest.raises(ValueError, match="kv heads per tp rank \\(3\\)"):
        ulysses_kv_repeat(12, 3, 2)
    assert ulysses_kv_repeat(8, 2, 4) == 2
    with pytest.raises(ValueError, match="Ulysses degree 2 must divide cp=3"):
        hybrid_groups([[0, 1, 2]], 2, 0)  # refused before any group is made
    # CPContext names the field: an unknown method would fall through to hybrid's branch, an
    # unknown layout to the contiguous positions
    with pytest.raises(ValueError, match="cp_method='tree': must be one of ring, allgather"):
        CPContext(None, "tree")
    with pytest.raises(ValueError, match="layout='zig-zag': must be one of zigzag, contiguous"):
        CPContext(None, "ring", "zig-zag")


def test_apply_context_parallel_swaps_each_core_once():
    """Every AttentionCore is swapped, tagged by its name; a second application finds nothing
    to swap (it leaves the swapped cores, and their context, alone)."""
    from torch import nn

    from tessera.parallel.context_parallel import apply_context_parallel

    model = nn.ModuleDict({"a": nn.ModuleDict({"core": AttentionCore()}), "b": AttentionCore()})
    ctx = CPContext(None)
    assert apply_context_parallel(model, ctx) == 2
    swapped = [model["a"]["core"], model["b"]]
    assert [c.tag for c in swapped] == ["a.core", "b"] and all(c.ctx is ctx for c in swapped)
    assert apply_context_parallel(model, CPContext(None, "ulysses")) == 0
    assert [model["a"]["core"], model["b"]] == swapped


def test_blocks_the_fused_kernel_cannot_express():
    """Blocks the layouts never make (runs not aligned to a chunk), through the public block
    functions: `skipped` only when every key is after every query; `block_forward` of a
    same-length block with other positions (q 2..5 against k 3..6, so not the kernel's
    top-left causal) equals the explicit masked product (TOL); `merge_` of a row that has seen
    no key with a block that gives it none stays (0, −inf), not NaN."""
    from tessera.parallel.ring_attention import block_forward, merge_, skipped

    assert not skipped(torch.arange(0, 4), torch.arange(2, 8))
    assert not skipped(torch.arange(0, 4), torch.arange(3, 5))
    assert skipped(torch.arange(0, 4), torch.arange(4, 6))
    q, k, v, _ = _inputs(8, 2)
    q_pos, k_pos = torch.arange(2, 6), torch.arange(3, 7)
    q, k, v = q[:, :, :4], k[:, :, :4], v[:, :, :4]
    out, lse = block_forward(q, k, v, q_pos, k_pos, HD ** -0.5)
    # the independent reference: query 2 sees no key (its output 0, lse -inf), the others SDPA
    # with the positions' boolean mask
    allowed = k_pos[None, :] <= q_pos[:, None]
    s = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * HD ** -0.5
    want_lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, 1:], k, v, attn_mask=allowed[1:], enable_gqa=True)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert lse[:, :, 0].isneginf().all() and lse[:, :, 1:].isfinite().all()
    for got, ref in ((out[:, :, 1:], want), (lse[:, :, 1:], want_lse[:, :, 1:])):
        assert (got - ref).abs().max() <= TOL * ref.abs().max()
    out, lse = torch.zeros(1, 1, 2, HD), torch.full((1, 1, 2), float("-inf"))  # no key yet
    merge_(out, lse, torch.zeros(1, 1, 2, HD), torch.full((1, 1, 2), float("-inf")))
    assert torch.equal(out, torch.zeros_like(out)) and lse.isneginf().all()


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_activations_fall_as_one_over_cp(cp):
    """Bytes autograd keeps for backward per rank vs the reference core on the whole sequence
    (q, k, v, output, lse): ring and all-gather keep the local q, k, v, output and lse (K/V are
    passed or gathered again in backward), Ulysses the head-sharded full-sequence q, k, v,
    the same size; plus O(T) positions and permutation indices. With kv heads ≥ cp (no
    replication: kv heads fewer than cp are copied to every Ulysses rank, so its K/V would
    not shrink) each method keeps ≤ 1.1·reference/cp."""
    T = 64
    methods = ["ring", "allgather", "ulysses", "hybrid"]
    per_rank = run_ranks(_cp_rank, cp, args=([(m, "zigzag", T, HEADS) for m in methods],))
    q, k, v, _ = _inputs(T, HEADS)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref, _ = saved_bytes(lambda: AttentionCore()(q, k, v))
    for i, method in enumerate(methods):
        ratios = [r[i]["saved"] / ref for r in per_rank]
        print(f"cp={cp} {method}: saved bytes per rank / single-device = {max(ratios):.3f} "
              f"(1/cp = {1 / cp:.3f})")
        assert max(ratios) <= 1.1 / cp, (method, ratios)


def _executor_bytes(method: str) -> dict:
    from tessera.config_io import make_config
    from tessera.step import build_executor
    from tessera.topology import Topology

    cfg = make_config(None, model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                       max_seq_len=16),
                      data=dict(seq_len=16), parallel=dict(tp=2, cp=2, cp_method=method),
                      train=dict(grad_accum=2, micro_batch_size=2))
    topo = Topology.build(cfg.parallel)
    stats = CommStats()
    executor = build_executor(cfg, topo, torch.device("cpu"), cp_stats=stats)
    from tessera.data.loader import cp_shard

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 2, 17), generator=g)
    batches = [cp_shard((t[:, :-1], t[:, 1:]), topo.coords()["cp"], 2) for t in tokens]
    executor.forward_backward(batches)
    return {"by_tag": stats.by_tag(), "rank": topo.rank}


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_bytes_per_layer_in_a_training_step(method):
    """Through parallelize + Executor at (dp, tp, pp, cp) = (1, 2, 1, 2): each layer's
    attention sends, per rank, m × (forward + backward) of the formula with the heads per tp
    rank (4/2 query, 2/2 kv) and the local tokens (16/2)."""
    per_rank = run_ranks(_executor_bytes, 4, args=(method,))
    want = bytes_per_layer(method, 2, 2, 2, 1, 8, 8)
    for r in per_rank:
        assert sorted(r["by_tag"]) == ["layers.0.attention.core", "layers.1.attention.core"]
        for got in r["by_tag"].values():
            assert got == pytest.approx(2 * (want["forward"] + want["backward"]))


def _model_activation_bytes(cp: int, method: str) -> int:
    from tessera.config_io import make_config
    from tessera.data.loader import cp_shard
    from tessera.step import build_executor
    from tessera.topology import Topology

    cfg = make_config(None, model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                                       max_seq_len=64),
                      data=dict(seq_len=64), parallel=dict(cp=cp, cp_method=method),
                      train=dict(grad_accum=1, micro_batch_size=2))
    topo = Topology.build(cfg.parallel)
    executor = build_executor(cfg, topo, torch.device("cpu"), measure_memory=True)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    batch = cp_shard((tokens[:, :-1], tokens[:, 1:]), topo.coords()["cp"], cp)
    executor.forward_backward([batch])
    return executor.last_record.peak_activation_bytes


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_model_activations_per_rank_fall_as_one_over_cp(method):
    """The whole model's saved activations per rank (the runtime's peak, T = 64, 2 layers):
    every tensor of a block and the head is per token, so cp ranks each keep ~1/cp of the
    single-process bytes (+ O(T) positions); bound 1.1/cp."""
    single = run_ranks(_model_activation_bytes, 1, args=(1, method))[0]
    for cp in (2, 4):
        per_rank = run_ranks(_model_activation_bytes, cp, args=(cp, method))
        ratio = max(per_rank) / single
        print(f"{method} cp={cp}: activation bytes per rank / single = {ratio:.3f}")
        assert ratio <= 1.1 / cp, (cp, per_rank, single)


def test_explicit_block_path_matches_the_reference():
    """The masked-matmul block path (used off CPU, and for blocks the fused kernel cannot
    express) against SDPA with the same boolean mask: a zig-zag query set [0..3, 12..15]
    against all 16 keys, GQA 4:2. Output, lse and q/k/v gradients within TOL."""
    T, n_kv = 16, 2
    q, k, v, dout = _inputs(T, n_kv)
    q_pos = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])
    k_pos = torch.arange(T)
    qs = q[:, :, q_pos].clone().requires_grad_()
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    allowed = k_pos[None, :] <= q_pos[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=allowed,
                                                            enable_gqa=True)
    (want * dout[:, :, q_pos]).sum().backward()
    scale = HD ** -0.5
    out, lse = explicit_block_forward(qs.detach(), k.detach(), v.detach(), q_pos, k_pos, scale)
    s = torch.matmul(qs.detach(), k.detach().repeat_interleave(2, 1).transpose(-1, -2)) * scale
    want_lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
    do = dout[:, :, q_pos]
    grads = explicit_block_backward(qs.detach(), k.detach(), v.detach(), do,
                                    (do * out).sum(-1), lse, q_pos, k_pos, scale)
    for got, ref in ((out, want), (lse, want_lse), *zip(grads, (qs.grad, k.grad, v.grad),
                                                        strict=True)):
        assert (got - ref).abs().max() <= TOL * ref.abs().max()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_ring_blocks_in_one_process(device):
    """What every ring rank computes, without the communication: rank r's zig-zag queries
    against every rank's keys, block by block, merged by log-sum-exp; then the blocks'
    gradients. On CPU this is the fused kernel path, on CUDA the explicit masked path; both
    must give the reference core's output and gradients (TOL; cp = 4, GQA 4:2)."""
    from tessera.parallel.ring_attention import attend_blocks_, attend_blocks_backward_

    cp, T, n_kv = 4, 64, 2
    q, k, v, dout = (t.to(device) for t in _inputs(T, n_kv))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want = AttentionCore()(*ref_in)
    (want * dout).sum().backward()
    chunk, scale = T // (2 * cp), HD ** -0.5
    pos = [sequence_positions(T, cp, r).to(device) for r in range(cp)]
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp):
        qr, do = q[:, :, pos[r]], dout[:, :, pos[r]]
        out = torch.zeros_like(qr)
        lse = torch.full(qr.shape[:-1], float("-inf"), device=device)
        for s in range(cp):
            attend_blocks_(qr, k[:, :, pos[s]], v[:, :, pos[s]], pos[r], pos[s], chunk, scale,
                           out, lse)
        outs.append(out)
        dq = torch.zeros_like(qr)
        for s in range(cp):
            dk_s, dv_s = torch.zeros_like(k[:, :, pos[s]]), torch.zeros_like(v[:, :, pos[s]])
            attend_blocks_backward_(qr, k[:, :, pos[s]], v[:, :, pos[s]], out, do,
                                    (do * out).sum(-1), lse, pos[r], pos[s], chunk, scale,
                                    dq, dk_s, dv_s)
            dk[:, :, pos[s]] += dk_s
            dv[:, :, pos[s]] += dv_s
        dqs.append(dq)
    got = {"y": unshard_sequence(outs, 2), "dq": unshard_sequence(dqs, 2), "dk": dk, "dv": dv}
    ref = {"y": want, "dq": ref_in[0].grad, "dk": ref_in[1].grad, "dv": ref_in[2].grad}
    for name in ref:
        err = (got[name] - ref[name]).abs().max().item()
        assert err <= TOL * ref[name].abs().max().item(), (device, name, err)
