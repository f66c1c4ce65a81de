"""Bring your own data and weights, end to end through the command line: a single text file,
a directory of JSON Lines and a Parquet file each prepared, trained on for 20 steps and
generated from; and every command of the README's "Your own data and weights" block, run as
written (with fewer steps and tokens, appended as later flags, which win)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.cli import app
from tessera.metrics import read_metrics

README = Path(__file__).resolve().parents[1] / "README.md"
LINE = "def add(a, b):\n    return a + b  # the sum of {i} and more\n"
SMALL = ["--set", "data.seq_len=16", "--set", "data.val_tokens=256",
         "--set", "train.sample_tokens=0", "--no-progress"]


def _invoke(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"tessera {shlex.join(args)}\n{result.output}"
    return result.output


def _text_file(path: Path, lines: int) -> Path:
    path.write_text("".join(LINE.format(i=i) for i in range(lines)))
    return path


def _jsonl_dir(path: Path, field: str = "text") -> Path:
    path.mkdir()
    for part in range(3):
        path.joinpath(f"part{part}.jsonl").write_text("\n".join(
            json.dumps({field: LINE.format(i=i) * 3, "id": i}) for i in range(200)))
    return path


def _parquet_file(path: Path, field: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: [LINE.format(i=i) * 3 for i in range(600)]}), path,
                   row_group_size=100)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["txt", "jsonl-dir", "parquet"])
def test_prepare_train_20_steps_and_generate(tmp_path, kind):
    source = {"txt": lambda: _text_file(tmp_path / "corpus.txt", 1500),
              "jsonl-dir": lambda: _jsonl_dir(tmp_path / "shards"),
              "parquet": lambda: _parquet_file(tmp_path / "corpus.parquet")}[kind]()
    data, run = tmp_path / "data", tmp_path / "run"
    _invoke(["data", "prepare", "--source", str(source), "--out", str(data)])
    _invoke(["train", "--preset", "tiny", "--data", str(data), "--steps", "20",
             "--checkpoint-interval", "20", "--out", str(run), *SMALL])
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 21))
    # 20 steps on repetitive text: well below the uniform ln 256 = 5.55 nats it starts near.
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 1.0
    out = _invoke(["generate", "--checkpoint", str(run), "--tokenizer", str(data),
                   "--prompt", "def add", "--tokens", "30", "--temperature", "0"])
    assert out.startswith("def add") and len(out) > len("def add\n")


def test_prepare_workers_must_be_positive(tmp_path):
    from cli_errors import cli_error

    corpus = _text_file(tmp_path / "corpus.txt", 10)
    assert cli_error(["data", "prepare", "--source", str(corpus), "--out", str(tmp_path / "o"),
                      "--workers", "0"]) == "error: --workers=0: must be >= 1"


def _readme_commands() -> list[list[str]]:
    text = README.read_text()
    section = text[text.index("## Your own data and weights"):]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start:section.index("```", start)]
    return [shlex.split(line.split("  #")[0]) for line in block.splitlines() if line.strip()]


def _bpe_tokenizer(path: Path, corpus: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([corpus.read_text()[:20000]], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_own_data_commands_run_as_written(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    commands = _readme_commands()
    assert [c[:2] for c in commands] == [["tessera", "data"]] * 3 + [
        ["tessera", "train"], ["tessera", "eval"], ["tessera", "generate"],
        ["tessera", "export-hf"], ["tessera", "train"]]
    monkeypatch.chdir(tmp_path)
    # The files the commands name: corpus.txt, shards/ (records under `content`, as the README
    # says: JSON Lines and Parquet), tokenizer.json.
    corpus = _text_file(tmp_path / "corpus.txt", 3000)
    _jsonl_dir(tmp_path / "shards", field="content")
    _parquet_file(tmp_path / "shards" / "more.parquet", field="content")
    _bpe_tokenizer(tmp_path / "tokenizer.json", corpus)
    # A small corpus: 2% of it holds fewer than tiny's 4,096 validation tokens (README: then
    # --set data.val_tokens=N).
    fewer = {"train": ["--steps", "20", "--no-progress", "--set", "data.val_tokens=512"],
             "eval": ["--tokens", "512"]}
    for command in commands[:-1]:
        args = command[1:] + fewer.get(command[1], [])
        out = _invoke(args)
        if command[1] == "eval":
            assert "val loss" in out and "perplexity" in out
        if command[1] == "generate":
            assert out.startswith("Once upon")
    assert json.loads(Path("data/bpe/manifest.json").read_text())["eot_id"] is not None
    assert json.loads(Path("hf/bpe/config.json").read_text())["model_type"] == "llama"
    # The last one launches two ranks: a process of its own, as a user runs it.
    last = commands[-1][1:] + fewer["train"]
    proc = subprocess.run([sys.executable, "-m", "tessera", *last], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp=2" in proc.stdout and Path("runs/bpe2/summary.json").is_file()
