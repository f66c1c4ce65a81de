"""The mixture-of-experts layer on one process (tessera.moe): routing, capacity, the dropless
and dropping forward against a naive per-token loop, the auxiliary losses' gradients, the
router bias, micro-batch invariance, and the counting of parameters and FLOPs.

Tolerances: the layer and the naive loop compute each token's expert MLP with the same
matmuls on differently sized row blocks and add a token's k weighted outputs in another order,
so outputs agree to the summation bound over the h (or f) terms of one dot product; gradients
of expert weights add the same per-token terms in another order: the bound over the tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.model import (
    active_param_count,
    build_model,
    cross_entropy,
    flops_per_token,
    init_weights,
    param_count,
)
from tessera.moe import (
    MoEFeedForward,
    collect_stats,
    set_loss_scale,
    summarize_load,
    update_router_bias,
)
from tessera.testing import assert_close_summed

H, F_E, E = 16, 24, 4


def _cfg(**kw) -> ModelConfig:
    base = dict(d_model=H, n_layers=2, n_heads=2, max_seq_len=32, moe_experts=E, moe_top_k=2,
                moe_ffn_hidden=F_E, moe_aux_loss_coef=0.0)
    return ModelConfig(**{**base, **kw})


def _layer(seed: int = 0, **kw) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(_cfg(**kw))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _naive(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's top-k by probability, capacity by the documented priority
    (all first choices of a sequence in position order, then all second choices, ...)."""
    B, T, h = x.shape
    ex = layer.experts
    out = torch.zeros_like(x)
    cap = layer.capacity(T)
    for b in range(B):
        probs = F.linear(x[b].float(), layer.router.weight).softmax(-1)  # (T, E)
        top = (probs + layer.expert_bias if layer.bias_rate > 0 else probs).topk(
            layer.top_k, -1).indices
        gates = probs.gather(-1, top)
        if layer.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        used = [0] * layer.n_experts
        keep = torch.zeros_like(top, dtype=torch.bool)
        for j in range(layer.top_k):
            for t in range(T):
                e = int(top[t, j])
                if cap is None or used[e] < cap:
                    used[e] += 1
                    keep[t, j] = True
        for t in range(T):
            for j in range(layer.top_k):
                if keep[t, j]:
                    e, xt = int(top[t, j]), x[b, t]
                    y = (F.silu(xt @ ex.w1[e]) * (xt @ ex.w3[e])) @ ex.w2[e]
                    out[b, t] += gates[t, j] * y
    return out


@pytest.mark.parametrize("top_k,capacity", [(1, 0.0), (2, 0.0), (1, 1.0), (2, 0.5), (2, 1.25)])
def test_layer_matches_a_per_token_loop(top_k, capacity):
    layer = _layer(moe_top_k=top_k, moe_capacity_factor=capacity)
    x = torch.randn(3, 12, H)
    got, want = layer(x), _naive(layer, x)
    # one token's output: dot products over h then f terms, k of them added
    assert_close_summed(got, want, terms=H + F_E + top_k)
    if capacity:  # dropping is exercised
        assert layer.stats.dropped > 0


def test_capacity_keeps_first_choices_before_second_and_earlier_positions():
    layer = _layer(moe_top_k=2, moe_capacity_factor=0.5)  # ceil(0.5·8·2/4) = 2 per expert
    with torch.no_grad():  # every token prefers expert 0, then expert 1
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 2.0, 1.0
    x = torch.zeros(1, 8, H)
    x[..., 0] = 1.0
    r = layer.route(x)
    assert layer.capacity(8) == 2
    assert r["experts"][0, :, 0].tolist() == [0] * 8
    assert r["keep"][0, :, 0].tolist() == [True, True] + [False] * 6  # positions 0, 1 first
    assert r["keep"][0, :, 1].tolist() == [True, True] + [False] * 6


def test_dropping_depends_on_the_sequence_alone():
    """Routing groups are sequences: a batch split in two micro-batches drops the same
    assignments."""
    layer = _layer(moe_top_k=2, moe_capacity_factor=0.75)
    x = torch.randn(4, 10, H)
    whole = layer.route(x)["keep"]
    halves = torch.cat([layer.route(x[:2])["keep"], layer.route(x[2:])["keep"]])
    assert torch.equal(whole, halves) and not whole.all()


def test_auxiliary_losses_reach_the_router_with_the_loss_scale():
    """AttachAuxLoss's gradient = that of scale·(aux_coef·balance + z_coef·z) added to the
    loss, computed here explicitly from the same layer without attachment."""
    x = torch.randn(2, 10, H)
    R = torch.randn(2, 10, H)
    got_layer = _layer(moe_aux_loss_coef=0.3, moe_z_loss_coef=0.05)
    set_loss_scale(got_layer, 0.5)
    (0.5 * (got_layer(x) * R).sum()).backward()
    ref_layer = _layer()  # same seed: same weights, no attached losses
    y = ref_layer(x)
    balance, z = ref_layer.aux_losses(ref_layer.route(x))
    (0.5 * ((y * R).sum() + 0.3 * balance + 0.05 * z)).backward()
    for (name, p), q in zip(got_layer.named_parameters(), ref_layer.parameters(), strict=True):
        assert_close_summed(p.grad, q.grad, terms=20 * 2, msg=name)
    assert got_layer.router.weight.grad.abs().max() > 0


def test_balance_loss_is_one_at_uniform_routing_and_z_loss_matches_its_formula():
    layer = _layer(moe_top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()
    r = layer.route(torch.randn(2, 8, H))
    # uniform probabilities: P = 1/E for all, Σ f = 1, so E·Σ f·P = 1; logsumexp = log E
    balance, z = layer.aux_losses(r)
    assert balance.item() == pytest.approx(1.0)
    assert z.item() == pytest.approx(torch.log(torch.tensor(float(E))).item() ** 2)


def test_router_bias_moves_toward_balance_and_only_selects():
    layer = _layer(moe_top_k=1, moe_router_bias_rate=0.2)
    with torch.no_grad():  # everything prefers expert 0
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0
    x = torch.zeros(1, 6, H)
    x[..., 0] = 1.0
    layer.train()
    layer(x)
    assert layer.step_load.tolist() == [6, 0, 0, 0]
    update_router_bias([layer])
    assert layer.expert_bias.tolist() == pytest.approx([-0.2, 0.2, 0.2, 0.2])
    assert layer.step_load.sum() == 0
    r = layer.route(x)
    assert r["experts"][0, 0, 0] != 0  # the bias changed the choice ...
    probs = r["probs"][0, 0]
    assert r["gates"][0, 0, 0].item() == pytest.approx(probs[r["experts"][0, 0, 0]].item())


def test_micro_batches_give_the_whole_batch_gradient_including_aux_losses():
    cfg = make_config(None, model=dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                                       moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0,
                                       moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01,
                                       moe_shared_expert=True))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    whole = build_model(cfg.model)
    cross_entropy(whole(x), y).backward()
    split = build_model(cfg.model)
    set_loss_scale(split, 0.5)
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        (0.5 * cross_entropy(split(xs), ys)).backward()
    for (name, p), q in zip(whole.named_parameters(), split.parameters(), strict=True):
        assert_close_summed(q.grad, p.grad, terms=64, msg=name)


def test_every_kth_layer_and_parameter_counts():
    cfg = make_config(None, model=dict(d_model=32, n_layers=4, n_heads=4, moe_experts=8,
                                       moe_top_k=2, moe_every=2, moe_ffn_hidden=48,
                                       moe_shared_expert=True)).model
    model = build_model(cfg)
    kinds = [type(b.feed_forward).__name__ for b in model.layers]
    assert kinds == ["FeedForward", "MoEFeedForward"] * 2
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    # active: 6 of 8 experts fewer in each of the 2 MoE layers
    assert active_param_count(cfg) == param_count(cfg) - 2 * 6 * 3 * 32 * 48
    dense = make_config(None, model=dict(d_model=32, n_layers=4, n_heads=4)).model
    attn_flops = 12 * 4 * 4 * 8 * 16
    assert flops_per_token(dense, 16) - attn_flops == 6 * (param_count(dense) - 32 * 256
                                                             - 9 * 32)
    # matmul weights: active parameters minus the embedding and norms
    assert flops_per_token(cfg, 16) - attn_flops == 6 * (active_param_count(cfg) - 32 * 256
                                                           - 9 * 32)


def test_reference_initializer_gives_experts_their_stacked_names():
    cfg = _cfg()
    model = init_weights(build_model(cfg), seed=3)
    names = [n for n, _ in model.named_parameters() if "feed_forward" in n]
    assert "layers.0.feed_forward.experts.w1" in names
    assert "layers.0.feed_forward.router.weight" in names
    assert model.layers[0].feed_forward.experts.w1.shape == (E, H, F_E)


def test_stats_report_load_and_drops():
    layer = _layer(moe_top_k=2, moe_capacity_factor=0.5)
    layer(torch.randn(2, 8, H))
    stats = collect_stats([layer])
    summary = summarize_load(stats)
    assert sum(summary["moe_tokens_per_expert"]) == 2 * 8 * 2
    assert 0 < summary["moe_dropped_fraction"] < 1
    assert summary["moe_max_load_ratio"] >= 1
    assert layer.stats.calls == 0  # reset


@pytest.mark.parametrize("kw,field", [(dict(moe_top_k=5), "model.moe_top_k"),
                                      (dict(moe_capacity_factor=-1.0),
                                       "model.moe_capacity_factor"),
                                      (dict(moe_experts=-2), "model.moe_experts")])
def test_bad_moe_config_is_refused(kw, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        _cfg(**kw)
