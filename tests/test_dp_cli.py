"""`tessera train` data-parallel flags: bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import pytest

from tessera.cli import main


@pytest.mark.parametrize(("args", "message"), [
    (["--dp-mode", "ps", "--nproc", "1"],
     "error: parallel.dp_mode='ps': a parameter server needs parallel.dp >= 2"),
    (["--dp-mode", "ps-async", "--dp", "1"],
     "error: parallel.dp_mode='ps-async': a parameter server needs parallel.dp >= 2"),
    (["--dp-mode", "sharded", "--nproc", "2"],
     "error: parallel.dp_mode='sharded': must be one of allreduce, ps, ps-async"),
    (["--bucket-mb", "0", "--nproc", "2"], "error: parallel.bucket_mb=0.0: must be > 0"),
    (["--set", "parallel.bucket_mb=-1", "--nproc", "2"], "error: parallel.bucket_mb=-1"),
    (["--allreduce-algorithm", "tree", "--nproc", "2"],
     "error: parallel.allreduce_algorithm='tree': must be one of backend"),
    (["--dp-mode", "ps-async", "--max-staleness", "0", "--nproc", "2"],
     "error: parallel.max_staleness=0: must be a positive integer"),
])
def test_bad_data_parallel_input(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--preset", "tiny", "--data", str(tmp_path), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert err.count("\n") == 1, err  # one line


def test_nproc_fills_dp_for_a_parameter_server():
    from tessera.cli import resolve_config

    flags = {"parallel": {"dp_mode": "ps"}}
    assert resolve_config("tiny", None, None, flags, nproc=3).parallel.dp == 3
    flags = {"parallel": {"dp_mode": "ps-async", "bucket_mb": 1.0}}
    assert resolve_config("tiny", None, None, flags, nproc=2).parallel.dp == 2
