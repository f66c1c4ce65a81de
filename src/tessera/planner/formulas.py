"""The papers' formulas: FLOPs, parameters, model-state bytes and activation bytes, each cited.

Notation as in :mod:`tessera.planner.workload`.

FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", §5.1):

- model FLOPs per iteration, eq. (3) without recomputation:
  ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` = 3 × (forward 24Bslh² + 4Bs²lh + 2BshV).
  Generalized here to GQA and SwiGLU by counting the forward matrix multiplies, 2 FLOPs per
  multiply-add: ``2·B·s·N_mm + 4·B·s²·l·h`` with N_mm = l·(h(h + 2·kv) + h² + k·h·f) + V·h
  (k = 2 GeLU matrices or 3 SwiGLU matrices, kv the key/value width), times 3 for forward and
  backward (PaLM, Chowdhery et al. 2022, App. B: 6·N + 12·l·h·s per token);
- hardware FLOPs add recomputation. Full recomputation repeats every block's forward, giving
  eq. (3)'s ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``; selective recomputation (Korthikanti et
  al. 2022) repeats only attention's ``4·B·s²·l·h``.
- MFU = model FLOP/s over peak; HFU = hardware FLOP/s over peak (Chowdhery et al. 2022).
- parameters, eq. (2): ``P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))``; the exact count of a
  ModelSpec is in :mod:`tessera.planner.models`.
- time to train on T tokens, §5.1: ``8·T·P / (n·X)`` for n GPUs at X FLOP/s each (full
  recomputation: 8 = 2·(forward + recompute + 2·backward) FLOPs per parameter per token).

Memory (bytes per rank):

- model state (Rajbhandari et al. 2020, "ZeRO", §3.1 and §5): mixed-precision Adam keeps
  2Ψ parameters + 2Ψ gradients + KΨ optimizer state (K = 12: fp32 master weights, momentum,
  variance); ZeRO-1 divides the K term by N_d, ZeRO-2 also the gradients, ZeRO-3 everything:
  ``(2 + 2 + K)Ψ``, ``4Ψ + KΨ/N_d``, ``2Ψ + (2 + K)Ψ/N_d``, ``(2 + 2 + K)Ψ/N_d``;
- activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Table 2), in bytes with e = 2: no parallelism ``sbh(34 + 5as/h)``,
  tensor parallel ``sbh(10 + 24/t + 5as/(ht))``, with sequence parallel ``sbh/t·(34 + 5as/h)``,
  selective recomputation drops the ``5as/h`` term, full recomputation keeps ``2sbh`` (the
  block's input). :func:`layer_activation_bytes` rebuilds these from the tensors each block
  stores, so GQA, SwiGLU, no dropout and flash attention (no s² tensors) follow from the
  same count; context parallelism divides s by c except the s² term, which is ``a·(s/c)·s``;
"""

from __future__ import annotations

from tessera.errors import ConfigError
from tessera.planner.models import ModelSpec

FLOP_CONVENTIONS = ("causal", "full")
"""How the attention score FLOPs are counted: 'full' s² per sequence, as Megatron-LM (Narayanan
et al. 2021, eq. 3) and the PaLM appendix count; 'causal' half of it, the products a causal
mask leaves, as Llama 3 (Grattafiori et al. 2024, Table 4) and most MFU reports count."""


def megatron_params(l: int, h: int, V: int, s: int) -> float:  # noqa: E741
    """Narayanan et al. 2021, eq. (2): P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def megatron_model_flops(B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """Model FLOPs per iteration: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_hardware_flops(B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """Narayanan et al. 2021, eq. (3), full recomputation: 96·B·s·l·h²·(1 + s/(6h) + V/(16lh))."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Narayanan et al. 2021 §5.1: end-to-end training time ≈ 8·T·P / (n·X), in days."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86400


def zero_model_state_parts(params: float, zero_stage: int, n_d: int, k: int = 12,
                           param_bytes: int = 2, grad_bytes: int = 2) -> dict[str, float]:
    """Rajbhandari et al. 2020 §5, Figure 1: bytes of parameters, gradients and optimizer
    state per data-parallel rank."""
    return {"params": param_bytes * params / (n_d if zero_stage >= 3 else 1),
            "grads": grad_bytes * params / (n_d if zero_stage >= 2 else 1),
            "optimizer": k * params / (n_d if zero_stage >= 1 else 1)}


def zero_model_state_bytes(params: float, zero_stage: int, n_d: int, k: int = 12,
                           param_bytes: int = 2, grad_bytes: int = 2) -> float:
    """Bytes of model state per data-parallel rank (the sum of `zero_model_state_parts`)."""
    return sum(zero_model_state_parts(params, zero_stage, n_d, k, param_bytes,
                                      grad_bytes).values())


def zero_max_params(memory_bytes: float, zero_stage: int, n_d: int, k: int = 12) -> float:
    """Largest Ψ whose model state fits `memory_bytes` per rank (inverse of the above)."""
    return memory_bytes / zero_model_state_bytes(1.0, zero_stage, n_d, k)


def layer_activation_bytes(spec: ModelSpec, b: int, s: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", flash: bool = False, cp: int = 1,
                           e: int = 2) -> float:
    """Bytes one block keeps for its backward, per rank (Korthikanti et al. 2022, §4).

    Counted tensor by tensor as in the paper's derivation; with GPT's shapes (MHA, 4h GeLU,
    dropout) and e = 2 this is exactly Table 2. Replicated across tensor-parallel ranks unless
    sequence parallel: the two norm inputs, the inputs of the QKV and first MLP projections
    and the two residual dropout masks. Split over t: Q and K (inputs of QKᵀ), V, the attention
    output, the MLP's inner activations, and the s×s score tensors unless flash attention or
    selective recomputation avoids keeping them.
    """
    h, f = spec.hidden, spec.ffn_hidden
    sl = s // cp  # this rank's tokens
    tokens = sl * b
    mask = 1 if spec.dropout else 0
    if recompute == "full":
        return e * tokens * h / (t if sp else 1)
    replicated = tokens * (2 * e * h + 2 * e * h + 2 * mask * h)  # norms, proj inputs, masks
    qk = e * tokens * (h + spec.kv_dim)
    v = e * tokens * spec.kv_dim
    attn_out = e * tokens * h
    inner = (3 if spec.mlp == "swiglu" else 2) * e * tokens * f
    scores = 0.0
    if not flash and recompute != "selective":
        # softmax output, and with dropout its mask and output: 2 + 1 + 2 bytes per score
        per_score = e + (mask + e) * mask
        scores = per_score * spec.heads * sl * s * b
    split = qk + v + attn_out + inner + scores
    return replicated / (t if sp else 1) + split / t


def layer_forward_flops(spec: ModelSpec, b: int, s: int, cp: int = 1) -> tuple[float, float]:
    """(matmul, attention-core) forward FLOPs of one block on b sequences of this rank's s/c
    tokens, before tensor-parallel splitting: 2·tokens·N_mm_layer and 4·b·(s/c)·s·h."""
    sl = s // cp
    return 2 * b * sl * spec.layer_matmul_params, 4 * b * sl * s * spec.hidden


def model_flops_per_step(spec: ModelSpec, B: int, s: int, convention: str = "full") -> float:
    """Model FLOPs per iteration: 3·(2·B·s·N_mm + 4·B·s²·l·h), N_mm with the LM head; the
    causal convention (FLOP_CONVENTIONS) counts half the score products, 2·B·s²·l·h. For an
    active model N_mm is the mixture of experts' own (``ModelSpec.model_matmul_params``: k
    experts, the shared one and the router per MoE block, as ``tessera.model.flops_per_token``
    counts them)."""
    return _flops_per_step(spec, B, s, spec.model_matmul_params, convention)


def _flops_per_step(spec: ModelSpec, B: int, s: int, blocks_mm: float, convention: str
                    ) -> float:
    """3·(2·B·s·(blocks_mm + V·h) + 4·B·s²·l·h·share): forward and backward FLOPs of a step
    whose blocks' matrix multiplies use `blocks_mm` weights per token."""
    mm = blocks_mm + spec.vocab_size * spec.hidden
    attn = 4 * B * s * s * spec.layers * spec.hidden * _attention_share(convention)
    return 3 * (2 * B * s * mm + attn)


def _attention_share(convention: str) -> float:
    if convention not in FLOP_CONVENTIONS:
        raise ConfigError("flops", convention, f"must be one of {', '.join(FLOP_CONVENTIONS)}")
    return 0.5 if convention == "causal" else 1.0


def hardware_flops_per_step(spec: ModelSpec, B: int, s: int, recompute: str,
                            convention: str = "full") -> float:
    """Model FLOPs plus what recomputation repeats (eq. 3's 96 for full recomputation); an
    active model's blocks as its ranks run them (``planner.moe.active_spec``'s width: tp×
    the MoE MLPs where each tp rank holds them whole, with the router on each of them)."""
    mm_layer, attn = layer_forward_flops(spec, B, s)
    attn *= _attention_share(convention)
    extra = {"none": 0.0, "selective": attn, "full": mm_layer + attn}[recompute]
    blocks_mm = spec.layers * spec.layer_matmul_params
    if spec.moe is not None:
        routers = spec.moe.whole_tp * spec.moe_blocks * spec.moe.experts * spec.hidden
        blocks_mm += routers
        if recompute == "full":
            extra += 2 * B * s * routers / spec.layers
    return _flops_per_step(spec, B, s, blocks_mm, convention) + spec.layers * extra
