"""How many blocks each pipeline chunk gets: tessera's cost-balanced contiguous split.

The split balances an estimated forward cost per token (matmul FLOPs, as in
``tessera.model.flops_per_token``): each block costs 2·N_block + 4·a·d·T, the head 2·V·h, and
the embedding lookup h (a copy, no FLOPs). Among contiguous splits with at least one block per
chunk, the one with the smallest most-expensive chunk is chosen, ties broken by the least sum
of squared chunk costs (two exact dynamic programmes, O(chunks·L²)), so a heavy LM head pushes
blocks towards the earlier chunks. The user can give the split instead, as blocks per chunk
('7,8*14,7') or as a Megatron-LM pipeline layout string ('Et*7|(t*8|)*14t*7L').

Plain Python (no torch): ``tessera.pipeline.partition`` builds the chunks from it, and the
planner asks it what tessera would build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from tessera.config import ModelConfig
from tessera.errors import ConfigError


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """Forward FLOPs per token of (embedding, each block, final norm + head + loss)."""
    h, d, a, kv, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden
    block_matmul = h * (a + 2 * kv) * d + a * d * h + 3 * h * f
    block = 2.0 * block_matmul + 4.0 * a * d * seq_len
    head = 2.0 * cfg.vocab_size * h + 5.0 * cfg.vocab_size  # matmul, then softmax + loss
    return float(h), [block] * cfg.n_layers, head


def balance(costs: Sequence[float], n_chunks: int, first_extra: float = 0.0,
            last_extra: float = 0.0) -> list[int]:
    """Blocks per chunk minimizing the costliest chunk (first/last chunks carry extras)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(k: int, i: int, j: int) -> float:  # chunk k holds blocks i..j-1
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == n_chunks - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")

    def solve(score, combine) -> tuple[float, list[int]]:
        """DP over (chunks used, blocks placed); returns the best score and the cut points."""
        best = [[inf] * (n + 1) for _ in range(n_chunks)]
        cut = [[0] * (n + 1) for _ in range(n_chunks)]
        for j in range(1, n + 1):
            best[0][j] = score(cost(0, 0, j))
        for k in range(1, n_chunks):
            for j in range(k + 1, n + 1):
                for i in range(k, j):
                    value = combine(best[k - 1][i], score(cost(k, i, j)))
                    if value < best[k][j] - 1e-9:
                        best[k][j], cut[k][j] = value, i
        sizes, j = [], n
        for k in range(n_chunks - 1, 0, -1):
            sizes.append(j - cut[k][j])
            j = cut[k][j]
        sizes.append(j)
        return best[n_chunks - 1][n], sizes[::-1]

    # First the smallest possible costliest chunk M; then, among splits within M, the most even
    # one (least sum of squared chunk costs), so ties do not leave one chunk needlessly light.
    limit, _ = solve(lambda c: c, max)
    _, sizes = solve(lambda c: c * c if c <= limit + 1e-9 * max(1.0, limit) else inf,
                     lambda a, b: a + b)
    return sizes


def parse_stage_layout(text: str, field: str = "parallel.stage_layout") -> tuple[int, ...]:
    """'7,8*14,7' -> (7, 8, ..., 8, 7): blocks per chunk, `N*k` repeating N k times; or the
    same split in Megatron-LM's layout form, 'Et*7|(t*8|)*14t*7L' (`parse_megatron_layout`)."""
    if is_megatron_layout(text):
        return parse_megatron_layout(text, field)
    sizes: list[int] = []
    for part in text.replace(" ", "").split(","):
        count, star, times = part.partition("*")
        try:
            n, k = int(count), int(times) if star else 1
        except ValueError:
            raise ConfigError(field, text, "must be comma-separated block counts, N*k for k "
                              "chunks of N blocks (e.g. '7,8*14,7')") from None
        if n < 1 or k < 1:
            raise ConfigError(field, text, "every chunk needs at least one block (N >= 1, "
                              "k >= 1 in N*k)")
        if len(sizes) + k > MAX_EXPANDED:
            raise ConfigError(field, text, f"gives more than {MAX_EXPANDED:,} chunks")
        sizes += [n] * k
    return tuple(sizes)


def is_megatron_layout(text: str) -> bool:
    """Whether `text` is written in Megatron-LM's layout form (it names layers: |, E, L, t)
    rather than as block counts ('first-last-fewer', the planner's keyword, is not)."""
    return text.strip() != "first-last-fewer" and any(c in text for c in "|ELt")


MEGATRON_LETTERS = {"E": "the embedding", "t": "a transformer block", "L": "the loss head"}
OTHER_MEGATRON_LETTERS = {"m": "Megatron's multi-token prediction layer, which tessera does "
                               "not build"}
MAX_EXPANDED = 1_000_000  # a typo such as t*99999999 is refused, not expanded


def parse_megatron_layout(text: str, field: str = "parallel.stage_layout") -> tuple[int, ...]:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` as blocks per chunk.

    'Et*7|(t*8|)*14t*7L' -> (7, 8, ..., 8, 7). Chunks are separated by `|` in virtual-stage
    order (chunk c on pipeline rank c mod pp, as in tessera); a chunk names its layers, `E` the
    embedding, `t` a transformer block, `L` the loss head; `x*N` repeats a letter and `(...)*N`
    a group, which may hold `|` and other groups. Spaces and commas are ignored (Megatron
    drops commas as cosmetic). tessera always embeds on the first chunk and computes the loss
    on the last, so `E` must open the first chunk and `L` close the last, once each, and every
    chunk needs at least one `t`. The grammar::

        layout := item*
        item   := atom ('*' count)?
        atom   := letter | '|' | '(' layout ')'
        count  := digit+              (at least 1)
        letter := 'E' | 't' | 'L'     (any other character is refused, named)
    """
    chunks = _expand_megatron(text, field).split("|")

    def refuse(rule: str) -> NoReturn:
        raise ConfigError(field, text, rule)

    for letter in "".join(chunks):
        if letter not in MEGATRON_LETTERS:
            what = OTHER_MEGATRON_LETTERS.get(letter, "not a layer letter")
            refuse(f"layer {letter!r} is {what}; a chunk holds E (the embedding), t (a "
                   "transformer block) and L (the loss head)")
    for letter in "EL":
        count = sum(chunk.count(letter) for chunk in chunks)
        if count != 1:
            refuse(f"needs exactly one {letter} ({MEGATRON_LETTERS[letter]}), found {count}")
    if not chunks[0].startswith("E"):
        refuse("E (the embedding) must open the first chunk: tessera embeds on the first "
               "chunk, before its blocks")
    if not chunks[-1].endswith("L"):
        refuse("L (the loss head) must close the last chunk: tessera computes the loss on the "
               "last chunk, after its blocks")
    for c, chunk in enumerate(chunks):
        if "t" not in chunk:
            refuse(f"chunk {c} ({chunk!r}) holds no t; every chunk needs at least one block")
    return tuple(chunk.count("t") for chunk in chunks)


def _expand_megatron(text: str, field: str) -> str:
    """Unroll the repeats of a Megatron layout: '(tt|)*2t*3' -> 'tt|tt|ttt' (recursive descent
    over the grammar in `parse_megatron_layout`)."""
    pos = 0

    def refuse(rule: str) -> NoReturn:
        raise ConfigError(field, text, rule)

    def skip_ignored() -> str:  # the next meaningful character, or '' at the end
        nonlocal pos
        while pos < len(text) and text[pos] in " ,":
            pos += 1
        return text[pos] if pos < len(text) else ""

    def count() -> int:
        nonlocal pos
        if skip_ignored() != "*":
            return 1
        pos += 1
        star = pos  # 1-based position of the '*'
        skip_ignored()
        start = pos
        while pos < len(text) and text[pos].isdigit():
            pos += 1
        if pos == start or int(text[start:pos]) < 1:
            refuse(f"'*' at character {star} must be followed by a repeat count >= 1 "
                   "(t*3, (tt|)*29)")
        return int(text[start:pos])

    def layout() -> str:  # items up to the end or the ')' closing the enclosing group
        nonlocal pos
        out: list[str] = []
        size = 0
        while (c := skip_ignored()) not in ("", ")"):
            at = pos + 1  # 1-based, for the messages
            pos += 1
            if c == "(":
                atom = layout()
                if skip_ignored() != ")":
                    refuse(f"unbalanced parenthesis: the '(' at character {at} is never "
                           "closed")
                pos += 1
            elif c == "*" or c.isdigit():
                refuse(f"{c!r} at character {at} must follow a layer letter or a group, as "
                       "in t*3 or (tt|)*29")
            else:
                atom = c
            times = count()
            size += len(atom) * times
            if size > MAX_EXPANDED:
                refuse(f"expands to more than {MAX_EXPANDED} layers")
            out.append(atom * times)
        return "".join(out)

    flat = layout()
    if pos < len(text):
        refuse(f"unbalanced parenthesis: the ')' at character {pos + 1} closes no '('")
    return flat


def first_last_fewer(layers: int, n_chunks: int) -> tuple[int, ...]:
    """Llama 3's rule (Grattafiori et al. 2024, §3.3.2): the first and the last chunk hold one
    block fewer than the others (they also hold the embedding and the LM head), so
    layers + 2 must split evenly: 126 blocks on 16 stages are 7, 8 x 14, 7."""
    if n_chunks < 2 or (layers + 2) % n_chunks or (layers + 2) // n_chunks < 2:
        raise ConfigError("stage_layout", f"first-last-fewer ({layers} layers, {n_chunks} "
                          "chunks)", "needs layers + 2 divisible by the chunks, with at "
                          "least 2 blocks per middle chunk")
    per = (layers + 2) // n_chunks
    return (per - 1,) + (per,) * (n_chunks - 2) + (per - 1,)


def check_split(n_layers: int, n_chunks: int, sizes: Sequence[int] | None = None, *,
                field: str = "split", value: object = None, pp: int | None = None) -> None:
    """Raise ConfigError unless n_layers blocks split into n_chunks chunks (pp*virtual_stages),
    as `sizes` (blocks per chunk) if given: a split's shape rules. ``tessera.layout.validate``
    asks them of ``parallel.stage_layout`` (`field`, `value`; `pp` names parallel.pp's value),
    :func:`block_split` of its `split` argument."""
    if n_chunks > n_layers:
        raise ConfigError("parallel.pp", n_chunks if pp is None else pp,
                          f"pp*virtual_stages={n_chunks} stages exceed model.n_layers={n_layers} "
                          "(each stage needs a block)")
    if sizes is None:
        return
    value = sizes if value is None else value
    if len(sizes) != n_chunks:
        raise ConfigError(field, value, f"gives {len(sizes)} chunks; needs one per chunk, "
                          f"pp*virtual_stages={n_chunks}")
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(field, value, "every stage needs at least one block")
    if sum(sizes) != n_layers:
        raise ConfigError(field, value, f"holds {sum(sizes)} blocks; must add up to "
                          f"model.n_layers={n_layers}")


def block_split(cfg: ModelConfig, n_chunks: int, seq_len: int | None = None,
                split: Sequence[int] | None = None) -> list[int]:
    """Blocks in each of the n_chunks chunks: balanced by estimated cost, or `split`."""
    check_split(cfg.n_layers, n_chunks, split)
    if split is not None:
        return list(split)
    embed, blocks, head = layer_costs(cfg, seq_len or cfg.max_seq_len)
    return balance(blocks, n_chunks, embed, head)
