"""The single-device reference transformer: Llama-style, and unaware of ranks.

Every parallel mechanism in tessera is proven against this module. Its parts are plain
``nn.Module``s with stable names (``tok_embeddings``, ``layers.{i}.attention.wq``, ...), so a
parallelizer can find, split or wrap them without the model knowing.

Architecture (Touvron et al., "LLaMA", 2023): pre-norm blocks with RMSNorm (Zhang & Sennrich,
2019), rotary position embeddings (Su et al., 2021), SwiGLU MLP (Shazeer, 2020) and
grouped-query attention (Ainslie et al., 2023) through ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the input dtype: the mean of squares underflows in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | None = None) -> torch.Tensor:
    """The head_dim/2 rotation frequencies θ^(-2i/d), float64; with `scaling`, Llama 3's.

    Llama 3 (Meta's ``apply_scaling``, Hugging Face rope_type "llama3"): with L the original
    context, a frequency whose wavelength 2π/f exceeds L / low_freq_factor is divided by
    `factor`, one whose wavelength is below L / high_freq_factor is kept, and between the two
    f ↦ (1 − s)·f/factor + s·f with s = (L/wavelength − low) / (high − low), which joins them
    continuously.
    """
    freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freq
    wavelength = 2 * math.pi / freq
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelength - low) / (high - low)
    blended = (1 - smooth) * freq / scaling.factor + smooth * freq
    return torch.where(wavelength < scaling.original_max_seq_len / high, freq,
                       torch.where(wavelength > scaling.original_max_seq_len / low,
                                   freq / scaling.factor, blended))


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim/2), for rotating query/key pairs;
    `scaling` is the model's Llama 3 frequency scaling (``ModelConfig.rope_scaling``)."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64),
                         rope_frequencies(head_dim, theta, scaling))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, nh, hd) by position; cos/sin are (T, hd/2). Pairs are (even, odd) dims."""
    xf = x.float()  # one cast (a no-op in fp32), both halves are views of it
    x1, x2 = xf[..., 0::2], xf[..., 1::2]  # (B, T, nh, hd/2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, T, nh, hd/2, 2)
    return out.flatten(-2).type_as(x)


class AttentionCore(nn.Module):
    """Causal softmax(q·kᵀ/√d)·v with grouped-query heads: (B, nh|nkv, T, hd) -> (B, nh, T, hd).
    No parameters; a module of its own so that selective recomputation can target it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The local head counts and the sequence length come from the projections, so a
        # tensor-parallel shard of this module (fewer output rows in wq/wk/wv, whose outputs
        # cover the full sequence also when x holds 1/t of it) runs the same code on its heads.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        B, T = q.shape[:2]
        if cos.shape[0] != T:
            raise ValueError(f"RoPE tables cover {cos.shape[0]} positions but attention sees {T}"
                             " tokens; a sequence-parallel block needs the full sequence's tables")
        q = q.view(B, T, -1, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, nkv, hd)
        v = v.view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh|nkv, T, hd)
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, h)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        """`layer`: the block's index in the model (which blocks are MoE, cfg.moe_every)."""
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            from tessera.moe import MoEFeedForward

            self.feed_forward: nn.Module = MoEFeedForward(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V)."""
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(tokens)  # (B, T, h)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in nats; logits (B, T, V), targets (B, T). Computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------------------------------------
# Initialization: every parameter's values depend only on (seed, its name), so a shard of a
# parameter can be cut from the same full tensor on any rank, and results do not depend on the
# parallel layout.


def param_generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def init_tensor(cfg: ModelConfig, name: str, shape: torch.Size | tuple[int, ...],
                seed: int) -> torch.Tensor:
    """The full initial value of parameter `name` (a name in the reference model)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = cfg.init_std
    # GPT-2 style: scale the projections that write into the residual stream by 1/sqrt(2L).
    if name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):
        std = std / (2 * cfg.n_layers) ** 0.5
    return torch.randn(shape, generator=param_generator(seed, name)) * std


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> Transformer:
    for name, p in model.named_parameters():
        p.copy_(init_tensor(model.cfg, name, p.shape, seed))
    return model


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """The reference model with its deterministic initialization."""
    model = init_weights(Transformer(cfg), seed)
    return model.to(device)


# ---------------------------------------------------------------------------------------------
# Counting. The formulas are checked against counting the module's tensors in the tests.


def param_count(cfg: ModelConfig) -> int:
    """Parameters N of the reference model.

    Per block: attention h·(a + 2·kv)·d + a·d·h for wq, wk, wv, wo (a query heads, kv key/value
    heads of size d = h/a), SwiGLU 3·h·f, and two RMSNorm vectors 2h. Plus the embedding V·h,
    the final norm h and, untied, the LM head V·h. With kv = a and f = 4h this is the familiar
    12·L·h² + 2Vh of Kaplan et al. (2020) up to the norms.
    """
    h, L, V, d = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.head_dim
    attn = h * (cfg.n_heads + 2 * cfg.n_kv_heads) * d + cfg.n_heads * d * h
    mlps = sum(mlp_params(cfg, i) for i in range(L))
    head = 0 if cfg.tie_embeddings else V * h
    return V * h + L * (attn + 2 * h) + mlps + h + head


def mlp_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Feed-forward parameters of block `layer`: SwiGLU 3·h·f, or for an MoE layer the router
    E·h, E experts of 3·h·f_e (only k of them with `active`: what one token uses) and the
    shared expert's 3·h·f."""
    h = cfg.d_model
    if not cfg.is_moe_layer(layer):
        return 3 * h * cfg.ffn_hidden
    used = cfg.moe_top_k if active else cfg.moe_experts
    shared = 3 * h * cfg.ffn_hidden if cfg.moe_shared_expert else 0
    return cfg.moe_experts * h + used * 3 * h * cfg.moe_hidden + shared


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: param_count with k of E experts per MoE layer (= N dense)."""
    return param_count(cfg) - sum(mlp_params(cfg, i) - mlp_params(cfg, i, active=True)
                                  for i in range(cfg.n_layers))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Model FLOPs per trained token (forward + backward), as in PaLM (Chowdhery et al. 2022, B).

    6·N_matmul + 12·L·a·d·T: each weight of a matrix multiply costs 2 FLOPs per token forward
    and 4 backward; attention's QKᵀ and AV add 2·2·a·d·T per token per layer forward, tripled for
    backward. N_matmul counts the weights used in matrix multiplies: all blocks' linears and the
    LM head (the embedding lookup and norms are not matmuls). Causal masking is not discounted,
    following the convention of PaLM and nanoGPT (6N + 12·L·H·Q·T).

    Mixture of experts: only the active weights count (the router and k of E experts per
    token, ``mlp_params(active=True)``), so MFU is not inflated by experts a token never uses.
    """
    h, L, V, d = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.head_dim
    attn = h * (cfg.n_heads + 2 * cfg.n_kv_heads) * d + cfg.n_heads * d * h
    n_matmul = L * attn + sum(mlp_params(cfg, i, active=True) for i in range(L)) + V * h
    return 6 * n_matmul + 12 * L * cfg.n_heads * d * seq_len
