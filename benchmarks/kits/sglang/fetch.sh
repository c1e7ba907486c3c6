#!/usr/bin/env bash
# SGLang 0.5.17 as a side-by-side peer on the GPU machine (the newest SGLang whose wheel pins that
# machine's torch 2.11.0). Run here, in the project's root: downloads packages.txt's wheels into
# .sglpeer/ (git-ignored), packs them into one tar cut into 40 MiB pieces (the working tree, ~18 MB,
# travels with each piece under the device's 64 MiB a call). Then, on ONE warm device machine:
#   for each piece NN:  carry [".sglpeer/piece-NN"], command: mkdir -p /tmp/sglpeer && cp .sglpeer/piece-NN /tmp/sglpeer/
#   then the call that runs the peer: carry [".sglpeer/SHA256", ...] and start with
#   bash benchmarks/kits/sglang/assemble.sh   (or the `sglang` stage of benchmarks/gpu_session.sh)
# SGLang's packages go to /tmp/ssite, apart from the project's: each engine runs in its own process
# (PYTHONPATH=/tmp/ssite python3 -m sglang.launch_server ..., or `import sglang; sglang.Engine(...)`).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
here=$(cd "$(dirname "$0")" && pwd)
rm -rf .sglpeer && mkdir -p .sglpeer/wheels
plats=()
for n in 34 31 28 27 24 17; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
grep -v '^#' "$here/packages.txt" > .sglpeer/requirements.txt
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
  -d .sglpeer/wheels -r .sglpeer/requirements.txt 2> >(grep -v "is ignored: it is neither" >&2)
tar -C .sglpeer -cf .sglpeer/wheels.tar wheels && rm -rf .sglpeer/wheels
(cd .sglpeer && sha256sum wheels.tar > SHA256 && split -b 40M -d wheels.tar piece- && rm wheels.tar)
ls -1 .sglpeer; du -sh .sglpeer
