"""Hugging Face Llama weights: a LlamaForCausalLM directory read into tessera's reference model
gives the same logits, and a tessera checkpoint exported reads back into LlamaForCausalLM with
the same logits. transformers builds a small random model locally; nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.checkpoint import load_model
from tessera.cli import app
from tessera.config import ModelConfig
from tessera.config_io import make_config
from tessera.hf import from_hf_rows, hf_config, load_hf, model_config_from_hf, to_hf_rows
from tessera.metrics import read_metrics
from tessera.model import Transformer
from tessera.testing import assert_close_summed

transformers = pytest.importorskip("transformers")

# Llama 3's scaling at a size where every branch of it acts on a head of 16 dimensions (theta
# 10000, wavelengths 2π·10000^(i/8)): with an original context of 64, wavelength 6.3 is kept,
# 20 and 63 are blended, 199 and longer are divided by the factor.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, cfg: ModelConfig,
                        msg: str) -> None:
    """The two fp32 models compute the same function with their sums in other orders: per
    layer the contractions over the hidden size (projections), the MLP's inner size (down
    projection) and the T positions (attention, and the RoPE angle p·f that transformers
    forms in float32 where tessera uses float64), then the LM head over the hidden size. So
    the logits agree to the summation bound over those terms, on the logits' scale."""
    T = ours.shape[1]
    terms = cfg.n_layers * (cfg.d_model + cfg.ffn_hidden + T) + cfg.d_model
    assert_close_summed(ours, theirs, terms=terms, msg=msg)


def _hf_model(tie: bool = False, vocab: int = 100, rope_scaling: dict | None = None,
              sharp: bool = False):
    extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a mis-mapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if sharp and ("q_proj" in name or "k_proj" in name):
                # Attention scores far from uniform, so the positions RoPE encodes matter.
                p.mul_(20)
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
        assert_logits_close(ours(tokens), hf(tokens).logits, cfg, "imported logits")


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
        assert_logits_close(hf(tokens).logits, ours(tokens), cfg, "exported logits")
    # ... and generate reads the exported directory directly.
    result = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path / "hf"),
                                      "--prompt", "def ", "--tokens", "5"])
    assert result.exit_code == 0 and result.output.startswith("def "), result.output
    # Every exported file is readable as any file written here is (umask 022 here: 0644).
    result = CliRunner().invoke(app, ["checkpoint", "export", str(out), "--to",
                                      str(tmp_path / "pt"), "--format", "torch"])
    assert result.exit_code == 0, result.output
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    for f in ("hf/model.safetensors", "hf/config.json", "pt/model.pt", "pt/model.json"):
        assert oct((tmp_path / f).stat().st_mode & 0o777) == oct(0o666 & ~mask), f


def test_llama3_rope_scaling_matches_llama_for_causal_lm(tmp_path):
    hf = _hf_model(rope_scaling=LLAMA3, sharp=True)
    hf.save_pretrained(tmp_path / "in")
    cfg, state = load_hf(tmp_path / "in")
    assert cfg.rope_scaling is not None
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.original_max_seq_len) == (8.0, 64)
    ours = Transformer(cfg)
    ours.load_state_dict(state)
    tokens = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        assert_logits_close(ours(tokens), want, cfg, "llama3-scaled logits")
        # The scaling is visible at this size: plain RoPE misses by far more than the bound.
        plain = Transformer(ModelConfig(**{**cfg.__dict__, "rope_scaling_factor": None}))
        plain.load_state_dict(state)
        with pytest.raises(AssertionError, match="llama3 off"):
            assert_logits_close(plain(tokens), want, cfg, "llama3 off")
    # ... and out again: config.json names the scaling, transformers reads the same model.
    from tessera.hf import save_hf

    save_hf(cfg, state, tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert model_config_from_hf(raw, tmp_path) == cfg
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert_logits_close(back(tokens).logits, want, cfg, "exported llama3 logits")


def test_llama_1b_preset_has_llama_3_2_rope_scaling():
    cfg = make_config("llama-1b").model
    rope = hf_config(cfg)["rope_scaling"]
    assert rope == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert cfg.rope_theta == 500000.0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_imported_weights_first_step_loss_at_dp1_tp2_pp2(tmp_path, tiny_data):
    """A Llama-3-scaled model imported from a Hugging Face directory and trained at
    (dp, tp, pp) = (1, 2, 2) on 4 launched ranks has the first-step loss of one process."""
    # Scaling that moves every frequency but the fastest (original context 16, factor 32), so
    # a rank that built plain RoPE tables would be far off.
    hf = _hf_model(vocab=256, rope_scaling={**LLAMA3, "factor": 32.0,
                                            "original_max_position_embeddings": 16}, sharp=True)
    hf.save_pretrained(tmp_path / "hf")
    common = ["--preset", "tiny", "--data", tiny_data, "--init-from", str(tmp_path / "hf"),
              "--steps", "1", "--microbatches", "2", "--micro-batch-size", "4", "--no-progress",
              "--set", "data.val_tokens=256", "--set", "train.sample_tokens=0"]
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", *common, "--nproc", "4",
                           "--tp", "2", "--pp", "2", "--out", str(tmp_path / "grid")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp=1" in proc.stdout and "tp=2" in proc.stdout and "pp=2" in proc.stdout
    one = CliRunner().invoke(app, ["train", *common, "--out", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output

    def first(run: str) -> dict:
        return next(r for r in read_metrics(tmp_path / run / "metrics.jsonl") if r["step"] == 1)

    cfg, _ = load_hf(tmp_path / "hf")
    seq = make_config("tiny").data.seq_len
    # The same weights and windows; tp splits the contractions over heads and the MLP's inner
    # size across ranks, and the mean over the batch's 2 x 4 x seq tokens and the softmax over
    # the vocabulary are summed in other orders.
    terms = 2 * 4 * seq + cfg.vocab_size + cfg.n_layers * (cfg.d_model + cfg.ffn_hidden + seq)
    assert_close_summed(first("grid")["loss"], first("one")["loss"], terms=terms,
                        msg="first-step loss")


def test_unsupported_llama_refused(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}
    raw.pop("rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    line = cli_error(["generate", "--checkpoint", str(tmp_path)])
    assert "rope_type='yarn': only plain RoPE and 'llama3' are supported" in line
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    line = cli_error(["generate", "--checkpoint", str(tmp_path)])
    assert "rope_type='llama3' without low_freq_factor, high_freq_factor" in line


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_files_get_the_mode_of_a_normal_write(tmp_path, umask):
    # safetensors writes a temporary file (0600) and renames it; the export gives it the mode
    # the umask gives any new file, as config.json and --format torch's files have.
    import os

    from tessera.hf import save_hf

    cfg = make_config("tiny").model
    state = Transformer(cfg).state_dict()
    old = os.umask(umask)
    try:
        save_hf(cfg, state, tmp_path / "hf")
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert oct((tmp_path / "hf" / name).stat().st_mode & 0o777) == oct(0o666 & ~umask), name
