"""Every configuration rule raises ConfigError naming the field, the value and the rule."""

from __future__ import annotations

import pytest

from tessera.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from tessera.config_io import make_config
from tessera.config_warnings import config_warnings
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.presets import PRESETS

# (section class, kwargs, field named in the message, a fragment of the rule)
FIELD_RULES = [
    (ModelConfig, dict(d_model=0), "model.d_model", "positive integer"),
    (ModelConfig, dict(n_layers=-1), "model.n_layers", "positive integer"),
    (ModelConfig, dict(vocab_size=0), "model.vocab_size", "positive integer"),
    (ModelConfig, dict(d_model=64, n_heads=3), "model.d_model", "divisible by model.n_heads=3"),
    (ModelConfig, dict(n_heads=4, n_kv_heads=3), "model.n_kv_heads", "must divide"),
    (ModelConfig, dict(d_model=12, n_heads=4), "model.d_model", "must be even"),
    (ModelConfig, dict(rope_theta=0), "model.rope_theta", "> 0"),
    (ModelConfig, dict(norm_eps=0), "model.norm_eps", "> 0"),
    (ModelConfig, dict(init_std=-1), "model.init_std", "> 0"),
    (ModelConfig, dict(ffn_hidden=0), "model.ffn_hidden", "positive integer"),
    (ModelConfig, dict(max_seq_len=0), "model.max_seq_len", "positive integer"),
    (ParallelConfig, dict(dp=0), "parallel.dp", "positive integer"),
    (ParallelConfig, dict(tp=0), "parallel.tp", "positive integer"),
    (ParallelConfig, dict(zero_stage=4), "parallel.zero_stage", "0, 1, 2 or 3"),
    (ParallelConfig, dict(dp_mode="gossip"), "parallel.dp_mode", "allreduce, ps"),
    (ParallelConfig, dict(schedule="zigzag"), "parallel.schedule", "gpipe"),
    (ParallelConfig, dict(bucket_mb=0), "parallel.bucket_mb", "> 0"),
    (ParallelConfig, dict(allreduce_algorithm="x"), "parallel.allreduce_algorithm", "ring"),
    (ParallelConfig, dict(recompute="some"), "parallel.recompute", "selective"),
    (ParallelConfig, dict(max_staleness=0), "parallel.max_staleness", "positive integer"),
    (ParallelConfig, dict(microbatch_group=-1), "parallel.microbatch_group", "non-negative"),
    (DataConfig, dict(seq_len=0), "data.seq_len", "positive integer"),
    (DataConfig, dict(val_tokens=0), "data.val_tokens", "positive integer"),
    (DataConfig, dict(path=""), "data.path", "empty"),
    (TrainConfig, dict(steps=0), "train.steps", "positive integer"),
    (TrainConfig, dict(micro_batch_size=0), "train.micro_batch_size", "positive integer"),
    (TrainConfig, dict(grad_accum=0), "train.grad_accum", "positive integer"),
    (TrainConfig, dict(lr=0), "train.lr", "> 0"),
    (TrainConfig, dict(min_lr_ratio=2), "train.min_lr_ratio", "[0, 1]"),
    (TrainConfig, dict(warmup_steps=-1), "train.warmup_steps", ">= 0"),
    (TrainConfig, dict(weight_decay=-1), "train.weight_decay", ">= 0"),
    (TrainConfig, dict(beta1=1.0), "train.beta1", "[0, 1)"),
    (TrainConfig, dict(beta2=-0.1), "train.beta2", "[0, 1)"),
    (TrainConfig, dict(grad_clip=-1), "train.grad_clip", ">= 0"),
    (TrainConfig, dict(precision="fp8"), "train.precision", "fp32 or bf16"),
    (TrainConfig, dict(eval_interval=-1), "train.eval_interval", ">= 0"),
    (TrainConfig, dict(log_interval=0), "train.log_interval", ">= 1"),
    (TrainConfig, dict(sample_tokens=-1), "train.sample_tokens", ">= 0"),
    (TrainConfig, dict(peak_tflops=0), "train.peak_tflops", "> 0"),
]


@pytest.mark.parametrize("cls, kwargs, field_name, rule", FIELD_RULES)
def test_field_rule(cls, kwargs, field_name, rule):
    with pytest.raises(ConfigError) as e:
        cls(**kwargs)
    msg = str(e.value)
    assert msg.startswith(f"{field_name}="), msg
    assert rule in msg
    assert "\n" not in msg


def _cfg(model=None, parallel=None, data=None, train=None) -> Config:
    return Config(model=ModelConfig(**(model or {})), parallel=ParallelConfig(**(parallel or {})),
                  data=DataConfig(**(data or {})), train=TrainConfig(**(train or {})))


CROSS_RULES = [
    # Inside the parallel section.
    (dict(parallel=dict(dp=4, ep=3)), None, "parallel.ep=3", "divide parallel.dp=4"),
    (dict(parallel=dict(dp=2, zero_stage=1, dp_mode="ps")), None, "parallel.zero_stage=1",
     "allreduce"),
    (dict(parallel=dict(dp=1, dp_mode="ps")), None, "parallel.dp_mode='ps'", "dp >= 2"),
    (dict(parallel=dict(virtual_stages=2, schedule="1f1b")), None, "parallel.virtual_stages=2",
     "needs schedule interleaved"),
    (dict(parallel=dict(pp=2, microbatch_group=3)), None, "parallel.microbatch_group=3",
     "needs schedule interleaved"),
    # Between sections.
    (dict(parallel=dict(dp=2, tp=2)), 2, "parallel=", "must equal the world size 2"),
    (dict(model=dict(n_heads=4, d_model=64), parallel=dict(tp=3)), None, "parallel.tp=3",
     "must divide model.n_heads=4"),
    (dict(model=dict(n_heads=6, n_kv_heads=6, d_model=96), parallel=dict(tp=3)), None,
     "parallel.tp=3", "model.ffn_hidden=256"),
    (dict(model=dict(n_heads=12, n_kv_heads=4, d_model=96, ffn_hidden=96),
          parallel=dict(tp=6)), None, "parallel.tp=6", "model.n_kv_heads=4"),
    (dict(parallel=dict(tp=2, sequence_parallel=True), data=dict(seq_len=33),
          model=dict(max_seq_len=64)), None, "data.seq_len=33", "parallel.tp=2"),
    (dict(parallel=dict(cp=2), data=dict(seq_len=33), model=dict(max_seq_len=64)), None,
     "data.seq_len=33", "parallel.cp=2"),
    (dict(model=dict(n_layers=2), parallel=dict(pp=4)), None, "parallel.pp=4",
     "exceed model.n_layers=2"),
    (dict(model=dict(max_seq_len=16), data=dict(seq_len=32)), None, "data.seq_len=32",
     "model.max_seq_len=16"),
    (dict(model=dict(n_layers=8), parallel=dict(pp=2, schedule="interleaved", virtual_stages=2),
          train=dict(grad_accum=3)), None, "train.grad_accum=3", "multiple of parallel.pp=2"),
    (dict(model=dict(n_layers=8), parallel=dict(pp=2, schedule="interleaved", virtual_stages=2,
                                                 microbatch_group=3),
          train=dict(grad_accum=4)), None, "train.grad_accum=4",
     "multiple of parallel.microbatch_group=3"),
    (dict(model=dict(n_layers=8), parallel=dict(pp=4, schedule="interleaved", virtual_stages=2,
                                                 microbatch_group=2),
          train=dict(grad_accum=8)), None, "parallel.microbatch_group=2", "at least pp=4"),
    # Before: accepted silently, and run as plain 1F1B.
    (dict(model=dict(n_layers=8), parallel=dict(pp=2, schedule="interleaved"),
          train=dict(grad_accum=4)), None, "parallel.virtual_stages=1", "virtual_stages >= 2"),
]


def test_warnings_for_legal_but_unlikely_settings():
    # Before: one micro-batch under pp=2 and a warm-up longer than the run said nothing.
    cfg = _cfg(model=dict(n_layers=4), parallel=dict(pp=2), train=dict(steps=5, warmup_steps=9))
    pipeline, warmup = config_warnings(cfg)
    assert pipeline.startswith("train.grad_accum=1 micro-batches with parallel.pp=2: pipeline "
                               "ranks idle about 50% of each step; use --microbatches 8")
    assert warmup == "train.warmup_steps=9 > train.steps=5: the learning rate never reaches " \
                     "train.lr=0.003"
    assert config_warnings(_cfg(parallel=dict(pp=2), train=dict(grad_accum=2))) == []


@pytest.mark.parametrize("sections, world, field_name, rule", CROSS_RULES)
def test_cross_rule(sections, world, field_name, rule):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(**sections), world)
    assert str(e.value).startswith(field_name), str(e.value)
    assert rule in str(e.value)


def test_valid_layouts_pass():
    validate(_cfg(model=dict(n_heads=8, n_kv_heads=2, d_model=64), parallel=dict(dp=2, tp=4)), 8)
    validate(_cfg(model=dict(n_layers=4), parallel=dict(pp=2, dp=2)), 4)


def test_presets_build_and_validate():
    for name, preset in PRESETS.items():
        cfg = make_config(name)
        validate(cfg, cfg.parallel.world_size)
        assert cfg.model.d_model == preset["model"]["d_model"]


def test_unknown_preset_lists_known():
    with pytest.raises(ConfigError, match="preset='nope': unknown; known: tiny, demo"):
        make_config("nope")


def test_file_then_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\n[model]\nd_model = 32\n[train]\nlr = 0.01\n')
    cfg = make_config(None, toml, ["train.lr=2e-3", "model.tie_embeddings=true"])
    assert (cfg.model.d_model, cfg.model.n_layers) == (32, 2)  # file over preset
    assert cfg.train.lr == 2e-3 and cfg.model.tie_embeddings is True  # --set over file
    yml = tmp_path / "run.yaml"
    yml.write_text("model:\n  n_layers: 3\n")
    assert make_config("tiny", yml).model.n_layers == 3


def test_yaml_exponent_floats(tmp_path):
    # Before: `train.lr='1e-3': must be of type float` (YAML 1.1 wants `1.0e-3`).
    yml = tmp_path / "run.yaml"
    yml.write_text("train:\n  lr: 1e-3\n  weight_decay: 5E-2\n  steps: 7\n")
    cfg = make_config("tiny", yml)
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.steps) == (1e-3, 5e-2, 7)


def test_explicit_preset_beats_the_files(tmp_path):
    # Before: the file's `preset = "demo"` won over --preset tiny.
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "demo"\n[train]\nsteps = 5\n')
    assert make_config("tiny", toml).model.d_model == PRESETS["tiny"]["model"]["d_model"]
    assert make_config(None, toml).model.d_model == PRESETS["demo"]["model"]["d_model"]


@pytest.mark.parametrize("override, match", [
    ("train.lr", "section.field=value"),
    ("nosuch.lr=1", "unknown section"),
    ("train.lrr=1", "train.lrr=1: unknown field"),
    ("train.steps=ten", "train.steps='ten': must be of type int"),
    ("model.tie_embeddings=3", "must be true or false"),
])
def test_bad_overrides(override, match):
    with pytest.raises(ConfigError, match=match):
        make_config("tiny", overrides=[override])


def test_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="file does not exist"):
        make_config("tiny", tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        make_config("tiny", bad)


def test_defaults_derived():
    m = ModelConfig(d_model=192, n_heads=6)
    assert m.n_kv_heads == 6
    assert m.ffn_hidden == 512  # Llama: 2/3 * 4 * 192 = 512, already a multiple of 32


def test_python_floor_has_tomllib():
    # Before: pyproject said >= 3.10, but config.py imports tomllib (3.11+).
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
