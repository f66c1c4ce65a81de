"""The reference model: formulas against counting, and the properties parallel code relies on."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tessera.config import ModelConfig
from tessera.config_io import make_config
from tessera.model import (
    RMSNorm,
    apply_rope,
    build_model,
    cross_entropy,
    flops_per_token,
    init_tensor,
    param_count,
    rope_tables,
)
from tessera.testing import assert_close_summed

SHAPES = [
    dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2),
    dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, tie_embeddings=True),
    dict(d_model=96, n_layers=1, n_heads=6, n_kv_heads=1, ffn_hidden=200, vocab_size=1000),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_param_count_formula_matches_tensors(shape):
    cfg = ModelConfig(**shape)
    model = build_model(cfg)
    counted = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert param_count(cfg) == counted


def test_param_count_presets():
    # GPT-2 small in Llama form lands on ~124M (GPT-2's own count is 124.4M with learned
    # positions; we use RoPE and a 3-matrix MLP of the same parameter budget).
    assert abs(param_count(make_config("gpt2-124m").model) / 1e6 - 123.6) < 1.0
    # Llama 3.2 1B: 1.236B parameters with tied embeddings (the model card's figure).
    assert abs(param_count(make_config("llama-1b").model) / 1e9 - 1.236) < 0.005


@pytest.mark.parametrize("shape", SHAPES)
def test_flops_formula_matches_flop_counter(shape):
    cfg = ModelConfig(**shape, max_seq_len=32)
    model = build_model(cfg)
    B, T = 2, 32
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1))
    with FlopCounterMode(display=False) as counter:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    # The counter sees every matmul (the 6·N_matmul part) but not the CPU attention kernel, so
    # the attention part is counted on an explicit QKᵀ / AV with the same shapes. Both counts
    # are exact integers, and so is the formula: exact agreement expected.
    hd, a = cfg.head_dim, cfg.n_heads
    q = torch.randn(B, a, T, hd, requires_grad=True)
    k = torch.randn(B, a, T, hd, requires_grad=True)
    v = torch.randn(B, a, T, hd, requires_grad=True)
    with FlopCounterMode(display=False) as attn_counter:
        ((q @ k.transpose(-1, -2)).softmax(-1) @ v).sum().backward()
    # dq, dk, dv need 4 matmuls where the forward had 2; the leaf q also costs nothing extra.
    attention = attn_counter.get_total_flops() * cfg.n_layers
    assert counter.get_total_flops() + attention == flops_per_token(cfg, T) * B * T


def test_causal_future_does_not_leak():
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    model = build_model(cfg)
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    # Positions before the change see identical inputs: the same sums, at most blocked
    # differently by the attention kernel (16 positions).
    assert_close_summed(model(y)[0, :10], model(x)[0, :10], terms=16, msg="positions < 10")
    assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:])


def test_rope_is_relative():
    # <R(m)q, R(n)k> depends only on m - n.
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def at(x, pos):
        return apply_rope(x, cos[pos:pos + 1], sin[pos:pos + 1])

    d1 = (at(q, 7) * at(k, 3)).sum()
    d2 = (at(q, 20) * at(k, 16)).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-5, atol=1e-5)  # fp32 trig round-off


def test_init_depends_only_on_seed_and_name():
    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=2)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    w = init_tensor(cfg, "layers.1.attention.wq.weight", (32, 32), seed=3)
    assert torch.equal(w, a.layers[1].attention.wq.weight)
    assert not torch.equal(w, build_model(cfg, seed=4).layers[1].attention.wq.weight)
    assert torch.equal(a.layers[0].ffn_norm.weight, torch.ones(32))


def test_tied_embeddings_share_storage():
    model = build_model(ModelConfig(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


def test_initial_loss_near_uniform():
    model = build_model(ModelConfig(d_model=64, n_heads=4))
    x = torch.randint(0, 256, (4, 33))
    loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


# Precision: where bf16 inputs are widened to fp32 (the model's comments and docstrings).


def _bf16_activations(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*shape, generator=g) * 30).to(torch.bfloat16)


def test_rmsnorm_normalizes_bf16_in_fp32():
    """The mean of squares and the scaling run in fp32, rounded to bf16 once at the end."""
    norm = RMSNorm(64, eps=1e-5)
    x = _bf16_activations(4, 64)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(norm(x), want * norm.weight)


def test_rope_rotates_bf16_in_fp32():
    cos, sin = rope_tables(8, 16, 10000.0)
    x = _bf16_activations(2, 16, 4, 8)
    got = apply_rope(x, cos, sin)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, apply_rope(x.float(), cos, sin).to(torch.bfloat16))


def test_loss_of_bf16_logits_is_computed_in_fp32():
    logits = _bf16_activations(2, 16, 256)
    targets = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                               targets.flatten()))


def test_llama3_rope_scaling_bands():
    """Llama 3's frequency scaling: wavelengths under L/high kept, over L/low divided by the
    factor, a continuous blend between (L = the original context); None leaves plain RoPE."""
    import math

    from tessera.config import RopeScaling
    from tessera.errors import ConfigError
    from tessera.model import rope_frequencies

    plain = rope_frequencies(128, 500000.0)
    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_seq_len=8192)
    scaled = rope_frequencies(128, 500000.0, scaling)
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], plain[short])
    assert torch.equal(scaled[long], plain[long] / 32)
    mid = ~short & ~long
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 32)).all()
    # The blend joins the bands continuously, so frequencies still fall with the dimension
    # (blending the wrong way round jumps at both edges).
    assert (scaled[1:] < scaled[:-1]).all()
    assert torch.equal(rope_tables(16, 8, 10000.0)[0],
                       rope_tables(16, 8, 10000.0, None)[0])
    cfg = ModelConfig(rope_scaling_factor=8.0)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert ModelConfig().rope_scaling is None
    with pytest.raises(ConfigError, match=r"model.rope_scaling_factor=0.5: must be >= 1"):
        ModelConfig(rope_scaling_factor=0.5)
    with pytest.raises(ConfigError, match=r"model.rope_high_freq_factor=1.0: must be > "):
        ModelConfig(rope_scaling_factor=8.0, rope_high_freq_factor=1.0)
