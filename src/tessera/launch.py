"""Launch N local ranks through torch's elastic launcher (what `torchrun` runs).

`tessera train --nproc N ...` calls :func:`launch`, which runs ``python -m tessera.train ...``
on N ranks with a standalone rendezvous. For several machines, run torchrun yourself on each
(`torchrun --nnodes ... -m tessera.train ...`): the ranks are the same code either way.

With ``max_restarts`` > 0 the launcher's agent restarts every rank when one fails (it exits
non-zero, is killed, or the watchdog of another rank names it silent); the restarted ranks see
``TORCHELASTIC_RESTART_COUNT`` > 0 and resume from the newest complete checkpoint
(``trainer.resume_path``).
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import run as torchrun

UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def launch(nproc: int, train_argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m tessera.train *train_argv` on `nproc` local ranks, restarting them all
    up to `max_restarts` times; return an exit code."""
    parser = get_args_parser()
    # Without this, a training flag that prefixes a launcher flag (--virtual, of
    # --virtual-local-rank) is taken for the launcher's.
    parser.allow_abbrev = False
    args = parser.parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
         "--module", "tessera.train", *train_argv])
    # The ranks' store is rank 0's, new for each attempt, not the rendezvous's own: shared,
    # it keeps the keys of the attempt before a restart, and a restarted rank can read the
    # dead ranks' addresses from them (gloo: "Connection refused"; pytorch/pytorch#135712).
    os.environ.setdefault(UNSHARED_STORE, "1")
    try:
        torchrun(args)
    except ChildFailedError as e:
        print(f"error: {failure_line(e, nproc, max_restarts)}", file=sys.stderr, flush=True)
        first = next(iter(e.failures.values()), None)
        code = first.exitcode if first is not None else 1
        return code if code > 0 else 1
    return 0


def failure_line(e: ChildFailedError, nproc: int, max_restarts: int) -> str:
    """One line naming each rank that failed in the last attempt and how it ended."""
    how = []
    for rank, failure in sorted(e.failures.items()):
        ended = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
                 else f"exit code {failure.exitcode}")
        how.append(f"rank {rank} {ended}")
    restarts = f" after {max_restarts} restart(s)" if max_restarts else ""
    return (f"{len(e.failures)} of {nproc} ranks failed{restarts} ({', '.join(how)}); see "
            "their output above")
