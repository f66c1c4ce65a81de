"""The gradient noise scale, measured while training (McCandlish, Kaplan, Amodei et al., "An
Empirical Model of Large-Batch Training", 2018, Appendix A).

A minibatch gradient G_B over B samples has E|G_B|² = |G|² + tr(Σ)/B, where G is the true
gradient and Σ the per-sample gradients' covariance. Two batch sizes give two equations and
so unbiased estimates of both unknowns. Under data parallelism both come from one step:

- B_small = a replica's batch: the squared norm of its gradient before the data-parallel
  reduction (averaged over the replicas);
- B_big = the global batch: the squared norm of the reduced gradient.

    |G|²   ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ)  ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

Each is noisy (the |G|² estimate can even be negative), so, as the paper does, each is smoothed
with an exponential moving average before the ratio B_simple = tr(Σ)/|G|² is taken. B_simple
is in the unit of B: sequences (samples); ``noise_scale_tokens`` multiplies by the sequence
length (tokens of one sequence are not independent samples, so this is a unit conversion,
not a token-level measurement).

Where the squared norms come from (``tessera.step.Executor`` and ``ParallelModel``): each
data-parallel wrapper adds Σ g² of the gradient it is about to reduce, just before the
reduction starts (a DDP bucket before its all-reduce, a ZeRO unit before its all-reduce or
reduce-scatter: the buffer the collective reads, no copy), counting each element the way the
global norm does (TP shards on every tp rank, replicated pieces once). Those sums ride in the
collectives that already exist: the loss's all-reduce over dp (DDP), the norm's over tp and pp
(and dp under ZeRO). Gradients that are still partial when the dp reduction reads them (norm
gains under sequence parallelism, replicated kv heads, a tied embedding split over pp) are left
out of both norms, so the estimate covers every other parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA_DECAY = 0.99
"""Decay of the moving averages of |G|² and tr(Σ): about 1/(1 − 0.99) = 100 steps of memory.
On a problem with a known noise scale (tests/test_noise_scale.py) one step's B_simple at dp 2
scatters by tens of percent; 0.95 (20 steps) leaves ~25% spread, 0.99 ~10%."""
SETTLED_STEPS = 50
"""Steps of averaging before the estimate is used for a warning."""


def unbiased_estimates(small_sq: float, big_sq: float, b_small: float,
                       b_big: float) -> tuple[float, float]:
    """(|G|², tr(Σ)) from the mean squared norm of gradients over `b_small` samples and the
    squared norm of one gradient over `b_big` samples (Appendix A, eqs. A.2-A.3)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small}, {b_big}")
    g_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return g_sq, trace


def small_batch_sq(sum_sq: float, per_microbatch: bool, microbatches: int, batch: int,
                   dp: int) -> tuple[float, int]:
    """(mean |G_small|², B_small) from `sum_sq`, the squares of the local gradients the
    data-parallel wrappers read before reducing, summed over the dp replicas: one gradient of
    each replica's `microbatches` x `batch` sequences, or (`per_microbatch`, ZeRO-2/3) one per
    micro-batch of `batch` sequences, each scaled by 1/microbatches as the step's loss is."""
    if per_microbatch:
        return sum_sq * microbatches / dp, batch
    return sum_sq / dp, microbatches * batch


def noise_scale_unsupported(dp: int, cp: int, ep: int, dp_mode: str) -> str | None:
    """Why this layout cannot measure the noise scale, in a few words; None if it can."""
    if dp < 2:
        return "needs dp >= 2 (one replica has no second batch size to compare)"
    if cp > 1:
        return "not measured under cp > 1 (a cp rank's gradient covers part of each sequence)"
    if ep > 1:
        return "not measured under ep > 1 (experts see tokens of several replicas)"
    if dp_mode != "allreduce":
        return f"not measured under dp_mode={dp_mode} (no collective reduction to read)"
    return None


@dataclass
class NoiseScale:
    """Moving averages of the two estimates, and their ratio (bias-corrected as Adam's
    moments are, so the first steps are usable)."""

    decay: float = EMA_DECAY
    steps: int = 0
    _g_sq: float = 0.0
    _trace: float = 0.0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float,
               seq_len: int = 1) -> dict[str, float | None]:
        """Fold in one step's measurement; the record for the metrics: the smoothed
        ``grad_sq_est`` (|G|²), ``grad_trace_est`` (tr Σ) and ``noise_scale`` (B_simple in
        sequences; None while the |G|² average is not positive) and ``noise_scale_tokens``."""
        g_sq, trace = unbiased_estimates(small_sq, big_sq, b_small, b_big)
        self.steps += 1
        self._g_sq = self.decay * self._g_sq + (1 - self.decay) * g_sq
        self._trace = self.decay * self._trace + (1 - self.decay) * trace
        g_avg, trace_avg, scale = self.estimate()
        return {"noise_scale": scale,
                "noise_scale_tokens": scale * seq_len if scale is not None else None,
                "grad_sq_est": g_avg, "grad_trace_est": trace_avg}

    def estimate(self) -> tuple[float, float, float | None]:
        """(|G|², tr Σ, B_simple in sequences) from the averages so far, each average divided
        by 1 − decay^steps; B_simple is None while the |G|² average is not positive. Needs at
        least one step (:meth:`update`, or a state loaded from a checkpoint)."""
        if self.steps < 1:
            raise ValueError("no step averaged yet")
        correction = 1 - self.decay ** self.steps
        g_avg, trace_avg = self._g_sq / correction, self._trace / correction
        return g_avg, trace_avg, trace_avg / g_avg if g_avg > 0 else None

    def state_dict(self) -> dict[str, float | int]:
        """What the next update depends on, as plain numbers (a checkpoint's ``extra.json``):
        the decay, the steps averaged (the bias correction, and the warning's settling) and
        the two uncorrected averages. Every rank holds the same values (they come from
        all-reduced norms), and they carry over to any layout that measures: both averages
        estimate quantities of the model and data, not of B_small or B_big."""
        return {"decay": self.decay, "steps": self.steps, "g_sq": self._g_sq,
                "trace": self._trace}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Continue from `state` (:meth:`state_dict`); ValueError if it is malformed."""
        try:
            decay, steps = float(state["decay"]), int(state["steps"])
            g_sq, trace = float(state["g_sq"]), float(state["trace"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed noise-scale state {state!r} ({e})") from e
        if not 0 < decay < 1 or steps < 0:
            raise ValueError(f"malformed noise-scale state {state!r} (need 0 < decay < 1, "
                             "steps >= 0)")
        self.decay, self.steps, self._g_sq, self._trace = decay, steps, g_sq, trace


def critical_batch_line(global_batch: int, noise_scale: float) -> str:
    """The one-line warning for a global batch above the measured critical batch."""
    return (f"warning: global batch {global_batch} is above the measured critical batch "
            f"(noise scale {noise_scale:.0f} sequences): each step's extra samples are mostly "
            f"spent on averaging noise, and no learning rate buys them back (samples needed "
            f"grow as 1 + B/B_crit = {1 + global_batch / noise_scale:.2f}x)")
