"""``tessera schedule``: print a pipeline schedule, its simulated bubble and memory, draw it.

    tessera schedule --schedule interleaved --pp 4 --microbatches 8 --virtual 2 --out runs/sched

prints the text grid (ranks × time, unit forward and backward), the bubble fraction simulated
with backward = 2 × forward (``--backward-ratio``) and its closed form, and each rank's peak
in-flight micro-batches; writes ``<name>.png`` (timeline) and ``<name>.trace.json`` (Chrome /
Perfetto) to ``--out``. ``--file`` reads a custom schedule in the string form instead
(``rank 0: 0F0 0F1 0B0 0B1`` lines) and validates it. ``--dp-reduce`` adds a data-parallel
gradient reduction per chunk (in forward-time units) to show what overlaps.
"""

from __future__ import annotations

from pathlib import Path

from tessera.pipeline.schedule import Schedule, parse, validate
from tessera.pipeline.schedules import build_schedule, closed_form_bubble
from tessera.pipeline.simulator import StageCosts, simulate
from tessera.pipeline.timeline import write_chrome_trace, write_png


def load_schedule(name: str, pp: int, microbatches: int, virtual: int,
                  file: str | None) -> Schedule:
    """The named schedule, or the custom one in `file` (validated); errors are one line."""
    if file is None:
        return build_schedule(name, pp, microbatches, virtual)
    from tessera.config import ConfigError

    path = Path(file)
    if not path.is_file():
        raise ConfigError("--file", file, "file does not exist")
    return validate(parse(path.read_text(), name=path.stem))


def describe(schedule: Schedule, backward_ratio: float = 2.0, dp_reduce: float = 0.0,
             out: str | Path | None = None) -> str:
    """The report `tessera schedule` prints (and the pictures, if `out` is given)."""
    v, p, m = schedule.virtual, schedule.n_ranks, schedule.n_microbatches
    costs = StageCosts(forward=1.0 / v, backward=backward_ratio / v, dp_reduce=dp_reduce / v)
    result = simulate(schedule, costs)
    lines = [f"schedule {schedule.name}: pp={p} virtual={v} microbatches={m} "
             f"chunks={schedule.n_chunks}", "", schedule.grid(),
             "(grid: one column per unit of time, forward = backward = 1; '.' is a bubble)", ""]
    closed = closed_form_bubble(schedule.name, p, m, v) if schedule.name in _registered() \
        else None
    line = (f"bubble fraction: {result.bubble_fraction:.4f} simulated "
            f"(backward = {backward_ratio:g} x forward, free communication)")
    if closed is not None:
        line += f"; closed form {closed:.4f}"
    lines.append(line)
    lines.append("peak in-flight (micro-batch, chunk) activation sets per rank: "
                 + " ".join(str(x) for x in result.peak_inflight))
    if v > 1:
        lines.append(f"  = micro-batches' worth of a rank's activations (sets / v={v}): "
                     + " ".join(f"{x / v:g}" for x in result.peak_inflight))
    if dp_reduce:
        lines.append(f"step time {result.step_time:.3f} (forward-time units), of which "
                     f"{result.exposed_dp_time:.3f} exposed dp reduction")
    if out is not None:
        out = Path(out)
        stem = f"{schedule.name}_pp{p}_v{v}_m{m}"
        title = (f"{schedule.name}: pp={p}, v={v}, m={m}, bubble "
                 f"{result.bubble_fraction:.3f}")
        png = write_png(result.timeline, out / f"{stem}.png", title=title, n_ranks=p)
        trace = write_chrome_trace(result.timeline, out / f"{stem}.trace.json")
        lines.append(f"wrote {png} and {trace}")
    return "\n".join(lines)


def _registered() -> set[str]:
    from tessera.pipeline.schedules import SCHEDULES

    return set(SCHEDULES)
