#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and generates text with the embedded default model.
# Arguments go to `vllm-actors generate`; with none, a sample prompt is used.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- "What is the capital of France? Answer in one sentence." "Write a haiku about the sea."
fi
exec .venv/bin/vllm-actors generate "$@"
