"""Hugging Face Llama weights in and out: a ``config.json`` + ``model.safetensors`` directory
(``LlamaForCausalLM.save_pretrained``'s layout) <-> tessera's reference model.

The two models are the same function up to names and one permutation. Meta's Llama, and
tessera, rotate (even, odd) pairs of each head's dimensions (``apply_rope``); Hugging Face's
``rotate_half`` rotates (i, i + d/2) pairs, so its conversion script permutes the rows of wq and
wk within each head. :func:`to_hf_rows` is that permutation, :func:`from_hf_rows` its inverse.

Only plain Llama is read: no biases, SiLU, head size d_model / n_heads, and RoPE plain or with
Llama 3.1/3.2's "llama3" frequency scaling (any other rope_type is refused with a one-line error
rather than computed wrong). No network: the directory must be on disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tessera.config import ModelConfig
from tessera.errors import ConfigError, UserError


class HFError(UserError):
    """A Hugging Face directory tessera cannot read or write. One line, naming the path."""


# tessera name <- Hugging Face name, per block and for the ends.
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
END_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """wq/wk rows from (even, odd) pairs to (i, i + d/2) halves, per head: (nh·d, h)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_hf_rows`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_seq_len"}
"""Hugging Face's "llama3" RoPE parameters -> tessera's ModelConfig fields."""


def _rope_fields(raw: dict[str, Any], where: Path) -> dict[str, Any]:
    """ModelConfig's RoPE fields from config.json: `rope_parameters` (transformers >= 4.56) or
    the older `rope_scaling` + `rope_theta`. Plain RoPE and Llama 3's scaling are read; any
    other rope_type is refused rather than computed wrong."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3":
        raise HFError(f"{where}: rope_type={kind!r}: only plain RoPE and 'llama3' are supported")
    missing = [k for k in LLAMA3_KEYS if k not in rope]
    if missing:
        raise HFError(f"{where}: rope_type='llama3' without {', '.join(missing)}")
    try:
        return {"rope_theta": theta, **{ours: (int if ours == "rope_original_max_seq_len"
                                                else float)(rope[theirs])
                                         for theirs, ours in LLAMA3_KEYS.items()}}
    except (TypeError, ValueError):
        raise HFError(f"{where}: rope_type='llama3' with a non-numeric parameter: {rope}") \
            from None


def _rope_json(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's RoPE entries for `cfg`, in both spellings transformers has read."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    params = {"rope_type": "llama3", "factor": scaling.factor,
              "low_freq_factor": scaling.low_freq_factor,
              "high_freq_factor": scaling.high_freq_factor,
              "original_max_position_embeddings": scaling.original_max_seq_len}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": params,
            "rope_parameters": {**params, "rope_theta": cfg.rope_theta}}


def model_config_from_hf(raw: dict[str, Any], where: Path) -> ModelConfig:
    """A tessera ModelConfig from a Llama config.json's fields."""
    if raw.get("model_type") != "llama":
        raise HFError(f"{where}: model_type={raw.get('model_type')!r}: only 'llama' is supported")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, want) != want:
            raise HFError(f"{where}: {key}={raw[key]!r}: tessera's Llama needs {want!r}")
    try:
        cfg = ModelConfig(
            vocab_size=raw["vocab_size"], d_model=raw["hidden_size"],
            n_layers=raw["num_hidden_layers"], n_heads=raw["num_attention_heads"],
            n_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            ffn_hidden=raw["intermediate_size"], max_seq_len=raw["max_position_embeddings"],
            norm_eps=raw.get("rms_norm_eps", 1e-6), **_rope_fields(raw, where),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise HFError(f"{where}: field {e.args[0]!r} missing") from None
    except ConfigError as e:  # a value tessera's model cannot take, e.g. factor < 1
        raise HFError(f"{where}: {e}") from None
    head_dim = raw.get("head_dim") or cfg.head_dim
    if head_dim != cfg.head_dim:
        raise HFError(f"{where}: head_dim={head_dim}: tessera needs hidden_size / "
                      f"num_attention_heads = {cfg.head_dim}")
    return cfg


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A Llama config.json for `cfg` (what LlamaConfig reads)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
            **_rope_json(cfg), "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "float32"}


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor],
                  where: Path) -> dict[str, torch.Tensor]:
    """tessera's state dict (reference names) from a Llama state dict."""
    names = {ours: theirs for ours, theirs in END_NAMES.items()}
    for i in range(cfg.n_layers):
        names |= {f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}"
                  for ours, theirs in BLOCK_NAMES.items()}
    if cfg.tie_embeddings:
        names["output.weight"] = "model.embed_tokens.weight"
    out = {}
    for ours, theirs in names.items():
        if theirs not in hf:
            raise HFError(f"{where}: tensor {theirs!r} missing")
        w = hf[theirs].float()
        if ours.endswith("attention.wq.weight"):
            w = from_hf_rows(w, cfg.n_heads)
        elif ours.endswith("attention.wk.weight"):
            w = from_hf_rows(w, cfg.n_kv_heads)
        out[ours] = w.contiguous()
    return out


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Llama state dict from tessera's (reference names)."""
    out = {}
    for ours, w in state.items():
        head, _, rest = ours.partition(".")
        if head == "layers":
            i, _, name = rest.partition(".")
            theirs = f"model.layers.{i}.{BLOCK_NAMES[name]}"
            if name == "attention.wq.weight":
                w = to_hf_rows(w, cfg.n_heads)
            elif name == "attention.wk.weight":
                w = to_hf_rows(w, cfg.n_kv_heads)
        elif ours == "output.weight" and cfg.tie_embeddings:
            continue
        else:
            theirs = END_NAMES[ours]
        out[theirs] = w.detach().cpu().contiguous()
    return out


def load_hf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, tessera state dict) from a Hugging Face Llama directory on disk."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise HFError(f"{path}: no config.json (not a Hugging Face model directory)")
    cfg = model_config_from_hf(json.loads(config.read_text()), config)
    hf: dict[str, torch.Tensor] = {}
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        for shard in shards:
            hf |= load_file(str(shard))
    elif (path / "pytorch_model.bin").is_file():
        hf = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise HFError(f"{path}: no *.safetensors or pytorch_model.bin")
    return cfg, from_hf_state(cfg, hf, path)


def save_hf(cfg: ModelConfig, state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write `state` as a Hugging Face Llama directory (config.json + model.safetensors)."""
    if cfg.moe_experts:
        raise HFError(f"model.moe_experts={cfg.moe_experts}: a mixture-of-experts model has no "
                      "Llama layout to export to; use tessera checkpoint export --format torch")
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = path / "model.safetensors"
    save_file(to_hf_state(cfg, state), str(weights), metadata={"format": "pt"})
    # save_file writes a temporary file (mode 0600) and renames it into place: give the weights
    # the mode any file written here gets, as config.json has.
    os.chmod(weights, 0o666 & ~_umask())
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    return path


def _umask() -> int:
    """This process's umask: from /proc (Linux), else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
