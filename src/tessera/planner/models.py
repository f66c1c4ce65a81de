"""The models the planner knows: a shape description and a catalog of published models.

:class:`ModelSpec` describes a decoder-only transformer by what its cost depends on: hidden
size h, layers l, query heads a and key/value heads (grouped-query attention), the MLP's inner
size and kind (GeLU with two matrices, as in GPT; SwiGLU with three, as in Llama), vocabulary
V, whether there are biases, learned position embeddings, tied input/output embeddings and
dropout (dropout masks are activations to store).

The catalog holds

- the tessera presets (``tiny``, ``demo``, ``gpt2-124m``, ``llama-1b``: ``tessera.config``);
- the GPT-3 family (Brown et al. 2020, Table 2.1, vocabulary 50,257, context 2048). Two rows
  are inconsistent as printed: XL's 24 heads of 128 do not make its d_model 2048 (we use 16
  heads of 128) and 13B's d_model 5140 is not 40 heads of 128 (we use 5120);
- the weak-scaling models of Megatron-LM (Narayanan et al. 2021, Table 1) with the layouts
  they were run with (micro-batch sizes and virtual stages from the paper's
  ``examples/sc21/run_table_1.sh``) and the throughput they reported;
- the 161B GPT of the paper's Figure 13 and the 5.9B GPT of Figures 14-15;
- Llama 3 8B, 70B, 405B (Grattafiori et al. 2024, Table 3).

Any other model comes from a TOML/YAML file, either in ModelSpec's field names or as a tessera
config file (its ``model`` section, or a ``preset``).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import yaml

from tessera.config import ModelConfig
from tessera.config_io import load_yaml, make_config
from tessera.errors import ConfigError
from tessera.presets import PRESETS


@dataclass(frozen=True, kw_only=True)
class MoEBlocks:
    """The mixture-of-experts blocks of an active model (``planner.moe.active_spec``): what its
    uniform dense blocks leave out, for the costs that differ by block kind."""

    every: int
    """Blocks every−1, 2·every−1, ... are MoE (``ModelConfig.is_moe_layer``)."""
    experts: int
    """E: the router's outputs, a GEMM of 2·E·h FLOPs per token forward."""
    dense_ffn: int
    """The dense blocks' MLP inner size f."""
    moe_ffn: int
    """The MLP width one token uses in an MoE block: k·f_e, plus the shared expert's f."""
    whole_tp: int = 1
    """The tensor-parallel degree whose ranks each hold every MoE block whole, without a
    tensor-parallel collective for its MLP (``planner.moe.moe_tp``); 1: split over tp like a
    dense MLP."""
    top_k: int = 1
    shared: bool = False
    """A shared expert every token goes through."""
    capacity: bool = False
    """A capacity factor drops assignments (0: dropless)."""
    aux_losses: bool = True
    """The auxiliary losses enter the backward (a load-balancing or z-loss coefficient > 0)."""
    router_bias: bool = False
    """DeepSeek-V3's balancing bias selects the experts."""
    ep: int = 1
    """Expert-parallel degree: each rank holds experts/ep of every MoE block. These six set an
    eager MoE block's kernels (``kernels.eager_moe_block``)."""

    def count(self, start: int, n: int) -> int:
        """MoE blocks among blocks start, ..., start + n − 1."""
        return (start + n) // self.every - start // self.every


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape."""

    name: str
    hidden: int
    """Hidden size h."""
    layers: int
    """Transformer blocks l."""
    heads: int
    """Query heads a; head size h/a."""
    vocab_size: int
    """Vocabulary V."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means `heads`."""
    ffn_hidden: int | None = None
    """MLP inner size; None means 4h."""
    mlp: str = "gelu"
    """'gelu' (two matrices, GPT) or 'swiglu' (three matrices, Llama)."""
    bias: bool = True
    """Linear layers carry biases (GPT) or not (Llama)."""
    norm: str = "layernorm"
    """'layernorm' (gain and bias) or 'rmsnorm' (gain only)."""
    learned_positions: bool = True
    """Learned position embeddings of max_seq_len x h (GPT); False for RoPE."""
    max_seq_len: int = 2048
    """Longest sequence; also the default sequence length of a plan."""
    tied_embeddings: bool = True
    """The LM head shares the input embedding matrix."""
    dropout: bool = True
    """Dropout layers (their masks are stored for backward)."""
    moe: MoEBlocks | None = None
    """An active model's MoE blocks (set by ``planner.moe.active_spec``, never read from a
    model file); None for a dense model."""

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "vocab_size", "max_seq_len"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"model.{f}", v, "must be a positive integer")
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.hidden % self.heads:
            raise ConfigError("model.hidden", self.hidden, f"must be divisible by heads="
                              f"{self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError("model.kv_heads", self.kv_heads, f"must divide heads={self.heads}")
        if self.mlp not in ("gelu", "swiglu"):
            raise ConfigError("model.mlp", self.mlp, "must be gelu or swiglu")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError("model.norm", self.norm, "must be layernorm or rmsnorm")

    # -- shape ----------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @cached_property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: kv_heads · head size."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    # -- parameter counts -----------------------------------------------------------------------
    @cached_property
    def layer_matmul_params(self) -> int:
        """Weights of one block's matrix multiplies: Q, K, V, output projection and the MLP."""
        h, f = self.hidden, self.ffn_hidden
        return h * (h + 2 * self.kv_dim) + h * h + self.mlp_matrices * h * f

    @cached_property
    def layer_params(self) -> int:
        """All parameters of one block: matrices, biases and the two norms."""
        h, f = self.hidden, self.ffn_hidden
        bias = (h + 2 * self.kv_dim) + h + (self.mlp_matrices - 1) * f + h if self.bias else 0
        norms = 2 * (2 * h if self.norm == "layernorm" else h)
        return self.layer_matmul_params + bias + norms

    @cached_property
    def moe_blocks(self) -> int:
        """Blocks that are MoE (``moe``); 0 for a dense model."""
        return self.moe.count(0, self.layers) if self.moe else 0

    @cached_property
    def model_matmul_params(self) -> int:
        """Weights one token's matrix multiplies use in all blocks: layers · layer_matmul_params,
        or for an active model the model's own (dense blocks' MLPs of f, MoE blocks' k·f_e +
        shared and the router's E·h), not the per-rank width ``active_spec`` prices."""
        if self.moe is None:
            return self.layers * self.layer_matmul_params
        h, m, n_moe = self.hidden, self.moe, self.moe_blocks
        attention = self.layer_matmul_params - self.mlp_matrices * h * self.ffn_hidden
        return (self.layers * attention
                + (self.layers - n_moe) * self.mlp_matrices * h * m.dense_ffn
                + n_moe * (self.mlp_matrices * h * m.moe_ffn + m.experts * h))

    @cached_property
    def embedding_params(self) -> int:
        """Token embedding, plus learned positions when the model has them."""
        return self.vocab_size * self.hidden + (
            self.max_seq_len * self.hidden if self.learned_positions else 0)

    @cached_property
    def head_params(self) -> int:
        """The LM head's own weights (0 when tied to the embedding) and the final norm."""
        norm = 2 * self.hidden if self.norm == "layernorm" else self.hidden
        return norm + (0 if self.tied_embeddings else self.vocab_size * self.hidden)

    @cached_property
    def param_count(self) -> int:
        """Total parameters N (each tied matrix counted once)."""
        return self.layers * self.layer_params + self.embedding_params + self.head_params


def gpt(name: str, hidden: int, layers: int, heads: int, vocab_size: int = 51200,
        max_seq_len: int = 2048) -> ModelSpec:
    """A GPT-2/3-style model as in Megatron-LM: LayerNorm, biases, GeLU 4h MLP, learned
    positions, tied embeddings, dropout."""
    return ModelSpec(name=name, hidden=hidden, layers=layers, heads=heads, vocab_size=vocab_size,
                     max_seq_len=max_seq_len)


def from_model_config(name: str, cfg: ModelConfig, seq_len: int | None = None) -> ModelSpec:
    """The spec of tessera's own Llama-style model (RMSNorm, RoPE, SwiGLU, GQA, no bias)."""
    return ModelSpec(name=name, hidden=cfg.d_model, layers=cfg.n_layers, heads=cfg.n_heads,
                     kv_heads=cfg.n_kv_heads, ffn_hidden=cfg.ffn_hidden, mlp="swiglu",
                     bias=False, norm="rmsnorm", learned_positions=False,
                     max_seq_len=seq_len or cfg.max_seq_len, tied_embeddings=cfg.tie_embeddings,
                     vocab_size=cfg.vocab_size, dropout=False)


@lru_cache(maxsize=64)
def model_config(spec: ModelSpec, seq_len: int = 1) -> ModelConfig | None:
    """`spec` as a tessera ModelConfig, or None if tessera's transformer cannot express it.

    RoPE tables cover max(spec.max_seq_len, seq_len): a catalog preset's max_seq_len is its
    default training length, shorter than what its tessera config allows."""
    if (spec.mlp != "swiglu" or spec.bias or spec.norm != "rmsnorm" or spec.learned_positions
            or spec.dropout or spec.head_dim % 2):
        return None
    return ModelConfig(vocab_size=spec.vocab_size, d_model=spec.hidden, n_layers=spec.layers,
                       n_heads=spec.heads, n_kv_heads=spec.kv_heads, ffn_hidden=spec.ffn_hidden,
                       max_seq_len=max(spec.max_seq_len, seq_len),
                       tie_embeddings=spec.tied_embeddings)


def expressible(spec: ModelSpec) -> bool:
    """Whether tessera's reference transformer has `spec`'s shape (:func:`model_config`)."""
    return model_config(spec) is not None
def llama3(name: str, hidden: int, layers: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(name=name, hidden=hidden, layers=layers, heads=heads, kv_heads=8,
                     ffn_hidden=ffn, mlp="swiglu", bias=False, norm="rmsnorm",
                     learned_positions=False, max_seq_len=8192, tied_embeddings=False,
                     vocab_size=128256, dropout=False)


@dataclass(frozen=True)
class WeakScalingRow:
    """One row of Megatron-LM's Table 1 (Narayanan et al. 2021): model, layout, result."""

    model: ModelSpec
    billions: float
    """Parameters in billions as printed."""
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    virtual_stages: int
    tflops_per_gpu: float
    """Achieved TFLOP/s per GPU as printed (counted with eq. 3, full recomputation)."""


def _row(billions: float, a: int, h: int, l_: int, t: int, p: int, n: int, batch: int,
         mbs: int, v: int, tflops: float) -> WeakScalingRow:
    name = f"megatron-{billions:g}b" if billions < 1000 else "megatron-1t"
    return WeakScalingRow(gpt(name, h, l_, a), billions, t, p, n, batch, mbs, v, tflops)


# Table 1 of Narayanan et al. 2021 (sequence 2048, vocabulary 51,200, A100 80GB, full
# recomputation); micro-batch sizes and layers per virtual stage from run_table_1.sh.
MEGATRON_WEAK_SCALING: tuple[WeakScalingRow, ...] = (
    _row(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    _row(3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    _row(7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    _row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    _row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    _row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    _row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    _row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    _row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    _row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
)


@dataclass(frozen=True)
class IterationTimeRow:
    """A published training run's layout and seconds per iteration (sequence 2048, micro-batch
    1, 1F1B, sequence parallelism and selective recomputation, no flash attention)."""

    model: ModelSpec
    tp: int
    pp: int
    gpus: int
    global_batch: int
    seconds: float


# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
# arXiv:2205.05198), Table 3 (a, h, l, t, p, GPUs, global batch) and Table 5 (seconds per
# iteration with sequence parallelism and selective recomputation), A100 80GB; Megatron-LM of
# 2022 overlaps the backward's tensor-parallel collectives with the GEMMs
# (Workload.tp_async_backward). The seconds are not checked against the paper's text; they
# are cross-checked against the MFU the Megatron-LM README states for the same
# configurations "measured using a data parallel size of one" (22B 41.5%, 175B 51.4%, 530B
# 56.0%, 1T 56.3%; README section on scaling, which cites this paper): model FLOPs (Narayanan
# et al. eq. 3 without recomputation) / (GPUs · 312 TFLOP/s · seconds) reproduces each within
# 0.2 points (tests/test_planner_scale.py). The paper's abstract (verified) gives 54.2% MFU
# for 530B on 2240 GPUs, i.e. with data parallelism, a different run.
KORTHIKANTI_RUNS: tuple[IterationTimeRow, ...] = tuple(
    IterationTimeRow(gpt(f"gpt-{name}", h, l_, a), t, p, n, batch, seconds)
    for name, a, h, l_, t, p, n, batch, seconds in (
        ("22B", 64, 6144, 48, 8, 1, 8, 4, 1.10),
        ("175B", 96, 12288, 96, 8, 8, 64, 64, 13.75),
        ("530B", 128, 20480, 105, 8, 35, 280, 280, 37.83),
        ("1T", 160, 25600, 128, 8, 64, 512, 512, 71.49)))


def _catalog() -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    for name in PRESETS:
        cfg = make_config(name)
        out[name] = from_model_config(name, cfg.model, cfg.data.seq_len)
    for name, l_, h, a in (("gpt3-125m", 12, 768, 12), ("gpt3-350m", 24, 1024, 16),
                           ("gpt3-760m", 24, 1536, 16), ("gpt3-1.3b", 24, 2048, 16),
                           ("gpt3-2.7b", 32, 2560, 32), ("gpt3-6.7b", 32, 4096, 32),
                           ("gpt3-13b", 40, 5120, 40), ("gpt3-175b", 96, 12288, 96)):
        out[name] = gpt(name, h, l_, a, vocab_size=50257)
    for row in MEGATRON_WEAK_SCALING:
        out[row.model.name] = row.model
    out["gpt-161b"] = gpt("gpt-161b", 20480, 32, 128)
    out["gpt-5.9b"] = gpt("gpt-5.9b", 3840, 32, 32)
    # Lamy-Poirier 2022 (breadth-first pipeline parallelism): its 52B and 6.6B GPTs
    out["gpt-52b"] = gpt("gpt-52b", 8192, 64, 64)
    out["gpt-6.6b"] = gpt("gpt-6.6b", 4096, 32, 32)
    out["llama3-8b"] = llama3("llama3-8b", 4096, 32, 32, 14336)
    out["llama3-70b"] = llama3("llama3-70b", 8192, 80, 64, 28672)
    out["llama3-405b"] = llama3("llama3-405b", 16384, 126, 128, 53248)
    return out


CATALOG: dict[str, ModelSpec] = _catalog()


def known_models() -> list[str]:
    return list(CATALOG)


def load_model(name_or_file: str | Path) -> ModelSpec:
    """A catalog model by name (case-insensitive), or a model from a TOML/YAML file."""
    text = str(name_or_file)
    by_lower = {k.lower(): v for k, v in CATALOG.items()}
    if text.lower() in by_lower:
        return by_lower[text.lower()]
    path = Path(text)
    if not path.is_file():
        raise ConfigError("--model", text, f"unknown model and not a file; known: "
                          f"{', '.join(known_models())}")
    return model_from_file(path)


def model_from_file(path: Path) -> ModelSpec:
    """A ModelSpec table (optionally under [model]) or a tessera config file."""
    try:
        raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else load_yaml(
            path.read_text())
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError("--model", str(path), f"cannot be parsed: {e}".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise ConfigError("--model", str(path), "must hold a table of fields")
    spec_fields = {f.name for f in fields(ModelSpec)} - {"moe"}
    table: Any = raw.get("model", raw)
    if isinstance(table, dict) and "hidden" in table and set(table) <= spec_fields:
        table = dict(table)
        table.setdefault("name", path.stem)
        try:
            return ModelSpec(**table)
        except TypeError as e:
            raise ConfigError("--model", str(path), str(e).split(": ", 1)[-1]) from None
    cfg = make_config(None, path)
    return from_model_config(path.stem, cfg.model, cfg.data.seq_len)
