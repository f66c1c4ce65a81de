"""Shared test set-up.

The parent pytest process keeps torch to one thread: multi-process tests fork ranks from it,
and a fork after OpenMP worker threads exist can hang the child.
"""

from __future__ import annotations

import pytest
import torch

from tessera.data.prepare import prepare
from tessera.data.tokenizer import ByteTokenizer

torch.set_num_threads(1)

SAMPLE_TEXT = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
'''


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    """A small prepared byte-level data set made from generated Python-like text."""
    src = tmp_path_factory.mktemp("src")
    for i in range(40):
        (src / f"mod_{i:02d}.py").write_text(SAMPLE_TEXT.replace("fibonacci", f"fib_{i}") * 4)
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare([str(src)], out, ByteTokenizer(), val_percent=20.0)
    return str(out)
