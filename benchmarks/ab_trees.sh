#!/usr/bin/env bash
# A/B of two source trees on the device machine: this checkout against BASE (an exported older tree,
# e.g. `git archive REV | tar -x -C .ab/base`, carried), each installed into its own target, then
# benchmarks/throughput.py run from each tree in turn, ROUNDS rounds (base, new, base, new, ...).
# One line per run: offline output tok/s and batch-1 ms/token by the client's clock.
# Extra arguments after BASE ROUNDS go to every throughput.py run.
# Usage: bash benchmarks/ab_trees.sh .ab/base 2 --no-peer --no-floor --runs 1
set -uo pipefail
cd "$(dirname "$0")/.."
base=$1 rounds=$2; shift 2
out=${OUT:-results/ab}
mkdir -p "$out"
deps=/tmp/ab-deps
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$deps" .whl/*.whl \
  || { echo "dependency install failed"; exit 1; }
for name in base new; do
  tree=.; [ "$name" = base ] && tree=$base
  rm -rf "/tmp/ab-site-$name"
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "/tmp/ab-site-$name" "$tree" \
    || { echo "install of $name failed"; exit 1; }
done
export PYTHONUNBUFFERED=1 VLLM_ACTORS_LOG_LEVEL=${VLLM_ACTORS_LOG_LEVEL:-WARNING}
for round in $(seq 1 "$rounds"); do
  for name in base new; do
    tree=.; [ "$name" = base ] && tree=$base
    run="$name-$round"
    (cd "$tree" && PYTHONPATH="/tmp/ab-site-$name:$deps" timeout 240 python3 benchmarks/throughput.py \
       --out "/tmp/ab-$run" "$@") > "/tmp/ab-$run.log" 2>&1
    python3 - "/tmp/ab-$run/results.json" "$run" <<'PY' || { echo "$run failed"; tail -5 "/tmp/ab-$run.log"; }
import json, sys
report = json.load(open(sys.argv[1]))
ours = report.get("ours") or {}
batch1 = report.get("batch1_client") or {}
print(f"{sys.argv[2]:10s} offline {ours.get('tokens_per_s', float('nan')):10.1f} tok/s   "
      f"batch-1 {batch1.get('ms_per_token', float('nan')):.3f} ms/token   errors {report.get('errors')}")
PY
    cat "/tmp/ab-$run.log" >> "$out/ab.log"
    cp "/tmp/ab-$run/results.json" "$out/ab-$run.json" 2>/dev/null
  done
done
