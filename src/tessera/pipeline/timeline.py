"""Pictures of a schedule: a text grid, a PNG timeline like the lecture figures, and a
Chrome/Perfetto trace.

:func:`text_grid` draws the simulator's timeline of a schedule under unit (or given) costs as
text, one row per rank. The PNG and the trace take a list of ``TimelineEvent``s, so the
simulator's timeline and a training run's measured one (``PipelineEngine.write_timeline``) are
drawn by the same code. In the PNG each device is a row; forward and backward boxes are
coloured by micro-batch (forward light, backward dark; a split backward's input-gradient
half I a mid shade, its weight-gradient half W the backward's shade, dotted) and numbered with
it; with several
chunks per device the chunk shows as a hatch and in the number (``3`` on chunk 0, ``3'`` on
chunk 1, ...); gaps are bubbles. Data-parallel communication is drawn in a thin lane under
each device: gradient reductions ('dp', ZeRO-3's 'reduce') as grey boxes in its lower half,
ZeRO-3 parameter all-gathers ('unshard') as blue boxes in its upper half, each labelled with
its chunk.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tessera.pipeline.schedule import Schedule
from tessera.pipeline.simulator import StageCosts, TimelineEvent, simulate

HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")
COMPUTE = ("F", "B", "I", "W")
"""Event kinds drawn as compute boxes."""
COMM = ("dp", "reduce", "unshard")
"""Event kinds drawn in the communication lane."""
GATHER_COLOR = (0.45, 0.65, 0.9)


def text_grid(schedule: Schedule, costs: StageCosts | None = None,
              cell: int | None = None) -> str:
    """Text grid, ranks × time: each compute action in the time slots the simulator gives it
    (``StageCosts.units``: F = B = 1, or F = I = W = 1 and B = 2 where backwards are split,
    unless `costs` is given); '.' marks a bubble. Labels are the action's string form, ``I3``
    and ``W3`` for a split backward's halves (``1I3`` with the chunk when ranks hold several).
    `cell`: the width of a slot (default: the widest label)."""
    result = simulate(schedule, costs or StageCosts.units(schedule))
    times = sorted({e.start for e in result.timeline} | {e.end for e in result.timeline})
    unit = min((b - a for a, b in zip(times, times[1:], strict=False) if b - a > 1e-12),
               default=1.0)
    n_slots = round(result.makespan / unit)
    show_chunk = schedule.n_chunks > schedule.n_ranks
    cells: list[list[str]] = [["."] * n_slots for _ in range(schedule.n_ranks)]
    for e in result.timeline:
        if e.kind not in COMPUTE:
            continue
        label = f"{e.chunk}{e.kind}{e.microbatch}" if show_chunk else f"{e.kind}{e.microbatch}"
        for slot in range(round(e.start / unit), round(e.end / unit)):
            cells[e.rank][slot] = label
    width = cell or max(len(c) for row in cells for c in row)
    rows = [f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip()
            for r, row in enumerate(cells)]
    return "\n".join(rows)


def write_png(events: Sequence[TimelineEvent], path: str | Path, *, title: str = "",
              n_ranks: int | None = None) -> Path:
    """Draw `events` (kinds 'F', 'B', 'I', 'W', 'dp', 'reduce', 'unshard'; others are ignored)
    as a PNG timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    boxes = [e for e in events if e.kind in (*COMPUTE, *COMM)]
    n_ranks = n_ranks or (max((e.rank for e in boxes), default=0) + 1)
    n_mb = max((e.microbatch for e in boxes), default=0) + 1
    chunks_by_rank: dict[int, list[int]] = {}
    for e in boxes:
        if e.kind not in COMM and e.chunk not in chunks_by_rank.setdefault(e.rank, []):
            chunks_by_rank[e.rank].append(e.chunk)
    local = {(r, c): i for r, cs in chunks_by_rank.items() for i, c in enumerate(sorted(cs))}
    virtual = max((len(cs) for cs in chunks_by_rank.values()), default=1)
    end = max((e.end for e in boxes), default=1.0)
    span = end - min((e.start for e in boxes), default=0.0)
    palette = plt.get_cmap("tab10" if n_mb <= 10 else "tab20")
    has_dp = any(e.kind in COMM for e in boxes)

    fig_w = min(24.0, max(8.0, 0.45 * len([e for e in boxes if e.kind not in COMM]) / n_ranks))
    fig, ax = plt.subplots(figsize=(fig_w, 0.7 * n_ranks + 1.4))
    for e in boxes:
        y = n_ranks - 1 - e.rank
        width = e.end - e.start
        if e.kind in COMM:
            gather = e.kind == "unshard"
            lo = y - 0.41 if gather else y - 0.48
            ax.broken_barh([(e.start, width)], (lo, 0.07),
                           facecolors=GATHER_COLOR if gather else "0.6",
                           edgecolor="0.3", linewidth=0.5)
            if e.kind != "dp" and width > span / 60:
                ax.text(e.start + width / 2, lo + 0.035, str(e.chunk), ha="center",
                        va="center", fontsize=5)
            continue
        color = shade(to_rgb(palette(e.microbatch % palette.N)), e.kind)
        lo = y - 0.3 if has_dp else y - 0.4
        chunk_index = local[(e.rank, e.chunk)]
        ax.broken_barh([(e.start, width)], (lo, 0.7 if not has_dp else 0.64),
                       facecolors=[color], edgecolor="black", linewidth=0.6,
                       linestyle=":" if e.kind == "W" else "-",
                       hatch=HATCHES[chunk_index % len(HATCHES)] if virtual > 1 else "")
        label = f"{e.microbatch}" + "'" * chunk_index
        if e.kind in ("I", "W"):
            label = e.kind + label
        if width > span / 150:
            ax.text(e.start + width / 2, lo + 0.35, label, ha="center", va="center",
                    fontsize=8 if width > span / 60 else 6,
                    color="black" if e.kind in ("F", "I") else "white")
    ax.set_yticks(range(n_ranks))
    ax.set_yticklabels([f"device {r}" for r in reversed(range(n_ranks))])
    ax.set_xlim(0, end * 1.01)
    ax.set_ylim(-0.6, n_ranks - 0.4)
    ax.set_xlabel("time")
    ax.set_title(title)
    legend = legend_handles({e.kind for e in boxes}, virtual)
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 if n_ranks > 2
                                                                   else -0.22),
              ncol=len(legend), frameon=False, fontsize=8)
    ax.grid(axis="x", alpha=0.2)
    return save_figure(fig, path)


def shade(base: tuple[float, float, float], kind: str) -> tuple[float, ...]:
    """A compute box's colour from its micro-batch's `base` colour: F light, I mid, B and W
    dark (W is told from B by its dotted edge and its label)."""
    if kind == "F":
        return tuple(0.55 + 0.45 * c for c in base)
    if kind == "I":
        return tuple(0.25 + 0.6 * c for c in base)
    return tuple(0.8 * c for c in base)


def legend_handles(kinds: set[str], virtual: int) -> list:
    """The legend: shade is forward/backward (and a split backward's I and W); with several
    chunks per device, hatching and primes are the chunk (not the direction)."""
    from matplotlib.patches import Patch

    blue = (0.15, 0.3, 0.5)
    legend = [Patch(facecolor=shade(blue, "F"), edgecolor="black", label="forward (light)")]
    if "B" in kinds or not kinds & {"I", "W"}:
        legend.append(Patch(facecolor=shade(blue, "B"), edgecolor="black",
                            label="backward (dark)"))
    if "I" in kinds:
        legend.append(Patch(facecolor=shade(blue, "I"), edgecolor="black",
                            label="input grad I (mid)"))
    if "W" in kinds:
        legend.append(Patch(facecolor=shade(blue, "W"), edgecolor="black", linestyle=":",
                            label="weight grad W (dark, dotted)"))
    if virtual > 1:
        legend += [Patch(facecolor="white", edgecolor="black", hatch=HATCHES[i % len(HATCHES)],
                         label=f"chunk {i}" + (" (" + "'" * i + ")" if i else ""))
                   for i in range(virtual)]
    legend.append(Patch(facecolor="white", edgecolor="none", label="blank = bubble"))
    if kinds & {"dp", "reduce"}:
        legend.append(Patch(facecolor="0.6", edgecolor="0.3", label="dp grad reduce"))
    if "unshard" in kinds:
        legend.append(Patch(facecolor=GATHER_COLOR, edgecolor="0.3",
                            label="param all-gather (UNSHARD)"))
    return legend


TRACE_SUFFIX = {"I": " (input grad)", "W": " (weight grad)"}
"""What a split backward's halves are called in the trace."""


def chrome_trace(events: Sequence[TimelineEvent], time_unit: float = 1.0) -> dict:
    """Trace Event Format (chrome://tracing, ui.perfetto.dev): one process per device, compute
    on thread 0 and communication on thread 1; `time_unit` seconds per event time unit."""
    trace: list[dict] = []
    ranks = sorted({e.rank for e in events})
    for r in ranks:
        trace.append({"name": "process_name", "ph": "M", "pid": r,
                      "args": {"name": f"device {r}"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0,
                      "args": {"name": "compute"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1,
                      "args": {"name": "communication"}})
    for e in events:
        name = (f"dp reduce chunk {e.chunk}" if e.kind == "dp" else
                f"reduce-scatter chunk {e.chunk}" if e.kind == "reduce" else
                f"all-gather chunk {e.chunk}" if e.kind == "unshard" else
                f"wait (chunk {e.chunk})" if e.kind == "wait" else
                f"{e.kind}{e.microbatch} chunk {e.chunk}" + TRACE_SUFFIX.get(e.kind, ""))
        trace.append({"name": name, "cat": e.kind, "ph": "X", "pid": e.rank,
                      "tid": 0 if e.kind in COMPUTE else 1,
                      "ts": e.start * time_unit * 1e6, "dur": (e.end - e.start) * time_unit * 1e6,
                      "args": {"microbatch": e.microbatch, "chunk": e.chunk}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Sequence[TimelineEvent], path: str | Path,
                       time_unit: float = 1.0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, time_unit)))
    return path


def save_figure(fig, path: str | Path) -> Path:
    """Lay `fig` out, write it to `path` (its folder made if missing) and close it: the one
    way tessera's pictures (timelines, planner plots) are saved."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
