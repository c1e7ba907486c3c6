#!/usr/bin/env bash
# Several gpu_session.sh runs at once, each on its own GPU of the device machine, then their outputs
# packed into one archive per lane ($OUT/laneN.tgz: a call brings back at most 8 files).
#   bash benchmarks/lanes.sh "0|longctx -- --engines ours vllm && longctx -- --block-size 128 --append" "1|tests prefillbench"
# A lane is "GPU|stages and arguments of gpu_session.sh"; its output in $OUT/laneGPU (packed), its
# console in laneGPU/console.log; LONGCTX_DIR is /tmp/longctx-GPU so that lanes keep apart. A lane still
# running after LANE_TIMEOUT seconds (default 560) is stopped, so that what it wrote is packed and comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
# One install for every lane: concurrent `pip install .` runs share its build folder and fail.
VA_SITE=$(bash benchmarks/install_site.sh) || { echo "install failed"; exit 1; }
export VA_SITE
pids=()
# Each lane pinned to its own share of the host's cores (LANE_PIN=0: not pinned): batch-1 decode of a small
# model is launch-bound, and lanes sharing cores slowed it by up to a third.
cores=$(nproc); share=$(( cores / $# )); index=0
for lane in "$@"; do
  gpu=${lane%%|*}; stages=${lane#*|}; name=${gpu//,/-}  # "2,3": two GPUs, lane2-3
  pin=(); if [ "${LANE_PIN:-1}" = 1 ] && [ "$share" -ge 2 ] && command -v taskset > /dev/null; then
    pin=(taskset -c "$(( index * share ))-$(( (index + 1) * share - 1 ))"); fi
  index=$(( index + 1 ))
  mkdir -p "$out/lane$name"
  # "a && b": gpu_session.sh runs a, then b, on the lane's GPUs, each in its own folder (partN), sharing
  # LONGCTX_DIR so that a later `longctx -- ... --append` adds to the earlier table.
  CUDA_VISIBLE_DEVICES=$gpu LONGCTX_DIR=/tmp/longctx-$name timeout --kill-after=10 "${LANE_TIMEOUT:-560}" \
    "${pin[@]}" bash benchmarks/lane_parts.sh "$out/lane$name" "$stages" > "$out/lane$name.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for lane in "$@"; do
  gpu=${lane%%|*}; name=${gpu//,/-}
  echo "=== lane $name: ${lane#*|}"; tail -25 "$out/lane$name.log"
  # the console goes into the archive too: a call brings back at most 8 files
  mv "$out/lane$name.log" "$out/lane$name/console.log"
  tar -C "$out" -czf "$out/lane$name.tgz" "lane$name" && rm -rf "${out:?}/lane$name"
done
exit $status
