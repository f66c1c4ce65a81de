"""``tessera data prepare``: tokenize text into a prepared data directory."""

from __future__ import annotations

from typing import Annotated

import typer

from tessera.errors import UserError

data_app = typer.Typer(no_args_is_help=True, help="Prepare training data.")


@data_app.command("prepare")
def data_prepare(
    source: Annotated[list[str] | None, typer.Option(
        help="'stdlib' (this Python's standard library), or a text, .jsonl or .parquet file, "
             "or a directory of them; repeatable.")
    ] = None,
    out: Annotated[str, typer.Option(help="Output directory.")] = "data/stdlib",
    tokenizer: Annotated[str, typer.Option(help="'byte' or a path to a tokenizer.json.")
                         ] = "byte",
    val_percent: Annotated[float, typer.Option(help="Percent of tokens held out.")] = 2.0,
    text_field: Annotated[str, typer.Option(
        help="The text field of .jsonl records and the text column of .parquet files.")
    ] = "text",
    if_missing: Annotated[bool, typer.Option(
        "--if-missing", help="Do nothing if OUT already holds a valid prepared set.")] = False,
    workers: Annotated[int, typer.Option(
        help="Tokenizing processes; the output is the same for any number.")] = 1,
) -> None:
    """Tokenize text into memory-mapped shards with a train/val split by tokens."""
    from tessera.data.prepare import prepare
    from tessera.data.tokenizer import load_tokenizer

    if if_missing and is_prepared(out):
        print(f"{out}: already prepared")
        return
    if not 0 < val_percent < 100:
        raise UserError(f"--val-percent={val_percent}: must be in (0, 100)")
    if workers < 1:
        raise UserError(f"--workers={workers}: must be >= 1")
    try:
        tok = load_tokenizer(tokenizer)
        manifest = prepare(source or ["stdlib"], out, tok, val_percent, text_field=text_field,
                           workers=workers)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    counts = {k: sum(s["tokens"] for s in v) for k, v in manifest["splits"].items()}
    print(f"{out}: {counts['train']:,} train and {counts['val']:,} val tokens "
          f"({manifest['tokenizer']} tokenizer, vocab {manifest['vocab_size']})")


def is_prepared(path: str) -> bool:
    """Whether `path` holds a valid prepared data set (every file checked)."""
    from tessera.data.loader import DataError, TokenDataset

    try:
        TokenDataset(path).verify()
    except DataError:
        return False
    return True
