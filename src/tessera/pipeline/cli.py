"""``tessera schedule``: print a pipeline schedule, its simulated bubble and memory, draw it.

    tessera schedule --schedule interleaved --pp 4 --microbatches 8 --virtual 2 --out runs/sched

prints the text grid (ranks × time, unit forward and backward; F = I = W = 1 for a schedule
with split backwards), the bubble fraction simulated with backward = 2 × forward
(``--backward-ratio``; split backwards: I = W = half of it) and its closed form, and each
rank's peak in-flight micro-batches (a split backward's set counted until its W); writes
``<name>.png`` (timeline) and ``<name>.trace.json`` (Chrome / Perfetto) to ``--out``.
``--file`` reads a custom schedule in the string form instead (``rank 0: 0F0 0F1 0B0 0B1``
lines) and validates it. ``--dp-reduce`` adds a data-parallel
gradient reduction per chunk (in forward-time units) to show what overlaps.

``--zero-stage 3`` adds ZeRO-3's sharding actions (``schedule.add_sharding_actions``): prints
each rank's actions with its UNSHARD / RESHARD / REDUCE_GRAD, the parameter all-gathers per
chunk per step and the most chunks gathered at once; ``--gather`` gives the all-gathers a
cost (forward-time units per rank's layers) so the simulator and pictures show them.
"""

from __future__ import annotations

from pathlib import Path

from tessera.errors import ConfigError
from tessera.pipeline.schedule import Kind, Schedule, add_sharding_actions, parse
from tessera.pipeline.schedules import build_schedule, closed_form_bubble, is_breadth_first
from tessera.pipeline.simulator import StageCosts, peak_unsharded, simulate, unshard_counts
from tessera.pipeline.timeline import text_grid, write_chrome_trace, write_png
from tessera.pipeline.validator import validate


def load_schedule(name: str, pp: int, microbatches: int, virtual: int,
                  file: str | None, group: int = 0) -> Schedule:
    """The named schedule (micro-batch groups of `group`, 0: its default), or the custom one in
    `file` (validated); errors are one line."""
    if file is None:
        try:
            return build_schedule(name, pp, microbatches, virtual, group)
        except ConfigError as e:
            flag = {"group": "--microbatch-group", "virtual": "--virtual"}.get(e.field_name)
            if flag:
                raise ConfigError(flag, e.value, e.rule) from None
            raise
    path = Path(file)
    if not path.is_file():
        raise ConfigError("--file", file, "file does not exist")
    return validate(parse(path.read_text(), name=path.stem))


def describe(schedule: Schedule, backward_ratio: float = 2.0, dp_reduce: float = 0.0,
             out: str | Path | None = None, zero_stage: int = 0, gather: float = 0.0,
             group: int = 0) -> str:
    """The report `tessera schedule` prints (and the pictures, if `out` is given)."""
    v, p, m = schedule.virtual, schedule.n_ranks, schedule.n_microbatches
    if zero_stage == 3 and not schedule.is_sharded:
        schedule = add_sharding_actions(schedule)
    costs = StageCosts(forward=1.0 / v, backward=backward_ratio / v, dp_reduce=dp_reduce / v,
                       unshard=gather / v)
    result = simulate(schedule, costs)
    units = ("forward = I = W = 1, B = I + W = 2" if schedule.split_backward
             else "forward = backward = 1")
    lines = [f"schedule {schedule.name}: pp={p} virtual={v} microbatches={m} "
             f"chunks={schedule.n_chunks}", "", text_grid(schedule),
             f"(grid: one column per unit of time, {units}; '.' is a bubble)", ""]
    closed = closed_form_bubble(schedule.name, p, m, v, group) if schedule.name in _registered() \
        else None
    split = ", split into I = W = half of it" if schedule.split_backward else ""
    line = (f"bubble fraction: {result.bubble_fraction:.4f} simulated "
            f"(backward = {backward_ratio:g} x forward{split}, free communication)")
    if closed is not None:
        line += f"; closed form {closed:.4f}"
    lines.append(line)
    lines.append("peak in-flight (micro-batch, chunk) activation sets per rank: "
                 + " ".join(str(x) for x in result.peak_inflight))
    if v > 1:
        lines.append(f"  = micro-batches' worth of a rank's activations (sets / v={v}): "
                     + " ".join(f"{x / v:g}" for x in result.peak_inflight))
    if schedule.is_sharded:
        lines += ["", *sharding_report(schedule)]
    if dp_reduce or gather:
        lines.append(f"step time {result.step_time:.3f} (forward-time units), of which "
                     f"{result.exposed_dp_time:.3f} exposed dp communication after the last "
                     f"compute")
    if out is not None:
        out = Path(out)
        stem = f"{schedule.name}_pp{p}_v{v}_m{m}"
        title = (f"{schedule.name}: pp={p}, v={v}, m={m}, bubble "
                 f"{result.bubble_fraction:.3f}")
        png = write_png(result.timeline, out / f"{stem}.png", title=title, n_ranks=p)
        trace = write_chrome_trace(result.timeline, out / f"{stem}.trace.json")
        lines.append(f"wrote {png} and {trace}")
    return "\n".join(lines)


def sharding_report(schedule: Schedule) -> list[str]:
    """The ZeRO-3 lines: each rank's actions, all-gathers per chunk, peak chunks gathered."""
    lines = ["ZeRO-3 sharding actions (UNSHARD = all-gather of the chunk's parameters, RESHARD = "
             "free, REDUCE_GRAD = reduce-scatter of its gradient):",
             *schedule.to_string().splitlines()[1:],
             "parameter all-gathers per step (UNSHARD per chunk), gradient reduce-scatters, "
             "most chunks gathered at once:"]
    peaks = peak_unsharded(schedule)
    for r, counts in enumerate(unshard_counts(schedule)):
        per_chunk = ", ".join(f"chunk {c}: {n}" for c, n in counts.items())
        reduces = sum(1 for a in schedule.actions[r] if a.kind is Kind.REDUCE_GRAD)
        lines.append(f"  rank {r}: {per_chunk} ({sum(counts.values())} all-gathers, {reduces} "
                     f"reduce-scatters), at most {peaks[r]} of {len(counts)} chunks gathered")
    if not is_breadth_first(schedule.name):
        lines.append(f"  ({schedule.name} is depth-first: training does not run these actions "
                     f"but ZeRO-3's per-micro-batch hooks, which gather each unit before every "
                     f"micro-batch's forward and backward and reduce-scatter after every "
                     f"backward; the actions above keep chunks gathered across short gaps "
                     f"instead, at the memory cost of the chunks gathered at once)")
    return lines


def _registered() -> set[str]:
    from tessera.pipeline.schedules import SCHEDULES

    return set(SCHEDULES)
