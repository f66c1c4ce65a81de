"""Entry point for launched ranks: ``torchrun --nproc-per-node N -m tessera.train [options]``.

Takes the same options as ``tessera train`` (without --nproc: the launcher sets the world).
"""

from tessera.cli import main

if __name__ == "__main__":
    import sys

    main(["train", *sys.argv[1:]])
