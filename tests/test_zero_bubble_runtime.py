"""Zero-bubble pipelines at run time: the backward split into I and W (``pipeline.split_backward``)
and the schedules that use it, against the single-device model.

In one process: a chunk's I then W gives exactly one plain backward's input gradient and weight
gradients (bitwise: the same kernels on the same numbers, each gradient one term per
micro-batch), I accumulates no weight gradient and fires no gradient hook, W fires each once,
and what I keeps for W is less than what the forward saved; with every recompute mode; and the
first chunk (token ids, no input gradient) does its whole backward in W. W runs the groups
whose entries cannot reach each other in one autograd call (q, k, v; the MLP's two inputs).
What a weight's branch saved stays for W; a node that splits its own backward leaves W only
the tensor it made for it, which the runtime's memory count holds until W.

On gloo ranks (tests/test_pipeline_runtime.py's harness and tolerances, tests/
test_composition.py's for composed layouts): hand-written split schedules, then each
registered zero-bubble schedule at pp 2 and 4 with m = p and 2p; composed with dp 2 (DDP,
ZeRO-1), tp 2 and full recompute; the peak of (chunk, micro-batch) sets in flight counted by the
runtime; checkpoint resume.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import ParallelConfig
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.layout import check_split_backward, validate
from tessera.model import build_model, cross_entropy
from tessera.parallel.chunked_loss import chunked_head_cross_entropy
from tessera.parallel.comm import CommStats
from tessera.parallel.recompute import apply_recompute
from tessera.parallel.tensor_parallel import TPContext
from tessera.parallel.tp_plan import build_tensor_parallel_model
from tessera.parallel.vocab_parallel_loss import vocab_parallel_cross_entropy
from tessera.pipeline.schedule import W, parse
from tessera.pipeline.simulator import peak_inflight
from tessera.pipeline.split_backward import SavedActivations, backward_input, backward_weight
from tessera.step import build_executor, last_backwards
from tessera.testing import assert_close_summed, run_ranks
from tessera.topology import Topology
from test_checkpoint import _check_resumed, _resume_rank
from test_composition import MATRIX, _cfg, _check, _reference, _run_layout
from test_pipeline_runtime import (
    case_config,
    check_results,
    references_for,
    run_parity_cases,
    step_batches,
)

SEQ, VOCAB = 16, 64
STEPS = 3
"""Steps per multi-process case: the first step's gradients are the parity check; two more
check that the optimizer steps on what the split backward accumulated."""


def _tiny(recompute: str = "none"):
    cfg = make_config("tiny", model=dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2,
                                         n_kv_heads=1, max_seq_len=32))
    model = build_model(cfg.model, 0)
    apply_recompute(model, recompute)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return model, tokens[:, :-1], tokens[:, 1:]


def _body(model, x, y):
    """The model after its embedding, as a last pipeline chunk: blocks, head, loss."""
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    for layer in model.layers:
        x = layer(x, cos, sin)
    return cross_entropy(model.output(model.norm(x)), y)


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_input_then_weight_gradients_equal_one_backward(recompute):
    model, tokens, y = _tiny(recompute)
    x0 = model.tok_embeddings(tokens).detach()
    x = x0.clone().requires_grad_()
    _body(model, x, y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want_dx = x.grad.clone()
    model.zero_grad(set_to_none=True)

    fired: list[str] = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.append(n))
    forwards = []
    for layer in model.layers:  # a module inside the block: a replay calls it again
        layer.attention_norm.register_forward_hook(lambda *_: forwards.append(1))
    x = x0.clone().requires_grad_()
    saved = SavedActivations()
    with saved:
        loss = _body(model, x, y)
    packed = _storage_bytes([h.tensor for h in saved.holders])
    dx, pending = backward_input(loss, None, x, saved)
    assert torch.equal(dx, want_dx)
    assert x.grad is None
    assert fired == []  # I: no weight gradient accumulated, no hook (no reduction) fired
    assert all(p.grad is None for p in model.parameters())
    del loss
    # W needs the linears' inputs and the norms' normalized inputs, not what only the input
    # path reads (attention's and the activation function's saved tensors, the loss's).
    assert 0 < _storage_bytes(pending.kept) < packed
    backward_weight(pending)
    assert sorted(fired) == sorted(want)  # each parameter's hook once, at W
    for n, p in model.named_parameters():
        if n in want:
            assert torch.equal(p.grad, want[n]), n
    # The forward, then each recomputation: full recompute replays each block in I and again
    # in W (split_backward's doc); selective replays only the attention core (no weights).
    assert len(forwards) == (3 if recompute == "full" else 1) * len(model.layers)


def test_w_frees_what_i_kept():
    """After W nothing of the (chunk, micro-batch)'s saved tensors stays alive: a holder names
    the nodes that read it, a cycle through the graph that the collector cannot see, so W must
    break it."""
    model, tokens, y = _tiny()
    x = model.tok_embeddings(tokens).detach().requires_grad_()
    saved = SavedActivations()
    with saved:
        loss = _body(model, x, y)
    state = {t.untyped_storage().data_ptr() for t in [x, *model.parameters(), *model.buffers()]}
    alive = [weakref.ref(h.tensor) for h in saved.holders
             if h.tensor.untyped_storage().data_ptr() not in state]
    _, pending = backward_input(loss, None, x, saved)
    del loss, saved
    assert any(r() is not None for r in alive)  # what W reads
    backward_weight(pending)
    del pending
    gc.collect()
    assert all(r() is None for r in alive)


def test_first_chunk_does_its_whole_backward_in_w():
    model, tokens, y = _tiny()
    cross_entropy(model(tokens), y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    saved = SavedActivations()
    with saved:
        loss = cross_entropy(model(tokens), y)
    dx, pending = backward_input(loss, None, None, saved)
    assert dx is None and all(p.grad is None for p in model.parameters())
    backward_weight(pending)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n


def test_parameters_sharing_an_entry_form_one_group():
    """Two weights whose branches meet before the input path (x·(A + B)ᵀ, as sequence
    parallelism's gather-then-linears node takes several weights) and a weight used twice on
    the input path (entries one above the other: W must not count the lower one twice)."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(8, 8, generator=g, requires_grad=True) for _ in range(3))
    x0 = torch.randn(4, 8, generator=g)

    def f(x):
        h = x @ (a + b).t()
        return ((h @ c.t()).tanh() @ c.t()).square().sum()

    x = x0.clone().requires_grad_()
    f(x).backward()
    want = [t.grad.clone() for t in (a, b, c)]
    want_dx = x.grad.clone()
    for t in (a, b, c):
        t.grad = None
    x = x0.clone().requires_grad_()
    saved = SavedActivations()
    with saved:
        out = f(x)
    dx, pending = backward_input(out, None, x, saved)
    assert [len(group.params) for group in pending.groups] == [1, 2]  # {c}, {a, b}
    assert len(pending.groups[0].entries) == 2  # c's two uses
    backward_weight(pending)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    for t, w in zip((a, b, c), want, strict=True):  # c's two parts may add in another order
        assert_close_summed(t.grad, w, terms=2, msg="weight gradient")


def test_w_keeps_what_a_weight_branch_saved():
    """A weight reached through a branch whose nodes save tensors (a low-rank update
    x·(W + A·B)ᵀ: the product A·B saves A and B). I never runs the branch, so nothing reads
    those tensors in I; they stay for W, which runs it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    a = torch.randn(8, 2, generator=g, requires_grad=True)
    b = torch.randn(2, 8, generator=g, requires_grad=True)
    x0 = torch.randn(4, 8, generator=g)

    def f(x):
        return (x @ (w + a @ b).t()).tanh().sum()

    x = x0.clone().requires_grad_()
    f(x).backward()
    want = [x.grad.clone(), *(t.grad.clone() for t in (w, a, b))]
    w.grad = a.grad = b.grad = None
    x = x0.clone().requires_grad_()
    saved = SavedActivations()
    with saved:
        out = f(x)
    dx, pending = backward_input(out, None, x, saved)
    assert all(t.grad is None for t in (w, a, b))
    backward_weight(pending)
    for got, expected in zip((dx, w.grad, a.grad, b.grad), want, strict=True):
        assert torch.equal(got, expected)


def test_a_splitting_node_leaves_w_only_what_it_made():
    """A node that splits its own backward (sequence parallelism's gather-then-linears; over no
    group its all-gather is the identity) hands W its gathered input in ``split_kept``; the
    tensors it saved (its input and weights) are emptied after I like the input path's, so
    what I keeps for W is that one made tensor, (B·T, h)."""
    from tessera.parallel.sequence_parallel import GatherThenLinears

    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(6, 8, generator=g, requires_grad=True)
    w2 = torch.randn(4, 8, generator=g, requires_grad=True)
    x0 = torch.randn(2, 3, 8, generator=g)

    def f(x):
        q, k = GatherThenLinears.apply(x * 2, None, None, "sp", w1, w2)
        return q.square().sum() + k.tanh().sum()

    x = x0.clone().requires_grad_()
    f(x).backward()
    want = [x.grad.clone(), w1.grad.clone(), w2.grad.clone()]
    w1.grad = w2.grad = None
    x = x0.clone().requires_grad_()
    saved = SavedActivations()
    with saved:
        out = f(x)
    dx, pending = backward_input(out, None, x, saved)
    assert pending.kept == []
    assert [tuple(t.shape) for t in pending.made] == [(2 * 3, 8)]
    backward_weight(pending)
    for got, expected in zip((dx, w1.grad, w2.grad), want, strict=True):
        assert torch.equal(got, expected)


def test_the_runtime_counts_what_a_splitting_node_made_as_held_until_w():
    """With measure_memory, a set past its I holds what W still reads plus what splitting
    nodes made for W. One rank runs two chunks (an embedding, then a gather-then-linears node
    over no group and a sum): chunk 1 saves its input x (B, T, h), and after I holds none of
    its saved tensors but its gathered input, x's storage. At mb 1's chunk-1 forward two x
    are held: mb 0's made one and mb 1's saved one (the embedding saves only token ids, and
    the weights are excluded)."""
    from tessera.parallel.sequence_parallel import GatherThenLinears
    from tessera.pipeline.runtime import PipelineRuntime

    class Linears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            return GatherThenLinears.apply(x, None, None, "sp", self.weight)[0]

    torch.manual_seed(0)
    stages = {0: torch.nn.Embedding(VOCAB, 8), 1: Linears()}
    schedule = parse("rank 0: 0F0 1F0 1I0 0F1 1F1 1I1 0I0 0I1 1W0 1W1 0W0 0W1")
    tokens = torch.randint(0, VOCAB, (2, 2, SEQ))
    batches = [(tokens[mb], tokens[mb]) for mb in range(2)]
    rt = PipelineRuntime(stages, 0, [0], None, torch.device("cpu"), 8, measure_memory=True)
    record = rt.run(schedule, batches, lambda out, _y: out.sum())
    assert record.peak_activation_bytes == 2 * (2 * SEQ * 8 * 4)  # two (B, T, h) fp32


def test_w_runs_groups_that_cannot_reach_each_other_in_one_call():
    """Per block, in a plain backward's order: q, k and v (one normed input) in one autograd
    call, the MLP's two input projections in one; each norm gain, wo and w2 alone (each lies
    above or below the others on the input path). The gradients stay bitwise a plain
    backward's (test_input_then_weight_gradients_equal_one_backward)."""
    model, tokens, y = _tiny()
    x = model.tok_embeddings(tokens).detach().requires_grad_()
    saved = SavedActivations()
    with saved:
        loss = _body(model, x, y)
    _, pending = backward_input(loss, None, x, saved)
    names = {p: n for n, p in model.named_parameters()}
    got = [sorted(names[p].removesuffix(".weight") for g in batch for p in g.params)
           for batch in pending.batches]

    def block(i: int) -> list[list[str]]:
        ffn, att = f"layers.{i}.feed_forward", f"layers.{i}.attention"
        return [[f"{ffn}.w2"], [f"{ffn}.w1", f"{ffn}.w3"], [f"layers.{i}.ffn_norm"],
                [f"{att}.wo"], [f"{att}.wk", f"{att}.wq", f"{att}.wv"],
                [f"layers.{i}.attention_norm"]]

    assert got == [["output"], ["norm"], *block(1), *block(0)]
    backward_weight(pending)


def test_w_runs_each_group_alone_when_node_order_is_unknown():
    """Batching relies on each input-path node being created after its inputs' nodes; where a
    sequence number says otherwise W makes no assumption and runs each group alone."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(8, 8, generator=g, requires_grad=True) for _ in range(2))
    x0 = torch.randn(4, 8, generator=g)

    def f(x):
        return ((x @ a.t()) * (x @ b.t())).sum()  # a and b: one input, neither below

    x = x0.clone().requires_grad_()
    f(x).backward()
    want = [a.grad.clone(), b.grad.clone()]
    a.grad = b.grad = None
    x = x0.clone().requires_grad_()
    out = f(x)
    _, pending = backward_input(out, None, x)
    assert [len(batch) for batch in pending.batches] == [2]
    backward_weight(pending)
    assert torch.equal(a.grad, want[0]) and torch.equal(b.grad, want[1])
    a.grad = b.grad = None
    out = f(x)
    product = out.grad_fn.next_functions[0][0]  # SumBackward -> MulBackward
    product._set_sequence_nr(out.grad_fn._sequence_nr() + 1)  # "made after its consumer"
    _, pending = backward_input(out, None, x)
    assert [len(batch) for batch in pending.batches] == [1, 1]
    backward_weight(pending)
    assert torch.equal(a.grad, want[0]) and torch.equal(b.grad, want[1])


def test_two_micro_batches_accumulate_like_two_backwards():
    """I of both micro-batches before either W (as ZB schedules order them): each W adds its
    own micro-batch's part, once."""
    model, tokens, y = _tiny()
    xs = [model.tok_embeddings(tokens).detach(), model.tok_embeddings(tokens.flip(1)).detach()]
    for x in xs:
        _body(model, x.clone().requires_grad_(), y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    pendings = []
    for x in xs:
        saved = SavedActivations()
        x = x.clone().requires_grad_()
        with saved:
            loss = _body(model, x, y)
        pendings.append(backward_input(loss, None, x, saved)[1])
    for pending in pendings:
        backward_weight(pending)
    for n, p in model.named_parameters():
        if n in want:
            assert torch.equal(p.grad, want[n]), n


class MatmulFlops(TorchDispatchMode):
    """FLOPs of the matrix products dispatched (2·m·n·k each; in-place ``addmm_`` included)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm", "addmm_", "bmm", "baddbmm"):
            self.flops += 2 * out.numel() * args[-1].shape[-2]  # (.., m, n) and k
        return out


def test_chunked_loss_splits_its_own_backward():
    """The chunked head is one node, input path and the head weight's entry: I computes each
    chunk's logits again and dh, W the logits and dW (not the whole node twice); with the input
    projection's two products, I + W is a plain backward's matrix products plus one pass of
    the logits (2·N·V·H FLOPs), and the gradients are a plain backward's, bitwise."""
    g = torch.Generator().manual_seed(0)
    n, hidden, chunk = 2 * SEQ, 16, 8
    a = torch.randn(hidden, hidden, generator=g, requires_grad=True)
    head = torch.randn(VOCAB, hidden, generator=g, requires_grad=True)
    x0 = torch.randn(2, SEQ, hidden, generator=g)
    y = torch.randint(0, VOCAB, (2, SEQ), generator=g)

    def f(x):
        return chunked_head_cross_entropy(x @ a.t(), head, y, VOCAB, chunk)

    x = x0.clone().requires_grad_()
    loss = f(x)
    with MatmulFlops() as plain:
        loss.backward()
    want = [x.grad.clone(), a.grad.clone(), head.grad.clone()]
    a.grad = head.grad = None
    x = x0.clone().requires_grad_()
    saved = SavedActivations()
    with saved:
        loss = f(x)
    with MatmulFlops() as flops_i:
        dx, pending = backward_input(loss, None, x, saved)
    with MatmulFlops() as flops_w:
        backward_weight(pending)
    logits, projection = 2 * n * VOCAB * hidden, 2 * n * hidden * hidden
    assert plain.flops == 3 * logits + 2 * projection
    assert flops_i.flops == 2 * logits + projection  # logits, dh; dx
    assert flops_w.flops == 2 * logits + projection  # logits, dW; da
    for got, w in zip((dx, a.grad, head.grad), want, strict=True):
        assert torch.equal(got, w)


def test_a_chunks_reduction_starts_at_its_last_w():
    """The executor's hook point for data parallelism: the chunk's last W (never its I)."""
    schedule = parse(SPLIT_1F1B)
    assert last_backwards(schedule, 0) == {W(0, 1)}
    assert last_backwards(schedule, 1) == {W(1, 1)}


# ---------------------------------------------------------------------------------------------
# On gloo ranks


ZB = ("zb-h1", "zb-v", "dualpipev")
SPLIT_1F1B = ("rank 0: 0F0 0F1 0I0 0I1 0W0 0W1\n"  # 1F1B at p = m = 2, every W deferred
              "rank 1: 1F0 1I0 1F1 1I1 1W0 1W1")


def _v(name: str) -> int:
    return 2 if name in ("zb-v", "dualpipev") else 1


def pipeline_cases(pp: int) -> list[dict]:
    """Each zero-bubble schedule at m = p and 2p (tied embeddings at m = p, so the V shapes'
    first and last chunks share one weight on rank 0), and with full recompute at m = 2p."""
    layers = 4 if pp == 2 else 8
    cases = [dict(schedule=s, pp=pp, m=m, v=_v(s), layers=layers, tie=m == pp)
             for s in ZB for m in (pp, 2 * pp)]
    cases += [dict(schedule=s, pp=pp, m=2 * pp, v=_v(s), layers=layers,
                   extra=dict(recompute="full")) for s in ZB]
    return cases


def in_flight_records(pp: int, m: int) -> dict[str, tuple[int, int, float]]:
    """Per schedule: this rank's runtime count of (chunk, micro-batch) sets in flight at peak,
    its peak saved bytes, and the simulator's count for the rank."""
    out = {}
    for name in ("1f1b", *ZB):
        cfg = case_config(name, pp, m, v=_v(name))
        engine = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"),
                                measure_memory=True)
        engine.cfg.train.steps = 0
        engine.forward_backward(step_batches(0, m))
        record, rank = engine.last_record, engine.pp_rank
        out[name] = (record.peak_in_flight, record.peak_activation_bytes,
                     peak_inflight(engine.model.schedule)[rank])
    return out


def _pp2_rank(cases, references):
    return run_parity_cases(cases, references, STEPS), in_flight_records(2, 8)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero_bubble_schedules_match_reference_pp2_and_hold_1f1b_memory():
    cases = pipeline_cases(2)
    results = run_ranks(_pp2_rank, 2, args=(cases, references_for(cases)), timeout=600)
    for per_rank, _ in results:
        assert [c for c, *_ in per_rank] == cases
        check_results(per_rank)
    inflight = [records for _, records in results]
    for rank, records in enumerate(inflight):
        for name, (count, _, simulated) in records.items():
            assert count == simulated, (rank, name)  # the runtime and the simulator agree
    peak = {name: [records[name][0] for records in inflight] for name in inflight[0]}
    # Sets held at once, m = 8 >= 2p: 1F1B's most is rank 0's p; ZB-H1 holds no more on any
    # rank (its later ranks keep sets until their deferred W); the V shapes' sets are half a
    # stage each (two chunks per rank), ZB-V holding at most 2p of them (1F1B's memory) and
    # DualPipeV 2p + 1 on its first rank (DeepSeek's "PP + 1" for PP = 2p chunks).
    p = 2
    assert max(peak["1f1b"]) == peak["1f1b"][0] == p
    assert max(peak["zb-h1"]) == p
    assert max(peak["zb-v"]) == 2 * p
    assert peak["dualpipev"][0] == max(peak["dualpipev"]) == 2 * p + 1
    # Bytes: between I and W a set holds only what W reads. ZB-H1's last rank holds two sets
    # at its peak where 1F1B's holds one: one whole, and one past its I.
    last = inflight[-1]
    assert last["1f1b"][1] < last["zb-h1"][1] < 2 * last["1f1b"][1]


def _pp4_rank(cases, references, layouts):
    MATRIX.update(composed())
    return (run_parity_cases(cases, references, STEPS),
            {n: _run_layout(MATRIX[n], STEPS) for n in layouts})


def composed() -> dict:
    """(dp, tp, pp=2) layouts of each zero-bubble schedule on tests/test_composition.py's
    bench and tolerances, and sequence parallelism and bf16 once each."""
    return {f"{s} {label}": _cfg(dp, tp, 2, m=4 // dp, schedule=s, virtual_stages=_v(s),
                                 **extra)
            for s in ZB for label, dp, tp, extra in (("dp2 ddp", 2, 1, {}),
                                                     ("dp2 zero1", 2, 1, dict(zero_stage=1)),
                                                     ("tp2", 1, 2, {}))} | {
        # a gather-then-linears node is the entry of several weights; bf16 (ZeRO's buffers)
        "zb-v tp2 sp": _cfg(1, 2, 2, m=4, schedule="zb-v", virtual_stages=2,
                            sequence_parallel=True),
        "dualpipev dp2 bf16": _cfg(2, 1, 2, m=2, schedule="dualpipev", virtual_stages=2,
                                   precision="bf16")}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero_bubble_schedules_match_reference_pp4_and_composed():
    layouts = composed()
    MATRIX.update(layouts)  # _check reads a layout's config there
    ref = _reference()
    cases = pipeline_cases(4)
    results = run_ranks(_pp4_rank, 4, args=(cases, references_for(cases), list(layouts)),
                        timeout=900)
    for rank, (per_rank, layouts) in enumerate(results):
        assert [c for c, *_ in per_rank] == cases
        check_results(per_rank)
        for name, got in layouts.items():
            _check(name, rank, got, ref)


def _sp_split_rank() -> dict[str, dict]:
    """A last chunk (two blocks, final norm, head, loss) at tp 2 with sequence parallelism:
    per case (loss, recomputation), the collectives (tag, op, phase, elements) and matmul FLOPs
    of a plain backward, of I and of W, and whether I and W's gradients are the plain
    backward's, bitwise."""
    cfg = make_config("tiny", model=dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2,
                                         n_kv_heads=2, max_seq_len=32)).model
    topo = Topology.build(ParallelConfig(tp=2, sequence_parallel=True))
    stats = CommStats()
    tp = TPContext(group=topo.group("tp"), sequence_parallel=True, stats=stats)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    y = tokens[:, 1:]

    def head(model, h):  # a gather-then-linears node
        return vocab_parallel_cross_entropy(model.output(h), y, VOCAB, tp)

    def chunked(model, h):  # SP's g, then the chunked head
        return chunked_head_cross_entropy(h, model.output.weight, y, VOCAB, 8, tp)

    @contextlib.contextmanager
    def logged(into: list):
        """Appends the collectives and matmul FLOPs of the block's body to `into`."""
        stats.reset()
        with MatmulFlops() as flops:
            yield
        into += [[(r.tag, r.op, r.phase, r.numel) for r in stats.records], flops.flops]

    out = {}
    for name, loss_fn, recompute in (("head", head, "none"), ("chunked", chunked, "none"),
                                     ("head, full recompute", head, "full")):
        model = build_tensor_parallel_model(cfg, seed=0, tp=tp)
        apply_recompute(model, recompute)
        x0 = model.tok_embeddings(tokens[:, :-1]).detach()  # (B, T/t, h): this rank's tokens
        cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]

        def body(x, model=model, loss_fn=loss_fn, cos=cos, sin=sin):
            for layer in model.layers:
                x = layer(x, cos, sin)
            return loss_fn(model, model.norm(x))

        plain, split_i, split_w = [], [], []
        x = x0.clone().requires_grad_()
        loss = body(x)
        with logged(plain):
            loss.backward()
        want = [x.grad, *(p.grad for p in model.parameters())]
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        saved = SavedActivations()
        with saved:
            loss = body(x)
        with logged(split_i):
            dx, pending = backward_input(loss, None, x, saved)
        made = [tuple(t.shape) for t in pending.made]
        with logged(split_w):
            backward_weight(pending)
        got = [dx, *(p.grad for p in model.parameters())]
        out[name] = dict(plain=plain, i=split_i, w=split_w, made=made,
                         equal=all(a is b is None or torch.equal(a, b)  # None: the embedding
                                   for a, b in zip(got, want, strict=True)))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_w_issues_no_collective_under_sequence_parallelism():
    """Sequence parallelism's gather-then-linears node splits its backward (split_backward's
    splitting nodes): I issues exactly a plain backward's collectives (each node's regather and
    reduce-scatter, the head's), W none and only weight-gradient products: I + W is a plain
    backward's FLOPs (the chunked head: plus one pass of its logits, 2·N·V/t·H). I keeps each
    gather-then-linears node's gathered input, (B·T, h), for W. Under full recomputation W
    replays the blocks' forwards (split_backward's doc), with their forward collectives, and
    issues no backward collective."""
    n_nodes = 2 * 2  # per block: q/k/v, the MLP's input projections
    for rank in run_ranks(_sp_split_rank, 2, timeout=300):
        for name, got in rank.items():
            (plain, plain_flops), (i, i_flops), (w, w_flops) = got["plain"], got["i"], got["w"]
            assert any(tag.endswith(":regather") for tag, *_ in plain), name
            assert i == plain, name
            assert got["made"] == [(2 * SEQ, 32)] * (n_nodes + name.startswith("head")), name
            assert got["equal"], name
            if name.endswith("full recompute"):
                assert w and {phase for _, _, phase, _ in w} == {"forward"}, name
                continue
            assert w == [], name
            logits = 2 * (2 * SEQ) * (VOCAB // 2) * 32 if name == "chunked" else 0
            assert i_flops + w_flops == plain_flops + logits, name


def _resume_ranks(data: str, root: str) -> dict:
    return {s: _resume_rank(data, f"{root}/{s}", {"pp": 2, "schedule": s,
                                                  "virtual_stages": _v(s), "model.n_layers": 4})
            for s in ZB}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resumed_zero_bubble_runs_continue_exactly(tiny_data, tmp_path):
    """tests/test_checkpoint.py's check (tolerance 0) for each schedule: 6 steps saving at 3,
    and a run resumed from step 3, log the same steps 4-6 and end with the same model."""
    got = run_ranks(_resume_ranks, 2, args=(tiny_data, str(tmp_path)), timeout=600)[0]
    for name, result in got.items():
        _check_resumed(result, name)


def test_zero3_with_a_split_backward_is_refused_in_one_line():
    cfg = make_config("tiny", model=dict(n_layers=4),
                      parallel=dict(dp=2, pp=2, zero_stage=3, schedule="zb-h1"),
                      train=dict(grad_accum=2))
    with pytest.raises(ConfigError, match=r"^parallel.zero_stage=3: schedule zb-h1 splits each "
                                          r"backward into I and W"):
        validate(cfg, 4)
    validate(make_config("tiny", model=dict(n_layers=4),
                         parallel=dict(dp=2, pp=2, zero_stage=2, schedule="zb-h1"),
                         train=dict(grad_accum=2)), 4)
    with pytest.raises(ConfigError, match=r"^parallel.zero_stage=3: schedule custom splits"):
        check_split_backward(3, "custom", parse(SPLIT_1F1B).split_backward)
