#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (ruff), then runs the test suite on the CPU while mypy (configured
# in pyproject.toml) type-checks beside it: a lint error fails the command before pytest, a type error
# fails it after pytest (mypy from a cold cache takes half a minute of one core; run beside the suite it
# costs the run almost nothing). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests kernels benchmarks examples
mypy_log=$(mktemp)
.venv/bin/mypy > "$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
[ "$mypy_status" -eq 0 ] || { echo "mypy failed" >&2; exit "$mypy_status"; }
exit "$status"
