"""Hugging Face Llama weights: a LlamaForCausalLM directory read into tessera's reference model
gives the same logits, and a tessera checkpoint exported reads back into LlamaForCausalLM with
the same logits. transformers builds a small random model locally; nothing is downloaded."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.checkpoint import load_model
from tessera.cli import app
from tessera.hf import from_hf_rows, load_hf, to_hf_rows
from tessera.model import Transformer

transformers = pytest.importorskip("transformers")

# Both models are fp32 on the CPU; they differ only in the order of floating-point sums
# (attention kernels, RoPE pairing), so logits agree to float32 rounding over a few layers.
ATOL = 1e-4


def _hf_model(tie: bool = False):
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a mis-mapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_rope_row_permutation_round_trips():
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).view(32, 3)
    assert torch.equal(from_hf_rows(to_hf_rows(w, 4), 4), w)
    # Head 0, d = 8: tessera's pair rows (0, 1) are Hugging Face's rows (0, 4).
    assert torch.equal(to_hf_rows(w, 4)[[0, 4]], w[[0, 1]])


@pytest.mark.parametrize("tie", [False, True])
def test_import_matches_llama_for_causal_lm(tmp_path, tie):
    hf = _hf_model(tie)
    hf.save_pretrained(tmp_path)
    cfg, state = load_hf(tmp_path)
    assert (cfg.n_kv_heads, cfg.ffn_hidden, cfg.tie_embeddings) == (2, 96, tie)
    ours = Transformer(cfg)
    ours.load_state_dict(state)
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=ATOL, rtol=0)


def test_export_reads_back_into_transformers(tmp_path, tiny_data):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--preset", "tiny", "--data", tiny_data, "--steps", "2", "--out", str(out),
        "--checkpoint-interval", "2", "--no-progress", "--set", "data.seq_len=16",
        "--set", "data.val_tokens=64", "--set", "train.sample_tokens=0"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["export-hf", "--checkpoint", str(out), "--out",
                                      str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    _, state, _ = load_model(out)
    cfg, _ = load_hf(tmp_path / "hf")
    ours = Transformer(cfg)
    ours.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=ATOL, rtol=0)
    # ... and generate reads the exported directory directly.
    result = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path / "hf"),
                                      "--prompt", "def ", "--tokens", "5"])
    assert result.exit_code == 0 and result.output.startswith("def "), result.output


def test_unsupported_llama_refused(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    raw.pop("rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    line = cli_error(["generate", "--checkpoint", str(tmp_path)])
    assert "rope_type='llama3': only plain RoPE is supported" in line
