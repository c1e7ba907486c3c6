"""Read Hugging Face safetensors checkpoints (single file or sharded with an index json)."""

from __future__ import annotations

import json
from pathlib import Path

import structlog
import torch
from safetensors.torch import load_file

log = structlog.get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's *.safetensors files: those named by the index json if present, else all."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards listed in {index} are missing: {missing}")
    return files


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint directory, keyed by their HF names (on CPU)."""
    state: dict[str, torch.Tensor] = {}
    files = safetensors_files(path)
    for file in files:
        part = load_file(str(file), device="cpu")
        dup = set(part) & set(state)
        if dup:
            raise ValueError(f"tensors {sorted(dup)[:4]} appear in several shards of {path}")
        state.update(part)
    log.debug("hf_state_dict_loaded", path=str(path), files=len(files), tensors=len(state))
    return state
