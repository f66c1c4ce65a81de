#!/usr/bin/env bash
# `make test`'s selection (every test but those marked `timing`) beside BUSY busy-loop
# processes (default 2), to show that no assertion of it reads a stopwatch: it must pass on a
# machine whose cores other jobs keep busy. The loops end with this script (and after
# BUSY_LIMIT seconds, default 3600, whatever happens to it).
#   benchmarks/busy_suite.sh                       # the whole `make test` selection
#   benchmarks/busy_suite.sh tests/test_ddp.py -x  # pytest's arguments instead of `tests`
# The package is this checkout's (PYTHONPATH=src); PYTHON picks the interpreter (default:
# .venv/bin/python as `make test` sets it up, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
BUSY=${BUSY:-2}
BUSY_LIMIT=${BUSY_LIMIT:-3600}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
loops=()
stop() { for pid in "${loops[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop EXIT
for _ in $(seq "$BUSY"); do
  timeout "$BUSY_LIMIT" "$PY" -c "while True: pass" &
  loops+=("$!")
done
echo "busy_suite: $BUSY busy loops (pids ${loops[*]}) beside pytest -m 'not timing' $*"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider \
  -m "not timing" "${@:-tests}"
