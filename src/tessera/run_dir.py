"""A run directory belongs to one run: run ids, and the default output directory.

**Run id.** Every checkpoint's manifest names the run that wrote it (``run_id``), so that
pruning, ``--resume latest`` and an automatic restart never take another run's checkpoint
(``tessera.checkpoint``, ``run_start``). A run gets its id once, and every rank must
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

import dataclasses
import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tessera import checkpoint
from tessera.config import Config
from tessera.errors import ConfigError

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


def restart_count() -> int:
    """How many times the elastic launcher restarted this job (--max-restarts); 0 at first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def with_out_dir(cfg: Config) -> tuple[Config, bool]:
    """`cfg` with its output directory chosen where train.out_dir is empty
    (:func:`default_out_dir`), and whether that directory is a new one, to be made with
    :func:`begin_out_dir` once every check passed. ConfigError where the ranks of an outside
    launcher could not agree on one."""
    if cfg.train.out_dir:
        return cfg, False
    try:
        out, new = default_out_dir(cfg.train.resume, "RANK" in os.environ)
    except ValueError as e:
        raise ConfigError("train.out_dir", "", str(e)) from None
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out))), new


def begin_out_dir(cfg: Config) -> Config:
    """Make the new output directory :func:`with_out_dir` chose (the next free name if it was
    taken meanwhile; under a launcher, rank 0 makes it) and point runs/latest at it."""
    out = Path(cfg.train.out_dir)
    rank0 = os.environ.get("RANK", "0") == "0"
    if "RANK" not in os.environ:
        out = claim(out)
    elif rank0:
        out.mkdir(parents=True, exist_ok=True)
    if rank0 and (warning := point_latest(out)):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out)))


@dataclass(frozen=True)
class RunStart:
    """Where a run starts and which run it is (``tessera.run_dir``)."""

    resume_from: Path | None
    """The checkpoint it continues from; None: a fresh start."""
    run_id: str
    """Its run id, written in every checkpoint it saves."""
    others: list[Path]
    """Other runs' checkpoints under its checkpoint directory: refused (:func:`check_run_dir`),
    or deleted when it starts with train.overwrite."""


def run_start(cfg: Config) -> RunStart:
    """The checkpoint train.resume names ('latest': the newest of the run the checkpoint
    directory belongs to; None if there is none) and the run id: that checkpoint's, else the
    environment's (``run_dir.env_run_id``), else a new one. A restarted job continues from its
    own run's newest checkpoint under checkpoint_dir, if any, whatever train.resume says (a
    restart the environment gives no run id takes the directory's run for its own).

    Another run's checkpoints there (``checkpoint.other_runs``): for a new run (neither resumed
    nor restarted) every checkpoint, else those of another run id, and those written before run
    ids unless the run resumes. Reads manifests only; the same answer on every rank."""
    root = cfg.train.checkpoint_root
    named = None
    if cfg.train.resume == "latest":
        named = checkpoint.latest(root)
    elif cfg.train.resume:
        named = Path(cfg.train.resume)
    restarted = restart_count() > 0
    run_id = (checkpoint.run_id_of(named) if named is not None else None) or env_run_id()
    resume_from = named
    if restarted:
        own = checkpoint.latest(root, run_id)
        if own is not None:
            resume_from, run_id = own, run_id or checkpoint.run_id_of(own)
    run_id = run_id or new_run_id()
    fresh = named is None and not restarted
    others = checkpoint.other_runs(root, None if fresh else run_id, resume_from is not None)
    return RunStart(resume_from, run_id, others)


def resume_path(cfg: Config) -> Path | None:
    """The checkpoint this run continues from (:func:`run_start`), or None."""
    return run_start(cfg).resume_from


def check_run_dir(cfg: Config, start: RunStart) -> None:
    """Refuse to start where another run's checkpoints are, unless train.overwrite
    (ConfigError, before any collective)."""
    if not start.others or cfg.train.overwrite:
        return
    field, value, elsewhere = (
        ("train.checkpoint_dir", cfg.train.checkpoint_dir, "a new train.checkpoint_dir")
        if cfg.train.checkpoint_dir else ("train.out_dir", cfg.train.out_dir, "a new --out"))
    runs = sorted({checkpoint.run_id_of(p) or "from before run ids" for p in start.others})
    names = [p.name for p in start.others]
    shown = ", ".join(names if len(names) <= 3 else [names[0], "...", names[-1]])
    raise ConfigError(field, value, f"holds another run's checkpoints ({shown}; run "
                      f"{', '.join(runs)}): continue that run with --resume latest, delete them "
                      f"with --overwrite, or train into {elsewhere}")
