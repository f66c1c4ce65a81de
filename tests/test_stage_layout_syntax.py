"""Megatron-LM's ``--pipeline-model-parallel-layout`` strings as a second way to write
`parallel.stage_layout` (blocks per chunk): the parser, its refusals, `tessera plan --layout
stages=...` and `tessera train`'s config.

Megatron's form names the layers of each chunk, chunks split by `|` in virtual-stage order:
`E` the embedding, `t` a transformer block, `L` the loss head, `t*3` and `(tt|)*29` repeats.
No processes; the file runs in a second.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from cli_errors import cli_error
from tessera.cli import app, resolve_config
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.layout import validate
from tessera.pipeline.partition import partition
from tessera.pipeline.split import first_last_fewer, parse_stage_layout

LLAMA3_405B_MEGATRON = "Et*7|(t*8|)*14t*7L"  # Grattafiori et al. 2024, §3.3.2: 7, 8 x 14, 7


def test_megatron_layout_gives_llama3_405b_split():
    """126 layers on 16 stages, written letter by letter, with repeats, with Megatron's
    cosmetic commas and spaces: the same tuple as Llama 3's rule and as '7,8*14,7'."""
    want = first_last_fewer(126, 16)
    assert want == parse_stage_layout("7,8*14,7") == (7,) + (8,) * 14 + (7,)
    assert parse_stage_layout("Ettttttt|(tttttttt|)*14tttttttL") == want
    assert parse_stage_layout(LLAMA3_405B_MEGATRON) == want
    assert parse_stage_layout("E t*7 | (t*8|)*14, t*7 L") == want
    # Groups nest: ((tt|)*2t)*2 is tt|tt|ttt|tt|t.
    assert parse_stage_layout("Et|((tt|)*2t)*2|tL") == (1, 2, 2, 3, 2, 1, 1)


def _virtual_config(stage_layout: str):
    """pp=2 with 2 virtual stages per rank: chunks 0 and 2 on rank 0, 1 and 3 on rank 1."""
    return make_config(
        "tiny",
        model=dict(vocab_size=64, d_model=32, n_layers=6, n_heads=2, n_kv_heads=1,
                   max_seq_len=32, tie_embeddings=False),
        parallel=dict(pp=2, virtual_stages=2, schedule="interleaved",
                      stage_layout=stage_layout),
        train=dict(grad_accum=2, micro_batch_size=1, steps=1,
                   out_dir="/nonexistent-not-written"),
        data=dict(seq_len=16))


def test_megatron_layout_with_virtual_stages():
    """v=2: the chunk order is Megatron's (virtual stage 0 of every rank, then 1), tessera's
    too, so chunk c runs on rank c mod pp; Llama 3 405B at pp 16, v 2 is '3,4*30,3'."""
    cfg = _virtual_config("Et|tt|t|ttL")
    validate(cfg, world_size=2)
    sizes = parse_stage_layout(cfg.parallel.stage_layout)
    assert sizes == parse_stage_layout("1,2,1,2")
    specs = partition(cfg.model, 4, split=sizes)
    assert [list(s.layers) for s in specs] == [[0], [1, 2], [3], [4, 5]]
    assert specs[0].has_embedding and specs[3].has_head
    per_rank = [sum(sizes[r::2]) for r in range(2)]
    assert per_rank == [2, 4]
    assert parse_stage_layout("Et*3|(t*4|)*30t*3L") == first_last_fewer(126, 32)


# Each bad string with the rule its message must state (the field and value are checked too).
REFUSALS = {
    "bad letter": ("Et*2|m|ttL", "layer 'm' is Megatron's multi-token prediction layer, "
                                 "which tessera does not build"),
    "unknown letter": ("Et*2|tx|tL", "layer 'x' is not a layer letter"),
    "E not first": ("tEt|ttL", "E (the embedding) must open the first chunk"),
    "E in a later chunk": ("t|Ett|tL", "E (the embedding) must open the first chunk"),
    "L not last": ("Et|tLt|t", "L (the loss head) must close the last chunk"),
    "two Es": ("Et|Et|tL", "needs exactly one E (the embedding), found 2"),
    "no L": ("Et|tt|tt", "needs exactly one L (the loss head), found 0"),
    "empty chunk": ("Ett|tt|L", "chunk 2 ('L') holds no t; every chunk needs at least one "
                                "block"),
    "unclosed parenthesis": ("Et|(tt|tL", "unbalanced parenthesis: the '(' at character 4 "
                                          "is never closed"),
    "stray parenthesis": ("Et|tt)|tL", "unbalanced parenthesis: the ')' at character 6 "
                                       "closes no '('"),
    "no count": ("Et*|ttttL", "'*' at character 3 must be followed by a repeat count >= 1"),
    "count first": ("E3t|ttttL", "'3' at character 2 must follow a layer letter or a group"),
}


@pytest.mark.parametrize("text,rule", REFUSALS.values(), ids=REFUSALS.keys())
def test_megatron_layout_refusals_name_field_value_and_rule(text: str, rule: str):
    with pytest.raises(ConfigError, match=re.escape(f"parallel.stage_layout={text!r}: {rule}")):
        validate(_virtual_config(text), world_size=2)


def test_megatron_layout_chunk_count_and_total_are_checked():
    """The layout check's own rules, the same messages as for block counts."""
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.stage_layout='Et|t*4L': gives 2 chunks; needs one per chunk, "
            "pp*virtual_stages=4")):
        validate(_virtual_config("Et|t*4L"), world_size=2)
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.stage_layout='Et|t|t|tL': holds 4 blocks; must add up to "
            "model.n_layers=6")):
        validate(_virtual_config("Et|t|t|tL"), world_size=2)
    # The block-count syntax and its messages are unchanged (the planner's keyword too).
    with pytest.raises(ConfigError, match="comma-separated block counts"):
        validate(_virtual_config("first-last-fewer"), world_size=2)


def test_plan_layout_takes_megatron_stages():
    """`tessera plan --layout "...,stages=<Megatron string>"`: the same layout as
    stages=first-last-fewer (test_planner_scale), with or without Megatron's cosmetic commas,
    which a comma-separated --layout must carry into stages=, not read as keys."""
    runner = CliRunner()
    base = ["plan", "--model", "llama3-405b", "--gpus", "8192", "--hardware", "H100",
            "--global-batch", "2048", "--seq", "8192", "--kernels", "fused", "--layout"]
    for stages in ("Et*3|(t*4|)*30t*3L", "Et*3|(t*4|)*30,t*3L"):
        r = runner.invoke(app, base + [f"dp=64,tp=8,pp=16,v=2,mb=1,zero=1,stages={stages},sp"])
        assert r.exit_code == 0, r.output
        assert ("one layout evaluated: dp=64 tp=8 pp=16 cp=1 interleaved v=2 b=1 zero=1 "
                "recompute=none sp stages=3,4*30,3") in r.output
    r = runner.invoke(app, base + ["dp=64,tp=8,pp=16,stages=Et*7|(t*8|)*14,m|tL"])
    assert r.exit_code == 2
    assert ("--layout stages='Et*7|(t*8|)*14,m|tL': layer 'm' is Megatron's multi-token "
            "prediction layer") in r.output
    r = runner.invoke(app, base + ["dp=64,tp=8,pp=16,stages=Et*3|(t*4|)*30t*3L"])
    assert r.exit_code == 2 and "must give pp*virtual=16 chunks" in r.output


def test_train_config_takes_megatron_layout(tmp_path, tiny_data):
    """A run's config file with a Megatron layout: accepted, and the chunks tessera builds
    hold the blocks it names; a bad one is refused before any process starts."""
    run = tmp_path / "run.toml"
    run.write_text('[parallel]\npp = 2\nschedule = "1f1b"\nstage_layout = "Et|t*4L"\n'
                   '[model]\nn_layers = 5\n')
    cfg = resolve_config("tiny", str(run), [], {"train": {"grad_accum": 2}})
    validate(cfg, world_size=2)
    specs = partition(cfg.model, 2, split=parse_stage_layout(cfg.parallel.stage_layout))
    assert [list(s.layers) for s in specs] == [[0], [1, 2, 3, 4]]
    line = cli_error(["train", "--preset", "tiny", "--data", tiny_data, "--pp", "2",
                      "--stage-layout", "Et|tLt"])
    assert "parallel.stage_layout='Et|tLt': L (the loss head) must close the last" in line
