#!/usr/bin/env bash
# One lane of lanes.sh: its " && "-separated gpu_session.sh runs one after the other, each with its
# own output folder (DEST/partN, or DEST itself when there is one run); a `longctx` run without
# --append gets its own LONGCTX_DIR, one with --append adds to the table of the run before it.
#   bash benchmarks/lane_parts.sh DEST "longctx -- --engines ours vllm && longctx -- --block-size 128 --append"
set -uo pipefail
dest=$1; spec=$2
parts=()
while [[ $spec == *" && "* ]]; do parts+=("${spec%% && *}"); spec=${spec#* && }; done
parts+=("$spec")
status=0; n=0; longctx_dir=${LONGCTX_DIR:-/tmp/longctx}-0
for run in "${parts[@]}"; do
  where=$dest; [ ${#parts[@]} -gt 1 ] && where=$dest/part$n
  mkdir -p "$where"; echo "=== part $n: $run"
  # a run that does not --append to the table before it gets its own long-context folder
  [[ " $run " == *" --append "* ]] || longctx_dir=${LONGCTX_DIR:-/tmp/longctx}-$n
  # shellcheck disable=SC2086 # the stages and their arguments are word-split on purpose
  LONGCTX_DIR=$longctx_dir OUT=$where bash "$(dirname "$0")/gpu_session.sh" $run || status=1
  n=$((n + 1))
done
exit $status
