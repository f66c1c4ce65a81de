"""A run directory belongs to one run: run ids, and the default output directory.

**Run id.** Every checkpoint's manifest names the run that wrote it (``run_id``), so that
pruning, ``--resume latest`` and an automatic restart never take another run's checkpoint
(``tessera.checkpoint``, ``trainer.run_start``). A run gets its id once, and every rank must
hold the same one before any collective:

- a run that resumes a checkpoint keeps that checkpoint's id (every rank reads the same
  manifest); one written before run ids gives none, and the run takes a new one as below;
- else ``TESSERA_RUN_ID``: ``tessera train`` sets it, for the ranks it launches, to the id it
  resolved before the launch, and the elastic launcher hands the same environment to every
  restart, so the ranks and their restarts agree; set it yourself to name a run;
- else, under plain ``torchrun``, ``TORCHELASTIC_RUN_ID`` (the rendezvous id: a new uuid for
  each ``torchrun --standalone``, else ``--rdzv-id``, the same on every node and restart);
  torchrun's default ``none`` is no id;
- else a new ``<YYYYmmdd-HHMMSS>-<8 hex>`` on this process (a one-process run; ranks started
  by other means each draw their own, and only rank 0's is written). A restart without any of
  the above continues the run its checkpoint directory belongs to.

**Output directory.** Without ``--out`` (``train.out_dir`` empty) a run writes to a new
``runs/<YYYYmmdd-HHMMSS>`` (local time; ``-2``, ``-3`` … when that exists), chosen once by the
launching process and handed to the ranks (``tessera train`` adds it to their arguments, so a
restart reuses it), and ``runs/latest`` is a symbolic link to it, replaced atomically when a run
starts. ``--resume latest`` without ``--out`` continues the run ``runs/latest`` points to, in
its own directory. Under plain ``torchrun`` the directory is ``runs/<TORCHELASTIC_RUN_ID>``
(agreed by every rank, kept by restarts); with torchrun's default ``none`` it must be given.
A ``runs/latest`` that is a real directory (written by an older tessera) is left as it is,
with a warning.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

RUNS = Path("runs")
LATEST = RUNS / "latest"
RUN_ID_ENV = "TESSERA_RUN_ID"
ELASTIC_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def new_run_id() -> str:
    """A new run id: the local start time and 32 random bits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def env_run_id() -> str | None:
    """The run id the environment gives every rank: TESSERA_RUN_ID, else torchrun's
    rendezvous id (not its default ``none``); None if neither."""
    if given := os.environ.get(RUN_ID_ENV, "").strip():
        return given
    elastic = os.environ.get(ELASTIC_RUN_ID_ENV, "").strip()
    return elastic if elastic and elastic != "none" else None


def new_out_dir(stamp: str | None = None) -> Path:
    """A name for a new run's directory, ``runs/<YYYYmmdd-HHMMSS>[-N]`` (`stamp`: the local
    time now), free right now (not created: :func:`claim` creates it)."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    path, n = RUNS / stamp, 1
    while os.path.lexists(path):
        n += 1
        path = RUNS / f"{stamp}-{n}"
    return path


def latest_target() -> Path | None:
    """The directory ``runs/latest`` stands for: its link's target, itself where it is a real
    directory (an older tessera's), None where it does not exist."""
    if LATEST.is_symlink():
        target = Path(os.readlink(LATEST))
        return target if target.is_absolute() else RUNS / target
    return LATEST if LATEST.is_dir() else None


def default_out_dir(resume: str, under_launcher: bool) -> tuple[Path, bool]:
    """The output directory of a run given no ``--out``, and whether it is a new one (to be
    created with :func:`claim` once every check passed): see the module docstring. Raises
    ValueError (the rule) when the ranks of an outside launcher cannot agree on one."""
    if resume == "latest" and (target := latest_target()) is not None and target.is_dir():
        return target, False
    if not under_launcher:
        return new_out_dir(), True
    elastic = env_run_id()
    if elastic is None:
        raise ValueError(f"under torchrun without --rdzv-id (or {RUN_ID_ENV}) the ranks cannot "
                         "agree on a new directory: give --out DIR")
    return RUNS / elastic, not os.path.lexists(RUNS / elastic)


def claim(path: Path) -> Path:
    """Create the new run directory `path` (under runs/); where another run took that name
    since it was chosen, the next free ``-N``. Returns the directory created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    numbered = re.fullmatch(r"(.+)-(\d{1,3})", path.name)
    stamp, n = (numbered[1], int(numbered[2])) if numbered else (path.name, 1)
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = path.parent / f"{stamp}-{n}"


def point_latest(out: Path) -> str | None:
    """Make ``runs/latest`` a link to `out` (a directory under runs/), replacing the old link
    atomically. Returns a warning, and leaves it, where ``runs/latest`` is a real directory."""
    if LATEST.exists() and not LATEST.is_symlink():
        return (f"{LATEST} is a directory (from an older tessera), left as it is; this run "
                f"writes to {out}")
    tmp = RUNS / f".latest-{os.getpid()}.tmp"
    if os.path.lexists(tmp):
        tmp.unlink()
    os.symlink(out.name if out.parent == RUNS else os.path.abspath(out), tmp)
    os.replace(tmp, LATEST)
    return None


def out_dir_override(out: Path) -> list[str]:
    """The launched ranks' arguments that fix their output directory (last, so it wins)."""
    return ["--set", f"train.out_dir={json.dumps(str(out))}"]
