"""Tiny FP8 checkpoints, quantized here from a float32 one as the FP8 writers store them, and the
float32 checkpoint of their dequantized weights (the reference transformers runs).

``quantize_checkpoint(src, dst, "block")`` writes Qwen3-FP8's format (``quant_method: fp8``,
``weight_block_size``, ``weight_scale_inv``); ``"channel"`` and ``"tensor"`` write llm-compressor's
compressed-tensors ``float-quantized`` format (``weight_scale`` per output channel or per tensor).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (16, 16)  # small blocks: the tiny model's 64-wide projections hold several, also per TP=2 shard
UNQUANTIZED = "model.layers.0.mlp.down_proj"  # the block checkpoint leaves this one in float32


def _quantization_config(strategy: str, block: tuple[int, int]) -> dict[str, Any]:
    if strategy == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", UNQUANTIZED]}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                  "symmetric": True},
        }},
    }  # fmt: skip


def quantize_checkpoint(src: Path, dst: Path, strategy: str, block_size: tuple[int, int] = BLOCK) -> tuple[Path, Path]:
    """Write ``src``'s weights FP8-quantized to ``dst`` (``block_size``: of strategy "block") and their
    dequantized float32 values to ``dst``-dequantized (its config without the quantization); returns
    both directories."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_actors.kernels.fp8_gemm import dequantize_weight, quantize_weight

    reference = dst.with_name(dst.name + "-dequantized")
    for directory in (dst, reference):
        shutil.copytree(src, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    block = block_size if strategy == "block" else None
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if module == name or module.rpartition(".")[2] not in PROJECTIONS or (
                strategy == "block" and module == UNQUANTIZED):
            quantized[name] = dequantized[name] = tensor
            continue
        weight, scale = quantize_weight(tensor, block)
        if strategy == "tensor":  # one scale for the tensor: the largest row scale
            scale = scale.max().reshape(1)
            weight = (tensor / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        quantized[name] = weight
        quantized[f"{module}.{'weight_scale_inv' if strategy == 'block' else 'weight_scale'}"] = scale
        dequantized[name] = dequantize_weight(weight, scale, block)
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quantization_config(strategy, block_size)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst, reference
