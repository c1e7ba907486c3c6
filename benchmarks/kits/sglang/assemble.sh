#!/usr/bin/env bash
# On the GPU machine, from the repo root, once every .sglpeer/piece-NN is in /tmp/sglpeer/ (see fetch.sh):
# rebuild the wheel tar, check it against .sglpeer/SHA256, install SGLang's wheels into /tmp/ssite.
set -euo pipefail
src=/tmp/sglpeer
cat "$src"/piece-* > "$src/wheels.tar"
(cd "$src" && sha256sum -c --quiet "$OLDPWD/.sglpeer/SHA256") || { echo "sglang peer: pieces missing or corrupt; copy them again" >&2; exit 1; }
tar -C "$src" -xf "$src/wheels.tar" && rm "$src/wheels.tar"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ssite "$src"/wheels/*.whl
echo "sglang peer: installed into /tmp/ssite ($(ls "$src"/wheels | wc -l) wheels)"
