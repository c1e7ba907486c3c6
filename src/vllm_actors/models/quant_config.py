"""FP8 weight checkpoints, read from config.json's ``quantization_config`` (no torch here).

Two writers of FP8 checkpoints are read, as vLLM reads them:

- ``quant_method: "fp8"`` (Qwen3's ``-FP8`` releases, DeepSeek's format): with ``weight_block_size``
  ``[bn, bk]`` every ``bn x bk`` block of a weight has one float32 scale, stored as
  ``<module>.weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]`` (the dequantized weight is
  ``weight * scale``: "inv" only in name); without it, one scale per tensor (``weight_scale``).
- ``quant_method: "compressed-tensors"`` (llm-compressor's ``float-quantized`` format): 8-bit float
  weights with a ``weight_scale`` per output channel (``strategy: channel``, ``[N, 1]``), per tensor
  (``strategy: tensor``) or per block (``strategy: block``, ``block_structure``).

Activations are quantized on the fly (``dynamic``): per token and group of ``bk`` inputs for block
scales, per token for the others. Static activation scales (``input_scale``) are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FP8_METHODS = ("fp8", "compressed-tensors")
STRATEGIES = ("block", "channel", "tensor")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 weights are scaled."""

    method: str  # quantization_config.quant_method: "fp8" or "compressed-tensors"
    strategy: str  # "block", "channel" or "tensor" (a tensor's scale is used as a per-channel one)
    scale_name: str  # the scale tensor's suffix beside ".weight": "weight_scale_inv" or "weight_scale"
    block_size: tuple[int, int] | None = None  # [rows, columns] of a scaled block (strategy "block")
    ignore: tuple[str, ...] = ()  # modules left unquantized: names, or "re:" regular expressions

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"FP8 weight strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if (self.strategy == "block") != (self.block_size is not None):
            raise ValueError(f"block_size is set for strategy 'block' only, got {self.block_size} "
                             f"for {self.strategy!r}")
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) < 1):
            raise ValueError(f"weight_block_size must be two positive sizes, got {list(self.block_size)}")

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint leaves ``module`` (a Hugging Face module name) unquantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern):
                return True
        return False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fp8Scheme:
        block = data.get("block_size")
        return cls(method=str(data["method"]), strategy=str(data["strategy"]), scale_name=str(data["scale_name"]),
                   block_size=None if block is None else (int(block[0]), int(block[1])),
                   ignore=tuple(str(p) for p in data.get("ignore", ())))


def fp8_scheme(config: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a Hugging Face config.json; None without ``quantization_config``. Any
    other quantization method, or FP8 with static activation scales, is a ValueError."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        return _native_fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise ValueError(f"unsupported quantization_config.quant_method {method!r}; supported: {', '.join(FP8_METHODS)} "
                     "(FP8 weights; GGUF files are read separately)")


def _native_fp8(quant: dict[str, Any]) -> Fp8Scheme:
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"FP8 activation_scheme {quant.get('activation_scheme')!r} is not supported: "
                         "only 'dynamic' (activations quantized per token or group at run time)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 fmt {quant.get('fmt')!r} is not supported: only 'e4m3'")
    ignore = tuple(quant.get("modules_to_not_convert") or ()) + tuple(quant.get("ignored_layers") or ())
    block = quant.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "tensor", "weight_scale", None, ignore)
    return Fp8Scheme("fp8", "block", "weight_scale_inv", (int(block[0]), int(block[1])), ignore)


def _compressed_tensors(quant: dict[str, Any]) -> Fp8Scheme:
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: only FP8 weights "
                         "('float-quantized')")
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: one config group is supported, got {len(groups)}")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors weights must be 8-bit float, got type={weights.get('type')!r} "
                         f"num_bits={weights.get('num_bits')!r}")
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(f"compressed-tensors weight strategy must be one of {STRATEGIES}, got {strategy!r}")
    if inputs is not None and not inputs.get("dynamic", False):
        raise ValueError("compressed-tensors static input scales are not supported: only dynamic activations")
    if inputs is not None and (inputs.get("type") != "float" or inputs.get("num_bits") != 8):
        raise ValueError("compressed-tensors input activations must be 8-bit float")
    block = weights.get("block_structure") if strategy == "block" else None
    return Fp8Scheme("compressed-tensors", strategy, "weight_scale",
                     None if block is None else (int(block[0]), int(block[1])), tuple(quant.get("ignore") or ()))
