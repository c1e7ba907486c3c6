#!/usr/bin/env bash
# This engine against vLLM 0.26 and SGLang 0.5.17 on one warm device machine of two GPUs, the
# engines alternating (each alone on its GPU; a comparison never spans two GPUs). Once the kits'
# pieces are in /tmp/vllmpeer and /tmp/sglpeer (../shared/device/vllm-peer/fetch.sh,
# benchmarks/kits/sglang/fetch.sh), with .vllmpeer/ and .sglpeer/SHA256 carried:
#   bash benchmarks/peer_comparison.sh offline   # GPU 0: nano-vllm's workload + batch-1; GPU 1 at the same
#                                                # time: the shared-prefix workload (64 x 16 on 2,048 tokens)
#   bash benchmarks/peer_comparison.sh serve     # GPU 0: online rates $RATES (default 20 40 80), $DURATION s each
#   bash benchmarks/peer_comparison.sh tp2       # both GPUs: the Qwen3-8B shape at TP=2, offline + batch-1
# Each stage packs its results into $OUT/<stage>.tgz (the device brings back at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/peers}
mkdir -p "$out"
stage=${1:?offline, serve or tp2}
read -r -a peers <<< "${PEERS:-vllm sglang}"
session() {  # GPU(s), output folder, stages and arguments for gpu_session.sh
  local gpus=$1 dir=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus OUT=$dir bash benchmarks/gpu_session.sh "$@"
}
mkdir -p "$out/$stage"
OUT=$out/$stage bash benchmarks/gpu_session.sh vllm sglang > "$out/$stage/install.log" 2>&1
tail -3 "$out/$stage/install.log"
case "$stage" in
  offline)
    session 0 "$out/$stage/nano" throughput -- --peer "${peers[@]}" > "$out/$stage/nano.log" 2>&1 &
    session 1 "$out/$stage/prefix" throughput -- --workload shared-prefix --peer "${peers[@]}" --no-batch1 \
      --no-floor > "$out/$stage/prefix.log" 2>&1 &
    wait ;;
  serve)
    # shellcheck disable=SC2086
    session 0 "$out/$stage" serve -- --engines ours "${peers[@]}" --rates ${RATES:-20 40 80} \
      --duration "${DURATION:-30}" > "$out/$stage/serve-run.log" 2>&1 ;;
  tp2)
    session 0,1 "$out/$stage" throughput -- --model-shape qwen3-8b -tp 2 --peer "${peers[@]}" --no-floor --batch1-same-engine-only \
      > "$out/$stage/tp2.log" 2>&1 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
grep -h -E "tok/s|TTFT|ms/token|ours / |error|Error|settings|rate" "$out/$stage"/*.log "$out/$stage"/*/*.log 2>/dev/null \
  | grep -v "^\s*$" | tail -60
(cd "$out" && tar czf "$stage.tgz" "$stage" && rm -rf "$stage")
