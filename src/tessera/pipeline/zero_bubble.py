"""Zero-bubble schedules: the backward split into I (input gradient) and W (weight gradient).

Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (ICLR 2024): the previous stage waits only
for a stage's input gradient (I); the weight gradient (W) can run any time before the optimizer
step, so W fills what would otherwise be bubbles. With F = I = W (one unit each per chunk and
micro-batch; a B is I + W):

- ``zb-h1``: 1F1B's order (p-r-1 warm-up forwards on rank r), with B split into I and W and
  rank r deferring its W by r micro-batches (W(i - r) follows I(i)); the cool-down's W fill
  the gaps between the I that run down the pipeline. Bubble (p-1)/(3m) of the ideal step
  (1F1B's is (p-1)/m), in flight p - r + r = p sets on every rank counting a set until its W
  (``simulator.W_HELD``), 1F1B's largest (rank 0's).
- ``zb-v``: two chunks per rank in a V: rank r holds chunk r (down the pipeline) and chunk
  2p-1-r (back up), so the last rank turns a micro-batch around itself and the first rank
  holds both ends. Warm-up: 2(p-r)-1 forwards of the down chunk, r pairs (up F, down F), p-r
  triples (up F, I, W); steady state (down F, I, W, up F, I, W); cool-down r pairs (down I,
  up I), then p-r (down I, a deferred W), then the deferred W. Bubble about 0 for m >= 2p;
  2p (micro-batch, chunk) sets in flight at most, i.e. p full-rank sets: 1F1B's memory.
  Micro-batches fewer than 2p-1 take the order of 2p-1 with the missing ones left out.
- ``dualpipev`` (DeepSeek-V3's DualPipe folded onto p ranks, "DualPipeV"; Liu et al. 2024):
  the same V placement; its steady state pairs a forward of one micro-batch on one chunk with a
  full backward of another on the other chunk, which DualPipe overlaps (one's communication
  behind the other's compute). In this IR a pair is two adjacent actions, F then B: the
  simulator and runtime run them one after the other (no overlap is modelled). The warm-up and
  cool-down split backwards into I and W to fill gaps. Needs m >= 2p.

The orders follow the papers' figures and torch.distributed.pipelining's ZBV and DualPipeV
(``tests/test_zero_bubble.py`` compares them).
"""

from __future__ import annotations

from collections import deque

from tessera.pipeline.schedule import Action, B, F, I, W

Orders = list[list[Action]]


def v_placement(pp: int, n_chunks: int) -> tuple[int, ...]:
    """Chunk -> rank in a V over two chunks per rank: chunk c < p on rank c, chunk c >= p on
    rank 2p-1-c."""
    return tuple(c if c < pp else 2 * pp - 1 - c for c in range(n_chunks))


class _Rank:
    """One rank's order under construction: the next micro-batch of each chunk's forwards and
    backwards, and the W that wait (oldest first) after their I. (Plain dicts of ints: the
    planner generates these orders by the hundred.)"""

    def __init__(self, m: int):
        self.m = m
        self.order: list[Action] = []
        self.forwards: dict[int, int] = {}
        self.backwards: dict[int, int] = {}
        self.deferred: deque[tuple[int, int]] = deque()

    def f(self, chunk: int) -> None:
        mb = self.forwards.get(chunk, 0)
        self.forwards[chunk] = mb + 1
        self.order.append(F(chunk, mb))

    def i(self, chunk: int, w_now: bool = False) -> None:
        """The next input gradient of `chunk`; its W right after (`w_now`) or deferred."""
        mb = self.backwards.get(chunk, 0)
        self.backwards[chunk] = mb + 1
        self.order.append(I(chunk, mb))
        if w_now:
            self.order.append(W(chunk, mb))
        else:
            self.deferred.append((chunk, mb))

    def b(self, chunk: int) -> None:
        """The next full backward of `chunk`."""
        mb = self.backwards.get(chunk, 0)
        self.backwards[chunk] = mb + 1
        self.order.append(B(chunk, mb))

    def backward(self, chunk: int, split: bool) -> None:
        self.i(chunk) if split else self.b(chunk)

    def w(self, chunk: int | None = None) -> None:
        """The oldest deferred W (of `chunk`, if given), if any."""
        for k, (c, mb) in enumerate(self.deferred):
            if chunk is None or c == chunk:
                del self.deferred[k]
                self.order.append(W(c, mb))
                return

    def actions(self) -> list[Action]:
        """The order without micro-batches past m (generated as if there were more)."""
        if max(self.forwards.values(), default=0) <= self.m:
            return self.order
        return [a for a in self.order if a.microbatch < self.m]


def zb_h1_orders(pp: int, m: int, v: int) -> Orders:
    orders = []
    for r in range(pp):
        rank, warmup = _Rank(m), min(pp - r - 1, m)
        for _ in range(warmup):
            rank.f(r)
        for k in range(m):
            if k < m - warmup:
                rank.f(r)
            rank.i(r)
            if len(rank.deferred) > r:  # W waits until r more I have run
                rank.w()
        while rank.deferred:
            rank.w()
        orders.append(rank.actions())
    return orders


def zb_v_orders(pp: int, m: int, v: int) -> Orders:
    n = max(m, 2 * pp - 1)  # enough to fill the V; the extra ones are dropped
    orders = []
    for r in range(pp):
        down, up, rank = r, 2 * pp - 1 - r, _Rank(m)
        for _ in range(2 * (pp - r) - 1):
            rank.f(down)
        for _ in range(r):
            rank.f(up)
            rank.f(down)
        for _ in range(pp - r):
            rank.f(up)
            rank.i(up, w_now=True)
        # Steady state until every forward ran: p forwards of the up chunk so far, 2p-r-1 of
        # the down chunk.
        for k in range(n - pp):
            if k < n - (2 * pp - r - 1):
                rank.f(down)
            rank.i(down, w_now=True)
            rank.f(up)
            rank.i(up, w_now=True)
        for _ in range(r):
            rank.i(down)
            rank.i(up)
        for _ in range(pp - r):
            rank.i(down)
            rank.w(down)
        while rank.deferred:
            rank.w(up) if any(c == up for c, _ in rank.deferred) else rank.w(down)
        orders.append(rank.actions())
    return orders


def dualpipev_orders(pp: int, m: int, v: int) -> Orders:
    orders = []
    for r in range(pp):
        down, up, rank = r, 2 * pp - 1 - r, _Rank(m)
        for _ in range(2 * (pp - r - 1)):
            rank.f(down)
        for _ in range(r + 1):
            rank.f(down)
            rank.f(up)
        for _ in range(pp - r - 1):
            rank.i(up)
            rank.w()
            rank.f(up)
        for _ in range(m - 2 * pp + r + 1):  # the paired steady state: (F, B) (F, B)
            rank.f(down)
            rank.b(up)
            rank.f(up)
            rank.b(down)
        for _ in range(pp - r - 1):
            rank.b(up)
            rank.f(up)
            rank.b(down)
        # The last r+1 backwards of each chunk: full first, split from the middle on (on odd
        # ranks from the up chunk's, on even ranks from the down chunk's).
        split = False
        for k in range(r + 1):
            split = split or (k == (r + 1) // 2 and r % 2 == 1)
            rank.backward(up, split)
            split = split or (k == (r + 1) // 2 and r % 2 == 0)
            rank.backward(down, split)
        for _ in range(pp - r - 1):
            rank.w()
            rank.backward(down, split)
        while rank.deferred:
            rank.w()
        orders.append(rank.actions())
    return orders
