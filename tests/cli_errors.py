"""The CLI's bad-input contract, shared by the CLI tests: exit status 2, one line on stderr that
starts with ``error: ``, no traceback."""

from __future__ import annotations

from typer.testing import CliRunner

from tessera.cli import app


def cli_error(args: list[str]) -> str:
    """Run ``tessera *args``; assert the contract and return the error line."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]
