"""Read Hugging Face safetensors checkpoints (single file or sharded with an index json)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_actors.models.parallel import Part

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


class SafetensorsSource:
    """The checkpoint's tensors, read lazily: ``read(name, part)`` reads only that part's rows or
    columns from the memory-mapped file (what a tensor-parallel rank loads). A context manager:
    the files stay open until it exits."""

    def __init__(self, path: str | Path) -> None:
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}
        self.path = path
        for file in safetensors_files(path):
            handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in handle.keys():
                if name in self._files:
                    self._stack.close()
                    raise ValueError(f"tensor {name!r} appears in several shards of {path}")
                self._files[name] = handle

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def names(self) -> Iterable[str]:
        return self._files.keys()

    def shape(self, name: str) -> list[int]:
        return list(self._files[name].get_slice(name).get_shape())

    def read(self, name: str, part: Part | None) -> torch.Tensor:
        if part is None:
            return self._files[name].get_tensor(name)
        view = self._files[name].get_slice(name)
        if part.dim == 0:
            return view[part.start : part.stop]
        return view[:, part.start : part.stop]
