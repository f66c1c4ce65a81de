"""Launch N local ranks through torch's elastic launcher (what `torchrun` runs).

`tessera train --nproc N ...` calls :func:`launch`, which runs ``python -m tessera.train ...``
on N ranks with a standalone rendezvous. For several machines, run torchrun yourself on each
(`torchrun --nnodes ... -m tessera.train ...`): the ranks are the same code either way.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import run as torchrun


def launch(nproc: int, train_argv: list[str]) -> int:
    """Run `python -m tessera.train *train_argv` on `nproc` local ranks; return an exit code."""
    parser = get_args_parser()
    # Without this, a training flag that prefixes a launcher flag (--virtual, of
    # --virtual-local-rank) is taken for the launcher's.
    parser.allow_abbrev = False
    args = parser.parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "tessera.train", *train_argv])
    try:
        torchrun(args)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()), None)
        code = first.exitcode if first is not None else 1
        print(f"error: {len(e.failures)} of {nproc} ranks failed (first exit code {code}); "
              "see their output above", file=sys.stderr)
        return code if code > 0 else 1
    return 0
