#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (ruff) and type-checks (mypy, configured in pyproject.toml), then runs
# the test suite on the CPU. Extra arguments go to pytest. A lint or type error fails the command before pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests kernels benchmarks examples
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
