"""What tessera's own engine builds, as the planner sees it: its layout rules, split, and bytes.

A planner model is *tessera-expressible* when tessera's reference transformer has its shape
(SwiGLU, RMSNorm, RoPE, no biases, no dropout, an even head size): the tessera presets and the
Llama 3 family. For such a model the planner does not keep rules or byte counts of its own:

- **feasibility** is ``tessera.layout.validate``: a planner ``Layout`` on a ``Workload``
  becomes a tessera ``Config`` (:func:`to_config`) and ``layout.validate`` decides
  (:func:`refusal`), so every layout the planner proposes is one ``tessera train`` runs, and
  the reverse (tests/test_planner_engine.py enumerates both sets on 8 ranks);
- **the pipeline split** is ``tessera.pipeline.split``'s (balanced by cost: a heavy LM head
  pushes blocks towards earlier stages, and p·v need not divide the layers);
- **model state** is what ``tessera.parallelize`` allocates (:func:`model_state_bytes`):
  parameters per tensor-parallel rank (vocabulary padded to a multiple of t, norms and, when
  t > n_kv_heads, key/value heads replicated), ZeRO's flat units (embedding, each block, the
  head; each padded to a multiple of dp), a tied embedding's copy on the head's rank when
  that is not the embedding's, and for plain fp32 data parallelism DDP's one "used" flag per
  parameter in its buckets and AdamW's step counter per parameter;
- **activations** are what autograd saves for backward in tessera's block (:func:`block_saved_
  bytes`), counted tensor by tensor as Korthikanti et al. (2022, §4.1) count Megatron's layer,
  plus the first and last chunk's extras (:func:`chunk_saved_bytes`).

Catalog models of other shapes (GPT: GeLU, LayerNorm, biases, learned positions, dropout) keep
the planner's own rules and the papers' closed forms (``tessera.planner.cost``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

from tessera.config import Config, DataConfig, ParallelConfig, TrainConfig
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.pipeline.split import block_split, parse_stage_layout
from tessera.planner.models import ModelSpec, model_config
from tessera.planner.workload import PARALLEL_FIELDS, Layout, Workload, stage_layout_text

F32 = 4
"""Bytes of the tensors tessera keeps in fp32 whatever the compute dtype: RMSNorm's input copy
and 1/rms, attention's log-sum-exp, the loss's softmax."""
INDEX = 8
"""Bytes of an int64 token id (targets, and the vocabulary-parallel embedding's local ids)."""


# ---------------------------------------------------------------------------------------------
# The model and the layout as tessera configuration


def to_config(w: Workload, L: Layout) -> Config:
    """The tessera Config that runs layout `L` of workload `w` (m = B/(dp·b) micro-batches of
    b sequences per step on each data-parallel rank). Raises ConfigError where a section's own
    validation refuses a value."""
    model = model_config(w.model, w.seq_len)
    if model is None:
        raise ValueError(f"{w.model.name} is not a tessera model")
    parallel = ParallelConfig(**{name: getattr(L, name) for name in PARALLEL_FIELDS},
                              stage_layout=stage_layout_text(L.stage_layout)
                              if L.stage_layout else "")
    # Recipes tessera does not run (bf16 with fp32 gradients or bf16 states) are checked as
    # bf16: the layout rules do not depend on them.
    precision = w.precision if w.precision in ("bf16", "fp32") else "bf16"
    train = TrainConfig(micro_batch_size=L.micro_batch, grad_accum=L.microbatches(w.global_batch),
                        precision=precision)
    return Config(model=model, parallel=parallel, train=train, data=DataConfig(seq_len=w.seq_len))


def layout_of(cfg: Config) -> Layout:
    """The planner's Layout of a tessera Config (the inverse of :func:`to_config`)."""
    p = cfg.parallel
    return Layout(**{name: getattr(p, name) for name in PARALLEL_FIELDS},
                  micro_batch=cfg.train.micro_batch_size,
                  stage_layout=parse_stage_layout(p.stage_layout) if p.stage_layout else None)


@lru_cache(maxsize=65536)
def refusal(w: Workload, L: Layout) -> str | None:
    """Why tessera would refuse `L` on `w` (``layout.validate``'s one-line message), or None."""
    try:
        validate(to_config(w, L), w.gpus)
    except ConfigError as e:
        return str(e)
    return None


@lru_cache(maxsize=1024)
def blocks_per_chunk(spec: ModelSpec, n_chunks: int, seq_len: int) -> tuple[int, ...]:
    """Transformer blocks in each of the n_chunks pipeline chunks, as tessera splits them."""
    cfg = model_config(spec, seq_len)
    assert cfg is not None
    return tuple(block_split(cfg, n_chunks, seq_len))


# ---------------------------------------------------------------------------------------------
# Parameters per tensor-parallel rank, as ZeRO units


def _kv_rows(spec: ModelSpec, t: int) -> int:
    """Rows of wk (and wv) on one tp rank: kv heads split over t, or one head replicated on
    t/n_kv_heads ranks when t exceeds them (``ColwiseParallel(replicate=True)``)."""
    chunks = t if spec.kv_heads % t == 0 else spec.kv_heads
    return spec.kv_dim // chunks


def vocab_rows(spec: ModelSpec, t: int) -> int:
    """Embedding (and LM head) rows on one tp rank: the vocabulary padded to a multiple of t."""
    return math.ceil(spec.vocab_size / t)


def block_numel(spec: ModelSpec, t: int) -> int:
    """One block's parameters on a tp rank: wq and wo split by heads, wk/wv by kv heads, the
    SwiGLU matrices by columns/rows, the two RMSNorm gains replicated."""
    h = spec.hidden
    return 2 * h * (h // t) + 2 * h * _kv_rows(spec, t) + 3 * h * (spec.ffn_hidden // t) + 2 * h


def chunk_units(spec: ModelSpec, t: int, n_chunks: int, c: int, blocks: int,
                head_apart: bool) -> list[tuple[int, int]]:
    """(elements, tensors) of each ZeRO unit of chunk c on one tp rank, in
    ``tessera.parallel.zero_units.chunk_units``'s order: embedding, blocks, head. With tied
    embeddings the head shares the embedding when both are in this chunk, reads chunk 0's when
    both chunks are on this rank (pp = 1, or the V shapes' rank 0), or keeps a copy when
    `head_apart` (the last chunk on another rank than chunk 0: ``pipeline.head_apart``)."""
    h, vocab = spec.hidden, vocab_rows(spec, t) * spec.hidden
    first, last = c == 0, c == n_chunks - 1
    tied = spec.tied_embeddings
    units = []
    if first and not (tied and last):
        units.append((vocab, 1))
    units += [(block_numel(spec, t), 9)] * blocks
    if last:
        if tied and first:
            units.append((vocab + h, 2))
        elif tied and head_apart:
            units += [(h, 1), (vocab, 1)]
        elif tied:
            units.append((h, 1))
        else:
            units.append((h + vocab, 2))
    return units


def flat_units(precision: str, zero_stage: int, dp_mode: str) -> bool:
    """Whether ZeRO's flat units hold a rank's model state and its optimizer steps them
    (``parallelize``: all-reduce data parallelism at ZeRO stage >= 1, or in bf16 at any stage);
    else the optimizer steps each parameter tensor."""
    return dp_mode == "allreduce" and (zero_stage > 0 or precision == "bf16")


def unit_decay_runs(spec: ModelSpec, units: Iterable[tuple[int, int]]) -> int:
    """Runs of adjacent weight-decayed matrices in whole `units` (``FlatUnit.decay_ranges``):
    two in a block (the attention's matrices after its norm gain, the MLP's after its own),
    one in a unit holding an embedding or a head matrix, none in a lone norm gain."""
    return sum(2 if k > 2 else int(n != spec.hidden) for n, k in units)


def rank_units(w: Workload, L: Layout, pp_rank: int) -> tuple[tuple[int, int], ...]:
    """Every ZeRO unit of the chunks pipeline rank `pp_rank` holds (chunk c on rank c mod p, or
    the V shapes' placement)."""
    return _rank_units(w.model, w.seq_len, L.tp, L.pp, L.virtual_stages, pp_rank, L.stage_layout,
                       L.schedule)


@lru_cache(maxsize=65536)
def _rank_units(spec: ModelSpec, seq_len: int, t: int, pp: int, v: int,
                pp_rank: int, stage_layout: tuple[int, ...] | None = None,
                schedule: str = "1f1b") -> tuple[tuple[int, int], ...]:
    from tessera.planner.pipeline import head_apart, rank_chunks

    n = pp * v
    sizes = stage_layout or blocks_per_chunk(spec, n, seq_len)
    apart = head_apart(schedule, pp, v)
    return tuple(u for c in rank_chunks(schedule, pp, v, pp_rank)
                 for u in chunk_units(spec, t, n, c, sizes[c], apart))


def model_state_bytes(w: Workload, L: Layout, pp_rank: int) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes one rank of pipeline rank `pp_rank` allocates
    (every dp and tp rank of a stage holds the same): what ``ParallelModel`` builds.

    - ZeRO (stage ≥ 1, or bf16 at any stage): each unit padded to a multiple of dp, rank r
      owning 1/dp of it; compute dtype c = 2 or 4 bytes: parameters c·(shard at stage 3, else
      padded), gradients c·(shard at stage ≥ 2, else padded), optimizer fp32 (master,) m, v
      over the owned elements (the whole unit at stage 0). fp32 masters alias the parameters.
    - DDP (fp32, stage 0): 4 bytes each of parameters, gradients (the bucket buffers, which
      end with one used-flag per parameter) and Adam's m and v, plus AdamW's fp32 step count
      per parameter tensor.
    - parameter server (fp32): the server's: parameters and its pull buffer, the flat gradient
      it averages into, its push buffer and (synchronous) one inbox per worker, Adam's state.
    """
    params, grads, optimizer = _model_state(rank_units(w, L, pp_rank), w.precision, L.dp,
                                            L.zero_stage, L.dp_mode)
    return {"params": params, "grads": grads, "optimizer": optimizer}


@lru_cache(maxsize=65536)
def _model_state(units: tuple[tuple[int, int], ...], precision: str, dp: int, zero: int,
                 dp_mode: str) -> tuple[int, int, int]:
    n = sum(u for u, _ in units)
    tensors = sum(k for _, k in units)
    if dp_mode != "allreduce":
        message = n + tensors + 2
        inboxes = dp - 1 if dp_mode == "ps" else 0
        return 4 * (2 * n + 3), 4 * (n + message * (1 + inboxes)), 8 * n + 4 * tensors
    if zero == 0 and precision == "fp32":
        return 4 * n, 4 * (n + tensors), 8 * n + 4 * tensors
    c = 2 if precision == "bf16" else 4
    params = grads = optimizer = 0
    for numel, _ in units:
        padded = math.ceil(numel / dp) * dp
        shard = padded // dp
        params += c * (shard if zero >= 3 else padded)
        grads += c * (shard if zero >= 2 else padded)
        optimizer += F32 * (padded if zero == 0 else shard) * (3 if c == 2 else 2)
    return params, grads, optimizer


# ---------------------------------------------------------------------------------------------
# Activations autograd saves


def _norm_and_consumer(spec: ModelSpec, tokens: int, e: int) -> int:
    """An RMSNorm and the linear reading it: its input in fp32 (the input itself in fp32, an
    fp32 copy in bf16), 1/rms, the normalized value in the compute dtype (saved by the gain's
    multiply) and the gain's output (saved by the next linear)."""
    return tokens * (F32 * spec.hidden + F32 + 2 * e * spec.hidden)


def block_saved_bytes(spec: ModelSpec, b: int, s: int, t: int = 1, sp: bool = False,
                      recompute: str = "none", e: int = 2) -> int:
    """Bytes tessera's block saves for backward on one rank for b sequences of s tokens.

    Counted tensor by tensor (checked against ``torch.autograd.graph.saved_tensors_hooks``),
    in Korthikanti et al.'s (2022, §4.1) manner for tessera's layer: two norms with their
    consumers' inputs (replicated under TP, split by t under SP: with SP the column-parallel
    input is kept as the local s/t slice and gathered again in backward, §4.2.2); attention's
    rotated q and k, v, output and fp32 log-sum-exp (flash-style SDPA keeps no s×s scores),
    split by heads; SwiGLU's w1 and w3 outputs, SiLU's output and the product, split by t.
    RoPE saves only its tables. ``full`` recomputation keeps the block's input; ``selective``
    everything but the log-sum-exp (the attention core's inputs are checkpointed, its output
    is the output projection's input)."""
    n = b * s
    local = n // t if sp else n
    if recompute == "full":
        return e * local * spec.hidden
    h = spec.hidden
    norms = 2 * _norm_and_consumer(spec, local, e)
    attention = n * e * (2 * h // t + 2 * _kv_rows(spec, t))
    lse = 0 if recompute == "selective" else n * F32 * (spec.heads // t)
    mlp = n * 4 * e * (spec.ffn_hidden // t)
    return norms + attention + lse + mlp


def chunk_saved_bytes(spec: ModelSpec, b: int, s: int, t: int, sp: bool, e: int, *,
                      first: bool, last: bool, loss_chunk: int = 0) -> int:
    """What the first and last chunks save beyond their blocks, per micro-batch.

    First (t > 1): the vocabulary-parallel embedding's local ids (int64) and out-of-range mask
    (bool); with t = 1 the lookup saves only the input tokens, which are not activations.
    Last: the final norm and the head's input; the loss keeps an fp32 softmax of the (padded)
    local logits, the int64 targets, and under t > 1 the in-range mask, with t = 1 the
    cross-entropy's 4-byte total weight. With `loss_chunk` tokens per chunk
    (``train.loss_chunk_tokens``, ``parallel.chunked_loss``) the loss keeps a 4-byte
    log-sum-exp per token and one chunk's fp32 logits in place of the softmax."""
    n = b * s
    out = 0
    if first and t > 1:
        out += n * (INDEX + 1)
    if last:
        out += _norm_and_consumer(spec, n // t if sp else n, e)
        logits = loss_chunk * F32 * vocab_rows(spec, t) + n * F32 if loss_chunk else (
            n * F32 * vocab_rows(spec, t))
        out += logits + n * INDEX + (n if t > 1 else F32)
    return out
