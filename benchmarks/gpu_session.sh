#!/usr/bin/env bash
# One GPU session on the device machine: install, then the stages asked for (default: all).
#   stages: tests (GPU-marked tests: kernels at full size, the engine vs transformers),
#           kernels (Triton vs torch microbenchmark), throughput (the nano-vllm workload; extra
#           arguments after `--` go to benchmarks/throughput.py), prefix (prefix caching on vs off
#           on a shared 2,000-token system prompt and on multi-turn chat, benchmarks/prefix.py;
#           results in $out/prefix; not in the default list, and extra arguments after `--` go to
#           it too, so name it alone when passing them),
#           vllm (install the vLLM peer from .vllmpeer/ into /tmp/vsite once its pieces are in
#           /tmp/vllmpeer: see ../shared/device/vllm-peer/fetch.sh; skipped when /tmp/vsite has it),
#           serve (the online benchmark, benchmarks/serve.py; extra arguments after `--` go to it;
#           results in $out/serve), events (the offline run with event publishing on, off, on, off:
#           benchmarks/throughput.py --no-peer --no-batch1 --no-floor [--no-events]; extra
#           arguments after `--` go to each run)
# Usage: bash benchmarks/gpu_session.sh tests kernels throughput -- --num-requests 64 --no-peer
#        bash benchmarks/gpu_session.sh vllm throughput -- --peer vllm --runs 2 --batch1-same-engine-only
#        bash benchmarks/gpu_session.sh vllm serve -- --engines vllm ours --rates 0.5 20 40 --duration 60
#        bash benchmarks/gpu_session.sh prefix -- --workloads shared --num-requests 128
# Results land in $OUT (the device tool's output folder) or results/gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
mkdir -p "$out"
# A fresh target each call: pip keeps a stale copy when installing into an existing --target.
site=$(mktemp -d /tmp/site-XXXXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  && python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$site" . \
  || { echo "install failed"; exit 1; }
export PYTHONPATH=$site PYTHONUNBUFFERED=1 VLLM_ACTORS_LOG_LEVEL=${VLLM_ACTORS_LOG_LEVEL:-WARNING}
stages=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do stages+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#stages[@]} -eq 0 ] && stages=(tests kernels throughput)
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$out/gpu.txt"
status=0
for stage in "${stages[@]}"; do
  echo "=== $stage"
  case "$stage" in
    tests) { timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/test_fused_ops.py
             timeout 420 python3 -m pytest -q -p no:cacheprovider --timeout 150 -m gpu tests/test_triton_kernels.py tests/test_gpu_engine.py
           } 2>&1 | tee "$out/tests.log" | tail -40 ;;
    fused) timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/test_fused_ops.py 2>&1 | tee "$out/fused.log" | tail -15 ;;
    kernels) python3 benchmarks/kernels.py --out "$out/kernels.json" 2>&1 | tee "$out/kernels.log" | tail -40 ;;
    profile) timeout 240 python3 benchmarks/profile_step.py ${PROFILE_ARGS:-} --out "$out/profile.json" 2>&1 | tee "$out/profile.log" | tail -150 ;;
    throughput) python3 benchmarks/throughput.py --out "$out/throughput" "$@" 2>&1 | tee "$out/throughput.log" | tail -60 ;;
    prefix) python3 benchmarks/prefix.py --out "$out/prefix" "$@" 2>&1 | tee "$out/prefix.log" | tail -40 ;;
    vllm) if PYTHONPATH=/tmp/vsite python3 -c 'import vllm' 2>/dev/null; then echo "vllm peer: already in /tmp/vsite"
          else bash .vllmpeer/assemble.sh; fi ;;
    serve) python3 benchmarks/serve.py --out "$out/serve" "$@" 2>&1 | tee "$out/serve.log" | tail -40 ;;
    events) for run in on-1 off-1 on-2 off-2; do
              flag=; [ "${run%-*}" = off ] && flag=--no-events
              python3 benchmarks/throughput.py --no-peer --no-batch1 --no-floor --out "/tmp/events-$run" $flag "$@" \
                > "/tmp/events-$run.log" 2>&1
              cp "/tmp/events-$run/results.json" "$out/events-$run.json"
              echo "events $run: $(grep -E 'ours: (output tok/s|every run)|error' "/tmp/events-$run.log" | tr -s ' ' | tr '\n' ' ')"
            done ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
done
exit $status
