"""``benchmarks/long_context.py``'s contexts, its model directory and its decode floor.

Contexts are written as vLLM users say them: ``k`` is 1,024 tokens (128k = 131,072, a Llama-3
checkpoint's ``max_position_embeddings``) and ``M`` is 1,000,000 exactly (1M = 1,000,000 tokens);
a plain number is tokens. A context is the whole window of one request: its prompt is the context
less the output and a small margin (long_context_run.prompt_len), so the engines start with
``max_model_len`` = the largest context.

A context longer than the checkpoint's ``max_position_embeddings`` (1M on the Llama-3.2-1B shape,
128k on Qwen3-8B's 40,960) is reached the way vLLM needs it too: the model directory's config.json
gets ``max_position_embeddings`` = ``max_model_len`` (for ``--model DIR``, a directory of links to
DIR's files with the edited config.json). llama3 rope scaling does not read that field (it keeps
``original_max_position_embeddings``), so the model's arithmetic is unchanged; a Qwen3 shape keeps
plain RoPE unless ``--rope-scaling`` gives it yarn.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from benchmarks.lib.floor import ModelShape
from vllm_actors.bench.throughput_workload import MODEL_SHAPES, write_model_dir

LONG_CONTEXT = 512 * 1024  # from here on: one sample, no warm-up request at the context (by default)
DEFAULT_REPEATS = 3
_SCALES = {"": 1, "k": 1024, "m": 1_000_000}


def parse_context(text: str) -> int:
    """``"16k"`` -> 16,384; ``"1M"`` -> 1,000,000; ``"4096"`` -> 4,096."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if match is None:
        raise ValueError(f"context {text!r}: give tokens as N, Nk (N x 1,024) or NM (N x 1,000,000), "
                         "e.g. 4096, 16k, 128k, 1M")
    number, suffix = match.groups()
    tokens = Decimal(number) * _SCALES[suffix.lower()]
    if tokens != tokens.to_integral_value() or tokens < 1:
        raise ValueError(f"context {text!r} is not a whole number of tokens ({tokens})")
    return int(tokens)


def context_label(tokens: int) -> str:
    """The short name of a context: 131072 -> "128k", 1000000 -> "1M", 300 -> "300"."""
    if tokens % 1_000_000 == 0:
        return f"{tokens // 1_000_000}M"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return str(tokens)


def samples_plan(contexts: list[int], repeats: int | None, context_warmup: bool) -> tuple[list[int], list[int]]:
    """Samples and warm-up (1/0) per context: ``repeats`` for all if given, else 3 below
    ``LONG_CONTEXT`` and 1 from it on; a warm-up request at the context below ``LONG_CONTEXT`` only."""
    if repeats is not None and repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    counts = [repeats if repeats is not None else (DEFAULT_REPEATS if c < LONG_CONTEXT else 1) for c in contexts]
    warmups = [int(context_warmup and c < LONG_CONTEXT) for c in contexts]
    return counts, warmups


# --------------------------------------------------------------------------- the model directory
@dataclass(frozen=True)
class ModelSetup:
    path: str  # what every engine loads
    config: dict[str, Any]  # its config.json
    description: str
    overrides: dict[str, Any]  # what the benchmark changed in the checkpoint's config.json


def _link_checkpoint(source: Path, target: Path, config: dict[str, Any]) -> None:
    """``target``: links to every file of ``source`` but config.json, which is ``config``."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.name != "config.json":
            (target / entry.name).symlink_to(entry.resolve())
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def model_setup(model: str | None, shape: str, scratch: Path, max_model_len: int,
                rope_scaling: dict[str, Any] | None = None) -> ModelSetup:
    """The model directory for a run up to ``max_model_len`` tokens (see the module's docstring)."""
    if model is None:
        config = dict(MODEL_SHAPES[shape])
    else:
        config_file = Path(model) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"--model {model}: a Hugging Face directory with a config.json is needed")
        config = json.loads(config_file.read_text())
    overrides: dict[str, Any] = {}
    if rope_scaling is not None:
        overrides["rope_scaling"] = rope_scaling
    if max_model_len > int(config.get("max_position_embeddings") or 0):
        overrides["max_position_embeddings"] = max_model_len
    config = {**config, **overrides}
    raised = f", max_position_embeddings raised to {max_model_len}" if "max_position_embeddings" in overrides else ""
    if model is None:
        path = write_model_dir(scratch / f"{shape}-shape", config)
        return ModelSetup(str(path), config, f"{shape} shape, random weights{raised}", overrides)
    if not overrides:
        return ModelSetup(model, config, model, overrides)
    path = scratch / "model"
    _link_checkpoint(Path(model), path, config)
    return ModelSetup(str(path), config, f"{model}{raised}", overrides)


# --------------------------------------------------------------------------- the decode floor
def kv_dtype_bytes(kv_cache_dtype: str, dtype_bytes: int) -> int:
    return 1 if kv_cache_dtype.startswith("fp8") else dtype_bytes


@dataclass(frozen=True)
class DecodeFloor:
    """One decode step of one sequence on one GPU: the bytes it must read, and their time at the
    measured copy bandwidth."""

    context_tokens: float  # the KV read per step, averaged over the decode
    weight_bytes: float  # per GPU
    kv_bytes: float  # per GPU
    bandwidth: float
    ms_per_token: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_floor(shape: ModelShape, context_tokens: float, bandwidth: float, tensor_parallel_size: int = 1,
                 kv_cache_dtype: str = "auto") -> DecodeFloor:
    """Weights once plus the context's KV per step, per GPU: TP splits the weights and the KV heads
    (a head is replicated where there are fewer heads than ranks)."""
    if bandwidth <= 0 or tensor_parallel_size < 1:
        raise ValueError("bandwidth must be positive and tensor_parallel_size at least 1")
    weights = shape.weight_bytes_per_step / tensor_parallel_size
    kv_heads = max(1, shape.num_kv_heads // tensor_parallel_size)
    kv_per_token = shape.num_layers * 2 * kv_heads * shape.head_dim * kv_dtype_bytes(kv_cache_dtype, shape.dtype_bytes)
    kv = kv_per_token * context_tokens
    return DecodeFloor(context_tokens, weights, kv, bandwidth, (weights + kv) / bandwidth * 1e3)
