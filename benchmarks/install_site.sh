#!/usr/bin/env bash
# Installs the project and the wheels in .whl/ into a fresh folder and prints its path (a fresh target
# each time: pip keeps a stale copy when installing into an existing --target). Used by gpu_session.sh
# and, once for all its lanes, by lanes.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d /tmp/site-XXXXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl >&2
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$site" . >&2
echo "$site"
