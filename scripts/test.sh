#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (ruff), then runs the test suite on the CPU while mypy (configured in
# pyproject.toml) type-checks beside it: mypy's cold run is about 45 s of one core, which the suite's
# waits on process starts leave free. Extra arguments go to pytest. A lint error fails the command before
# pytest; a type error fails it after (with mypy's report), whatever the tests gave. pytest-xdist runs
# the tests on one worker per core (at most 4; PYTEST_XDIST_AUTO_NUM_WORKERS sets another number, -n 0
# runs them in this process), each file whole on one worker so its module fixtures start once
# (tests/conftest.py orders the files). Extra arguments after these win (`-n 0`, a folder, `-k`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks examples
mypy_log=$(mktemp)
.venv/bin/mypy > "$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT  # also when pytest is interrupted
tests=0
.venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder "$@" || tests=$?
if ! wait "$mypy_pid"; then
  cat "$mypy_log"
  echo "mypy found type errors (above): failing the test command" >&2
  exit 1
fi
cat "$mypy_log"
exit "$tests"
