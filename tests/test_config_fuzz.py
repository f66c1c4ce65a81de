"""Generated invalid inputs (tests/config_fuzz.py) end in one line, exit 2, no traceback.

The generator's 300 cases for a seed all pass when run once by hand (`python
tests/config_fuzz.py 300`); here a seeded sample of 40 runs in this process through the CLI's
entry function (`tessera.cli.main`, as the `tessera` script calls it), and two through a real
process, where the exit status and stderr are the operating system's.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from config_fuzz import CATEGORIES, cases
from tessera.cli import main

SEED = 2026
SAMPLE = cases(SEED, 40)


def _materialize(case, tmp_path, data: str) -> list[str]:
    for name, text in case.files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return case.resolve(str(tmp_path), data)


def _assert_one_error_line(code, stderr: str, label: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, f"{label}: exit {code}\n{stderr}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{label}:\n{stderr}"
    assert "Traceback" not in stderr, f"{label}:\n{stderr}"
    return lines[0]


def test_generator_makes_300_cases_in_every_category():
    drawn = cases(SEED, 300)
    assert len(drawn) == 300 and cases(SEED, 300) == drawn  # deterministic from the seed
    counts = Counter(c.category for c in drawn)
    assert set(counts) == {make.__name__ for make in CATEGORIES}  # round-robin: as even as can be
    assert max(counts.values()) - min(counts.values()) <= 1
    assert len({(c.label, tuple(c.argv)) for c in drawn}) >= 200  # mostly distinct


@pytest.mark.parametrize("index", range(len(SAMPLE)), ids=[c.label for c in SAMPLE])
def test_invalid_input_is_one_line_exit_2(index, tiny_data, tmp_path, capsys):
    case = SAMPLE[index]
    argv = _materialize(case, tmp_path, tiny_data)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    _assert_one_error_line(exit_.value.code, capsys.readouterr().err, case.label)
    assert not (tmp_path / "out").exists()  # refused before anything ran


# Click's own parsing, and a config file (tests/test_cli.py has a layout rule's).
REAL_PROCESS = [["--tp", "abc"], ["--config", "{dir}/run.yaml"]]


@pytest.mark.slow
@pytest.mark.parametrize("extra", REAL_PROCESS, ids=["flag-type", "yaml"])
def test_invalid_input_in_a_real_process(extra, tiny_data, tmp_path):
    (tmp_path / "run.yaml").write_text("model: {d_model: 64\n")
    argv = [a.replace("{dir}", str(tmp_path)) for a in extra]
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--preset", "tiny",
                           "--data", tiny_data, "--out", str(tmp_path / "out"), *argv],
                          capture_output=True, text=True, timeout=120)
    _assert_one_error_line(proc.returncode, proc.stderr, " ".join(extra))
    assert proc.stdout == ""
