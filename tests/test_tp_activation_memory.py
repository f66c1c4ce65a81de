"""Activation memory per layer under tensor and sequence parallelism (Korthikanti et al. 2022).

What is measured: the bytes autograd saves for backward while one layer runs forward, counted by
``torch.autograd.graph.saved_tensors_hooks`` and deduplicated by storage (q, k and v views of one
buffer count once), leaving out parameters and the constant RoPE tables. This is the per-rank
activation memory of a layer, the quantity of the paper's §4 (Table 2).

The formula. Korthikanti et al. count, per layer, in bytes with 16-bit activations and 1-byte
dropout masks: s·b·h·(34 + 5·a·s/h) with no parallelism, s·b·h·(10 + 24/t + 5·a·s/(h·t)) with
t-way tensor parallelism, and s·b·h/t·(34 + 5·a·s/h) with sequence parallelism as well. It
assumes GPT's layer: LayerNorms, a fused QKV projection, softmax attention that stores the
softmax output, its dropout mask and the dropped-out probabilities, a 4h GeLU MLP, and dropout
after attention and after the MLP. Our Llama model has none of the dropouts, RMSNorm, RoPE, a
SwiGLU MLP (three matrices of inner size ~8h/3) and fused SDPA attention that stores a
log-sum-exp instead of s×s probabilities, so its bytes differ from the formula by construction.

So two tests:

1. ``GPTLayer`` below is the paper's layer built from tessera's tensor-parallel pieces
   (ColumnParallelLinear, RowParallelLinear and their f/g or SP conjugates). Its measured bytes
   match the formula within 5% for t = 1, 2, 4 with and without SP. It runs in fp32: every
   activation is 4 bytes instead of the formula's 2, the bool dropout masks stay 1 byte, so the
   fp32 expectation is the formula with its activation terms doubled (its mask terms,
   2·s·b·h + a·s²·b/t, kept); we check that the 16-bit coefficients of that decomposition give
   back the paper's formula exactly, and we also run the layer in bf16, where the formula applies
   unscaled.
2. Our Llama block, measured the same way: the bytes split into a replicated part R and a
   tensor-parallel part S, M(t) = R + S/t without SP, and SP divides the replicated part too,
   M_SP(t) = (R + S)/t = M(1)/t, within 5%.

Sequence parallelism here stores the local s/t slice of the input of each column-parallel
region and all-gathers it again in backward (Korthikanti §4.2.2); that is what the s·b·h/t·34
assumes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig, ParallelConfig
from tessera.model import Block, init_tensor, rope_tables
from tessera.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TPContext,
)
from tessera.parallel.tp_plan import parallelize_module
from tessera.testing import run_ranks
from tessera.topology import Topology

S, B, H, A = 32, 4, 64, 4  # sequence, micro-batch, hidden, heads


def saved_bytes(run, exclude: list[torch.Tensor]) -> int:
    """Bytes of distinct storages autograd saves while `run()` executes (excluding `exclude`)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s  # keeping a reference keeps the address unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    total = sum(s.nbytes() for s in storages.values())
    del out
    return total


class GPTLayer(nn.Module):
    """The transformer layer of Korthikanti et al. §4.1, tensor-parallel: LayerNorm, fused QKV
    (column-parallel), softmax attention with dropout, output projection (row-parallel),
    dropout, residual; LayerNorm, 4h GeLU MLP (column- then row-parallel), dropout, residual."""

    def __init__(self, tp: TPContext, dtype: torch.dtype, p: float = 0.1):
        super().__init__()
        t, g = tp.size, torch.Generator().manual_seed(0)

        def w(rows, cols):
            return (torch.randn(rows, cols, generator=g) * 0.02).to(dtype)

        self.ln1, self.ln2 = nn.LayerNorm(H, dtype=dtype), nn.LayerNorm(H, dtype=dtype)
        col = ShardSpec(dim=0, chunks=t, full_size=3 * H)
        row = ShardSpec(dim=1, chunks=t, full_size=H)
        # This rank's [q; k; v] rows for its A/t heads.
        self.qkv = ColumnParallelLinear(w(3 * H // t, H), tp, col, "attn")
        self.proj = RowParallelLinear(w(H, H // t), tp, row, "attn")
        self.fc1 = ColumnParallelLinear(w(4 * H // t, H), tp, col, "mlp")
        self.fc2 = RowParallelLinear(w(H, 4 * H // t), tp, row, "mlp")
        self.p, self.tp = p, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        qkv = self.qkv(self.ln1(x))  # (b, s, 3h/t), the sequence gathered under SP
        s = qkv.shape[1]
        q, k, v = qkv.view(b, s, 3, -1, H // A).permute(2, 0, 3, 1, 4)  # (b, a/t, s, d) each
        causal = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)  # added: not saved
        scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(H // A)) + causal
        probs = self.dropout(scores.softmax(-1))  # (b, a/t, s, s)
        y = (probs @ v).transpose(1, 2).reshape(b, s, -1)  # (b, s, h/t)
        x = x + self.dropout(self.proj(y))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        # The fused kernel that keeps a 1-byte mask, as Megatron's does on GPUs; CPU F.dropout
        # would keep a mask in the activation dtype.
        return torch.native_dropout(x, self.p, True)[0]


def gpt_formula(t: int, sequence_parallel: bool) -> tuple[float, float]:
    """(activation elements, mask bytes) per layer per rank, term by term from §4.1."""
    sbh, as2b = S * B * H, A * S * S * B
    # Replicated without SP: 2 LayerNorm inputs, the QKV and fc1 inputs; 2 dropout masks.
    rep_act, rep_mask = 4 * sbh, 2 * sbh
    # Split over t: Q, K, V; the projection input; GeLU input and output (4h each); softmax
    # output and dropped-out probabilities; the attention dropout mask.
    split_act, split_mask = (3 + 1 + 4 + 4) * sbh + 2 * as2b, as2b
    if sequence_parallel:
        return (rep_act + split_act) / t, (rep_mask + split_mask) / t
    return rep_act + split_act / t, rep_mask + split_mask / t


def paper_bytes(t: int, sequence_parallel: bool) -> float:
    sbh = S * B * H
    if sequence_parallel:
        return sbh / t * (34 + 5 * A * S / H)
    return sbh * (10 + 24 / t + 5 * A * S / (H * t))


def _llama_block(tp: TPContext) -> float:
    cfg = ModelConfig(vocab_size=256, d_model=H, n_layers=1, n_heads=A, n_kv_heads=A,
                      max_seq_len=S)
    block = Block(cfg)
    parallelize_module(block, tp, lambda name, shape: init_tensor(cfg, "layers.0." + name, shape,
                                                                  0))
    cos, sin = rope_tables(cfg.head_dim, S, cfg.rope_theta)
    s_local = S // tp.size if tp.sequence_parallel else S
    x = torch.randn(B, s_local, H, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    return saved_bytes(lambda: block(x, cos, sin), list(block.parameters()) + [cos, sin])


def _gpt_layer(tp: TPContext, dtype: torch.dtype) -> float:
    layer = GPTLayer(tp, dtype)
    s_local = S // tp.size if tp.sequence_parallel else S
    x = torch.randn(B, s_local, H, generator=torch.Generator().manual_seed(1), dtype=dtype,
                    requires_grad=True)
    return saved_bytes(lambda: layer(x), list(layer.parameters()))


def _memory_worker() -> dict:
    out = {}
    for t in (1, 2, 4):
        topo = Topology.build(ParallelConfig(dp=4 // t, tp=t))
        for sequence_parallel in (False, True):
            tp = TPContext(group=topo.group("tp"), sequence_parallel=sequence_parallel)
            out[t, sequence_parallel] = {
                "gpt_fp32": _gpt_layer(tp, torch.float32),
                "gpt_bf16": _gpt_layer(tp, torch.bfloat16),
                "llama": _llama_block(tp),
            }
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_ranks(_memory_worker, 4, timeout=240)


def test_term_decomposition_is_the_paper_formula():
    for t in (1, 2, 4, 8):
        for sequence_parallel in (False, True):
            act, masks = gpt_formula(t, sequence_parallel)
            assert 2 * act + masks == pytest.approx(paper_bytes(t, sequence_parallel))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("t", (1, 2, 4))
@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
def test_gpt_layer_matches_korthikanti(measured, t, sequence_parallel):
    act, masks = gpt_formula(t, sequence_parallel)
    fp32_expected = 4 * act + masks  # 4-byte activations, 1-byte masks
    bf16_expected = paper_bytes(t, sequence_parallel)  # the formula as printed
    # The formula leaves out the two LayerNorms' per-token mean and 1/std: 4 numbers per token
    # of the local sequence, 0.3-0.7% here. With them the count is exact.
    tokens = B * (S // t if sequence_parallel else S)
    for rank_result in measured:
        r = rank_result[t, sequence_parallel]
        assert r["gpt_fp32"] == pytest.approx(fp32_expected, rel=0.05), (r, fp32_expected)
        assert r["gpt_bf16"] == pytest.approx(bf16_expected, rel=0.05), (r, bf16_expected)
        assert r["gpt_fp32"] == fp32_expected + 4 * tokens * 4
        assert r["gpt_bf16"] == bf16_expected + 4 * tokens * 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sequence_parallel_divides_the_replicated_part(measured):
    """Our Llama block: M(t) = R + S/t without SP (R, S fitted from t = 1, 2 and checked at
    t = 4); with SP every part is divided: M_SP(t) = M(1)/t."""
    for rank_result in measured:
        m = {key: r["llama"] for key, r in rank_result.items()}
        split = 2 * (m[1, False] - m[2, False])  # S
        replicated = m[1, False] - split  # R
        assert replicated > 0.2 * m[1, False]  # TP alone leaves a real replicated part ...
        assert m[4, False] == pytest.approx(replicated + split / 4, rel=0.05)
        for t in (2, 4):  # ... which SP divides by t as well
            assert m[t, True] == pytest.approx(m[1, False] / t, rel=0.05), (t, m)
            assert m[t, True] < m[t, False] - 0.5 * replicated * (1 - 1 / t)
