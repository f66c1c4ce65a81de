"""The commands that read a trained model's weights: ``tessera generate``, ``tessera eval``,
``tessera export-hf`` and ``tessera checkpoint inspect|export``. The `tessera` app
(tessera.cli) registers them."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from tessera.errors import ConfigError, UserError

checkpoint_app = typer.Typer(no_args_is_help=True, help="Look into and convert checkpoints.")

EVAL_TOKENS = 65536
"""`tessera eval`'s targets when the checkpoint does not record its validation's."""

Checkpoint = Annotated[str, typer.Option(
    help="A checkpoint step directory, a checkpoint root, a run's --out (its newest), or a "
         "Hugging Face Llama directory (config.json + *.safetensors).")]


Compile = Annotated[bool, typer.Option(
    "--compile", help="Compile the model's blocks and final norm with torch.compile first "
                      "(one-off compile seconds; faster on long inputs).")]


def load_checkpoint_model(checkpoint: str, device: str, compile: bool = False):
    """The reference model with the weights at `checkpoint` loaded (a checkpoint's, consolidated
    from its shards, or a Hugging Face Llama directory's), and the directory read; with
    `compile`, its blocks and final norm compiled for inference (``parallel.compile``)."""
    from pathlib import Path

    from tessera.checkpoint import find
    from tessera.model import Transformer
    from tessera.weights import is_hf_dir, load_weights

    path = Path(checkpoint) if is_hf_dir(checkpoint) else find(checkpoint)
    model_cfg, state = load_weights(path)
    model = Transformer(model_cfg)
    model.load_state_dict(state)
    if compile:
        from tessera.parallel.compile import compile_chunk

        compile_chunk(model, inference=True)
    return model.to(device), path


def tokenizer_for(spec: str):
    """'byte', a tokenizer.json, or a prepared data directory (the tokenizer it was made with)."""
    from tessera.data.loader import TokenDataset
    from tessera.data.tokenizer import load_tokenizer

    if os.path.isdir(spec):
        spec = TokenDataset(spec, verify=False).tokenizer
    return load_tokenizer(spec)


def generate_cmd(
    checkpoint: Checkpoint,
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "",
    tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option(help="Softmax temperature; 0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample from the k likeliest tokens; 0: all.")] = 40,
    top_p: Annotated[float, typer.Option(
        help="Sample from the smallest set of tokens whose probability reaches p; 1: all.")
    ] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    tokenizer: Annotated[str, typer.Option(
        help="'byte', a tokenizer.json, or the prepared data directory the model trained on.")
    ] = "byte",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    compile_: Compile = False,
) -> None:
    """Continue a prompt with a checkpoint's model, printed to stdout."""
    from tessera.generate import generate

    try:
        for flag, value, ok, rule in (
                ("--tokens", tokens, tokens >= 0, "must be >= 0"),
                ("--temperature", temperature, temperature >= 0, "must be >= 0"),
                ("--top-k", top_k, top_k >= 0, "must be >= 0"),
                ("--top-p", top_p, 0 < top_p <= 1, "must be in (0, 1]")):
            if not ok:
                raise ConfigError(flag, value, rule)
        tok = tokenizer_for(tokenizer)
        model, _ = load_checkpoint_model(checkpoint, device, compile_)
        if tok.vocab_size > model.cfg.vocab_size:
            raise ConfigError("--tokenizer", tokenizer, f"its vocabulary {tok.vocab_size} "
                              f"exceeds the model's {model.cfg.vocab_size}")
        ids = generate(model, tok.encode(prompt), tokens, temperature, top_k or None, seed,
                       top_p, stop=getattr(tok, "eot_id", None))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    print(prompt + tok.decode(ids))


def export_hf_cmd(
    checkpoint: Checkpoint,
    out: Annotated[str, typer.Option(help="Directory to write config.json and "
                                          "model.safetensors to.")],
) -> None:
    """Write a checkpoint's model as a Hugging Face Llama directory (LlamaForCausalLM reads it)."""
    print(export_weights(checkpoint, out, "hf"))


@checkpoint_app.command("inspect")
def checkpoint_inspect_cmd(
    path: Annotated[str, typer.Argument(help="A checkpoint step directory, a checkpoint root "
                                              "or a run's --out (its newest).")],
) -> None:
    """Step, the layout that wrote it, the model, the gradient noise scale from the saved moving
    averages, and every tensor (global shape, dtype, boxes saved, bytes). Reads no tensor data;
    checks every file's checksum first."""
    from tessera.checkpoint import describe

    lines = describe(path)
    print("\n".join(lines))


@checkpoint_app.command("export")
def checkpoint_export_cmd(
    path: Annotated[str, typer.Argument(help="A checkpoint step directory, a checkpoint root "
                                              "or a run's --out (its newest).")],
    to: Annotated[str, typer.Option("--to", help="Directory to write.")],
    format_: Annotated[str, typer.Option(
        "--format", help="hf: config.json + model.safetensors (LlamaForCausalLM reads it); "
                         "torch: model.pt (reference names, fp32) + model.json.")] = "hf",
) -> None:
    """Consolidated fp32 weights in reference names from every rank's shards, in one process
    (any training layout)."""
    print(export_weights(path, to, format_))


def export_weights(path: str, to: str, format_: str) -> str:
    """Write the consolidated weights of the checkpoint at `path` to the directory `to` in
    `format_` (hf or torch); the line saying what was read and written."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    import torch

    from tessera.checkpoint import load_model
    from tessera.hf import save_hf

    if format_ not in ("hf", "torch"):
        raise ConfigError("--format", format_, "must be hf or torch")
    model_cfg, state, found = load_model(path)
    if format_ == "hf":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ConfigError("--format", format_, "needs safetensors: pip install -c "
                              "constraints.txt -e '.[hf]' (or use --format torch)") from None
        written = save_hf(model_cfg, state, to)
        what = "config.json, model.safetensors"
    else:
        written = Path(to)
        written.mkdir(parents=True, exist_ok=True)
        torch.save(state, written / "model.pt")
        (written / "model.json").write_text(json.dumps(asdict(model_cfg), indent=1))
        what = "model.pt, model.json"
    return f"{found} -> {written} ({what})"


def eval_cmd(
    checkpoint: Checkpoint,
    data: Annotated[str | None, typer.Option(
        help="Prepared data directory; default: the one the checkpoint's run trained on.")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(
        help="Tokens per window; default: the training windows' (data.seq_len), else the "
             "model's max_seq_len.")] = None,
    tokens: Annotated[int | None, typer.Option(
        help="Targets to score (all the split's windows if it holds fewer); default: what the "
             f"training validation scored, else {EVAL_TOKENS}.")] = None,
    split: Annotated[str, typer.Option(help="val or train.")] = "val",
    batch_size: Annotated[int | None, typer.Option(
        help="Windows per forward pass; default: the training validation's, else 16.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    compile_: Compile = False,
) -> None:
    """Validation loss (nats per token) and perplexity of a checkpoint's model; by default on
    the windows the training run validated on."""
    from tessera.evaluate import eval_windows, evaluate

    try:
        if split not in ("val", "train"):
            raise ConfigError("--split", split, "must be val or train")
        for flag, value in (("--tokens", tokens), ("--batch-size", batch_size),
                            ("--seq-len", seq_len)):
            if value is not None and value < 1:
                raise ConfigError(flag, value, "must be >= 1")
        model, path = load_checkpoint_model(checkpoint, device, compile_)
        w = eval_windows(model, path, data, seq_len, tokens, batch_size, split, EVAL_TOKENS)
        result = evaluate(model, w.dataset, w.seq_len, w.tokens, w.batch_size, split)
    except ValueError as e:
        raise UserError(str(e)) from None
    for note in w.notes:
        print(f"note: {note}")
    print(f"{path}: {split} loss {result.loss:.4f} nats/token, perplexity "
          f"{result.perplexity:.2f} ({result.tokens:,} tokens of {w.data}, {result.windows} "
          f"windows of {w.seq_len})")
