"""Named configurations: each a partial config (sections of fields) that ``make_config``
starts from, before a config file, keyword sections and ``--set`` overrides."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # For tests: a few thousand parameters, runs in milliseconds.
    "tiny": {
        "model": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
        "data": dict(seq_len=32, val_tokens=4096),
        "train": dict(steps=30, micro_batch_size=8, lr=3e-3, warmup_steps=3, eval_interval=0,
                      log_interval=5, sample_tokens=32),
    },
    # The main job: 2 CPU ranks, under five minutes, below 2 nats/byte on the stdlib corpus.
    "demo": {
        "model": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=256),
        "data": dict(seq_len=128, val_tokens=65536),
        "parallel": dict(dp=2),
        "train": dict(steps=400, micro_batch_size=16, lr=3e-3, warmup_steps=30,
                      eval_interval=100, log_interval=25, sample_tokens=300),
    },
    # GPT-2 small's shape in Llama form; SwiGLU inner size 2048 keeps its 124M parameters.
    "gpt2-124m": {
        "model": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, ffn_hidden=2048,
                      max_seq_len=1024, tie_embeddings=True),
        "data": dict(seq_len=1024),
        "train": dict(lr=6e-4, warmup_steps=700, steps=20000),
    },
    # Llama 3.2 1B.
    "llama-1b": {
        "model": dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_hidden=8192, max_seq_len=8192, rope_theta=500000.0,
                      rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_seq_len=8192,
                      tie_embeddings=True),
        "data": dict(seq_len=2048),
        "train": dict(lr=3e-4, warmup_steps=2000, steps=100000),
    },
    # The demo model with 16 fine-grained experts of a quarter of its MLP width, top-4
    # (DeepSeekMoE, OLMoE): the same active parameters per token as "demo" (4 x 128 = 512
    # SwiGLU units), 4x its MLP parameters; experts split over the two ranks (ep 2).
    "moe-demo": {
        "model": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=256,
                      moe_experts=16, moe_top_k=4, moe_ffn_hidden=128, moe_aux_loss_coef=0.01),
        "data": dict(seq_len=128, val_tokens=65536),
        "parallel": dict(dp=2, ep=2),
        "train": dict(steps=400, micro_batch_size=16, lr=3e-3, warmup_steps=30,
                      eval_interval=100, log_interval=25, sample_tokens=300),
    },
    # Mixtral 8x7B (Jiang et al. 2024): 8 experts, top-2, every layer (for the planner).
    "mixtral-8x7b": {
        "model": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_hidden=14336, max_seq_len=32768, rope_theta=1e6, moe_experts=8,
                      moe_top_k=2, moe_capacity_factor=0.0, moe_aux_loss_coef=0.02),
        "data": dict(seq_len=4096),
        "train": dict(lr=3e-4, warmup_steps=2000, steps=100000),
    },
    # OLMoE-1B-7B (Muennighoff et al. 2024): 64 experts of width 1024, top-8, z-loss.
    "olmoe-1b-7b": {
        "model": dict(vocab_size=50304, d_model=2048, n_layers=16, n_heads=16,
                      ffn_hidden=1024, max_seq_len=4096, moe_experts=64, moe_top_k=8,
                      moe_ffn_hidden=1024, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001),
        "data": dict(seq_len=4096),
        "train": dict(lr=4e-4, warmup_steps=2000, steps=100000),
    },
}
