"""The chunked head + cross-entropy (``train.loss_chunk_tokens``) against the unchunked form.

Tolerance (tessera.testing's summation bound): the chunked form computes the same sums as the
head followed by the cross-entropy, grouped differently. A logit is a dot product over H; a
token's loss and a row of dh sum over the vocabulary V (the sum of exponentials, softmax·W),
then over the tp shards; the mean loss and each entry of dW sum over the N tokens, which the
chunked form adds chunk by chunk (and its backward takes the softmax from the saved
log-sum-exp instead of dividing by the sum of exponentials: one more rounding per element).
Each result thus carries at most the round-off of H + V + N reordered terms, relative to its
largest magnitude. A dropped chunk, a token counted twice, a padding column in the softmax or
a missing dW term gives errors of order 1/N or more, far above it.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tessera.parallel.chunked_loss as chunked_loss_module
import tessera.step
from tessera.config_io import make_config
from tessera.errors import ConfigError
from tessera.metrics import read_metrics
from tessera.model import cross_entropy
from tessera.parallel.chunked_loss import chunked_head_cross_entropy
from tessera.parallel.tensor_parallel import ShardSpec, TPContext, shard
from tessera.parallel.vocab_parallel_loss import vocab_parallel_cross_entropy
from tessera.testing import assert_close_summed, run_ranks, summation_error
from tessera.trainer import run

VOCAB, HIDDEN, BATCH, SEQ = 251, 16, 2, 14  # 251: tp=2 pads the vocabulary to 252
N = BATCH * SEQ
TERMS = HIDDEN + VOCAB + N
CHUNKS = [1, 5, 8, N, 3 * N]  # 5 and 8 do not divide N = 28 (a last partial chunk); >= N


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y[0, 0] = VOCAB - 1  # the last real column: next to the padding under tp=2
    return h, w, y


def reference(h, w, y) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss, dh, dW of the unchunked head and cross-entropy."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = cross_entropy(F.linear(h, w), y)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_loss_equals_unchunked_one_rank(chunk):
    h, w, y = inputs()
    want = reference(h, w, y)
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = chunked_head_cross_entropy(h, w, y, VOCAB, chunk)
    (3.0 * loss).backward()  # a gradient other than 1 reaches every chunk's term
    for name, got, ref in zip(("loss", "dh", "dW"), (loss, h.grad / 3, w.grad / 3), want,
                              strict=True):
        assert_close_summed(got, ref, terms=TERMS, msg=f"{name} chunk {chunk}")


@pytest.mark.parametrize("chunk", [1, 5, N])
def test_bf16_chunk_logits_are_the_unchunked_heads_rows(chunk, monkeypatch):
    """In bf16 each chunk's loss sees the unchunked head's logits (the matmul in bf16, then
    fp32) bit for bit: the same products of the same rows. Logits computed in fp32 from the
    bf16 operands differ by bf16 round-off (2⁻⁹ relative), which the loss's summation bound,
    made for fp32 reorderings, cannot tell apart reliably."""
    h, w, y = (t.bfloat16() if t.is_floating_point() else t for t in inputs())
    seen = []
    losses = chunked_loss_module.token_losses_
    monkeypatch.setattr(chunked_loss_module, "token_losses_",
                        lambda x, *a: seen.append(x.clone()) or losses(x, *a))
    chunked_head_cross_entropy(h, w, y, VOCAB, chunk)
    want = F.linear(h, w).float().flatten(0, 1)
    assert [len(x) for x in seen] == [len(r) for r in want.split(chunk)]
    assert torch.equal(torch.cat(seen), want)


# ---------------------------------------------------------------------------------------------
# tp = 2: each rank holds half of the padded vocabulary's rows of W.


def _tp_worker() -> dict:
    tp_plain = TPContext(group=dist.group.WORLD)
    tp_sp = TPContext(group=dist.group.WORLD, sequence_parallel=True)
    rank = tp_plain.rank
    h, w, y = inputs(seed=1)
    want = reference(h, w, y)
    spec = ShardSpec(dim=0, chunks=2, full_size=VOCAB, pad=True)
    want_dw = shard(want[2], spec, tp_plain)  # this rank's rows, padding rows zero
    used = {}
    for sp in (False, True):
        tp = tp_sp if sp else tp_plain
        rows = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2) if sp else slice(None)
        for chunk in (*CHUNKS, "unchunked"):
            h_in = h[:, rows].clone().requires_grad_()  # under SP: this rank's tokens
            w_local = shard(w, spec, tp).requires_grad_()
            if chunk == "unchunked":
                logits = F.linear(tp.enter(h_in, "output"), w_local)
                loss = vocab_parallel_cross_entropy(logits, y, VOCAB, tp)
            else:
                loss = chunked_head_cross_entropy(h_in, w_local, y, VOCAB, chunk, tp)
            loss.backward()
            used[(sp, chunk)] = [
                summation_error(loss, want[0], terms=TERMS),
                summation_error(h_in.grad, want[1][:, rows], terms=TERMS,
                                scale=float(want[1].abs().max())),
                summation_error(w_local.grad, want_dw, terms=TERMS,
                                scale=float(want[2].abs().max()))]
    return used


@pytest.mark.multiprocess
def test_chunked_loss_equals_unchunked_two_ranks():
    """tp=2, with and without sequence parallelism: loss, dh (after the head region's entry
    sums it over the ranks) and each rank's rows of dW equal the single-device head's."""
    for rank, used in enumerate(run_ranks(_tp_worker, 2)):
        for case, shares in used.items():
            assert all(s <= 1 for s in shares), (rank, case, shares)


# ---------------------------------------------------------------------------------------------
# Memory: Llama 3's vocabulary, one micro-batch of 2 x 2048 tokens.


def _peak_growth(fn) -> int:
    """Bytes the process's peak resident set rose above its resident set at the start, during
    fn(). Freed heap memory is handed back first (malloc_trim), and every allocation here is
    written, so the figure is the peak of the bytes allocated during fn()."""
    def kib(key: str) -> int:
        return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    start = kib("VmRSS")
    fn()
    return (kib("VmHWM") - start) * 1024


def _memory_worker(vocab: int, seq: int, batch: int, hidden: int, chunk: int) -> dict:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(batch, seq, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (batch, seq), generator=g)

    def unchunked():
        cross_entropy(F.linear(h, w), y).backward()

    def chunked():
        chunked_head_cross_entropy(h, w, y, vocab, chunk).backward()

    out = {}
    for name, fn in (("chunked", chunked), ("unchunked", unchunked)):
        h.grad = w.grad = None
        out[name] = _peak_growth(fn)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_chunked_loss_peak_memory_is_a_quarter_or_less():
    """V = 128,256, T = 2048, B = 2 (H = 64 keeps it fast): the loss's forward and backward
    raise the peak of allocated bytes by at most 1/4 of what the unchunked form does (its fp32
    logits alone are B·T·V·4 = 2 GiB). Measured in a fresh process whose malloc hands large
    blocks back to the kernel (keep_host_memory=False), so resident = allocated."""
    vocab, seq, batch, hidden, chunk = 128_256, 2048, 2, 64, 512
    (peak,) = run_ranks(_memory_worker, 1, args=(vocab, seq, batch, hidden, chunk),
                        keep_host_memory=False, timeout=600)
    logits = batch * seq * vocab * 4
    print(f"peak extra bytes: unchunked {peak['unchunked'] / 2**20:.0f} MiB, chunked "
          f"({chunk} tokens) {peak['chunked'] / 2**20:.0f} MiB; fp32 logits "
          f"{logits / 2**20:.0f} MiB")
    assert peak["unchunked"] >= logits  # the measure sees the logits
    assert peak["chunked"] <= peak["unchunked"] / 4, peak


# ---------------------------------------------------------------------------------------------
# Training: the tiny preset, 10 steps, with and without chunks.


def _train_cfg(data: str, out: Path, *sets: str):
    return make_config("tiny", overrides=[f"data.path={data}", "train.steps=10",
                                          "train.sample_tokens=0", f"train.out_dir={out}",
                                          *sets])


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]


@pytest.mark.parametrize("tie", [False, True])
def test_training_with_loss_chunks_matches(tiny_data, tmp_path, monkeypatch, tie):
    calls = []
    chunked = tessera.step.chunked_head_cross_entropy
    monkeypatch.setattr(tessera.step, "chunked_head_cross_entropy",
                        lambda *a, **k: calls.append(a[4]) or chunked(*a, **k))
    tied = f"model.tie_embeddings={str(tie).lower()}"
    run(_train_cfg(tiny_data, tmp_path / "plain", tied), progress=False)
    assert not calls
    cfg = _train_cfg(tiny_data, tmp_path / "chunked", tied, "train.loss_chunk_tokens=16")
    run(cfg, progress=False)
    assert calls and set(calls) == {16}  # the chunked path ran, 16 tokens a chunk
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    a, b = _losses(tmp_path / "plain"), _losses(tmp_path / "chunked")
    assert len(a) == 10
    # Each step reorders the sums over the step's tokens and the vocabulary (module doc).
    for k, (got, want) in enumerate(zip(b, a, strict=True), 1):
        assert_close_summed(got, want, terms=k * (tokens + cfg.model.vocab_size),
                            msg=f"step {k}")


def test_loss_chunk_tokens_is_checked():
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens=-1: must be >= 0"):
        make_config("tiny", overrides=["train.loss_chunk_tokens=-1"])
    with pytest.raises(ConfigError, match="must fit in a 64-bit integer"):
        make_config("tiny", overrides=[f"train.loss_chunk_tokens={2**63}"])


def test_loss_chunks_refused_under_zero3():
    from tessera.layout import validate

    cfg = make_config("tiny", overrides=["train.loss_chunk_tokens=64", "parallel.dp=2",
                                         "parallel.zero_stage=3"])
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens=64: needs parallel.zero_"):
        validate(cfg)
    cfg.parallel.zero_stage = 2
    validate(cfg)


def _train_rank(cfg) -> None:
    from tessera.trainer import train

    train(cfg, progress=False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_training_with_loss_chunks_matches_at_tp2(tiny_data, tmp_path):
    """tp=2 with tied embeddings (the head reads the vocabulary-parallel embedding's rows):
    the same losses with and without chunks."""
    tied = "model.tie_embeddings=true"
    runs = {}
    for name, sets in (("plain", ()), ("chunked", ("train.loss_chunk_tokens=48",))):
        cfg = _train_cfg(tiny_data, tmp_path / name, tied, "parallel.tp=2", "train.steps=4",
                         *sets)
        run_ranks(_train_rank, 2, args=(cfg,))
        runs[name] = _losses(tmp_path / name)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    assert len(runs["plain"]) == 4
    for k, (got, want) in enumerate(zip(runs["chunked"], runs["plain"], strict=True), 1):
        assert_close_summed(got, want, terms=k * (tokens + cfg.model.vocab_size),
                            msg=f"step {k}")
