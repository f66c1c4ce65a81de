"""Zero-bubble pipelines at run time: the backward split into I and W (``pipeline.split_backward``)
and the schedules that use it, against the single-device model.

In one process: a chunk's I then W gives exactly one plain backward's input gradient and weight
gradients (bitwise: the same kernels on the same numbers, each gradient one term per
micro-batch), I accumulates no weight gradient and fires no gradient hook, W fires each once,
and what I keeps for W is less than what the forward saved; with every recompute mode; and the
first chunk (token ids, no input gradient) does its whole backward in W.

On gloo ranks (tests/test_pipeline_runtime.py's harness and tolerances, tests/
test_composition.py's for composed layouts): hand-written split schedules, then each
registered zero-bubble schedule at pp 2 and 4 with m = p and 2p; composed with dp 2 (DDP,
ZeRO-1), tp 2 and full recompute; the peak of (chunk, micro-batch) sets in flight counted by the
runtime; checkpoint resume.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config_io import make_config
from tessera.model import build_model, cross_entropy
from tessera.parallel.recompute import apply_recompute
from tessera.pipeline.split_backward import SavedActivations, backward_input, backward_weight

SEQ, VOCAB = 16, 64


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
