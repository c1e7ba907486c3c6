#!/usr/bin/env bash
# One lane of lanes.sh: its " && "-separated gpu_session.sh runs one after the other, each with its
# own output folder (DEST/partN, or DEST itself when there is one run).
#   bash benchmarks/lane_parts.sh DEST "longctx -- --engines ours vllm && longctx -- --block-size 128 --append"
set -uo pipefail
dest=$1; spec=$2
parts=()
while [[ $spec == *" && "* ]]; do parts+=("${spec%% && *}"); spec=${spec#* && }; done
parts+=("$spec")
status=0; n=0
for run in "${parts[@]}"; do
  where=$dest; [ ${#parts[@]} -gt 1 ] && where=$dest/part$n
  mkdir -p "$where"; echo "=== part $n: $run"
  # shellcheck disable=SC2086 # the stages and their arguments are word-split on purpose
  OUT=$where bash "$(dirname "$0")/gpu_session.sh" $run || status=1
  n=$((n + 1))
done
exit $status
