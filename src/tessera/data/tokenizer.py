"""Tokenizers: bytes by default (no downloads, vocabulary 256), or a local Hugging Face
``tokenizer.json`` read with the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None
    """The end-of-text token that separates documents; None where there is none (bytes)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens: id = byte value."""

    name = "byte"
    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
"""End-of-text spellings of GPT-2, Llama 3, Llama 2 / T5 and others, tried in this order."""


class HFTokenizer:
    """A tokenizer.json from a local path (no hub access)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
        self.name = str(path.resolve())
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = next((i for t in EOT_TOKENS if (i := self._tok.token_to_id(t)) is not None),
                           None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' or a path to a tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
