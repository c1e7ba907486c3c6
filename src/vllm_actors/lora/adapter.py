"""PEFT LoRA adapters on disk: ``adapter_config.json`` + ``adapter_model.safetensors``, checked
against the base model before anything is loaded, then read as this rank's shard.

Supported: LoRA (not DoRA, no bias, no ``modules_to_save``) on the attention projections (q, k, v,
o) and the dense MLP's (gate, up, down) of Llama-family models; ``lora_alpha / r`` scaling, or
``lora_alpha / sqrt(r)`` with ``use_rslora``; per-module ranks and alphas (``rank_pattern``,
``alpha_pattern``, by module name). The scaling is folded into B once, at load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_actors.models.config import ModelConfig

if TYPE_CHECKING:  # the clients (LLM, the server) check adapters without importing torch: ~1.5 s a process
    import torch

    from vllm_actors.models.parallel import ShardLayout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the engine's fused projections and the PEFT (Hugging Face) modules each holds, in output order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}
TARGETS = tuple(module for parts in FUSED_PARTS.values() for module in parts)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterNotFoundError(ValueError):
    """No adapter at the path (not a directory, or no adapter_config.json): vLLM answers 404 for it."""


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection: its tensors' names in the file, its rank and its scaling."""

    layer: int
    module: str  # the PEFT (Hugging Face) module name: q_proj, ..., down_proj
    a_name: str
    b_name: str
    rank: int
    scaling: float


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: every module it adapts (none of them loaded yet)."""

    path: str
    rank: int  # the largest of its modules' ranks
    modules: tuple[AdapterModule, ...]


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the whole (unsharded) model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size), "k_proj": (hidden, config.kv_size), "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def _read_config(path: Path) -> dict[str, Any]:
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not path.is_dir():
        raise AdapterNotFoundError(f"no LoRA adapter at {str(path)!r}: not a directory")
    if not config_file.is_file():
        raise AdapterNotFoundError(f"no LoRA adapter at {str(path)!r}: {config_file.name} is missing")
    try:  # the config first, as vLLM: a config that is not JSON is named before missing weights
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_file}: not a JSON adapter config ({error})") from error
    if not weights_file.is_file():
        raise ValueError(f"no LoRA adapter at {str(path)!r}: {weights_file.name} is missing")
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: a {config.get('peft_type')} adapter; only LoRA is supported")
    if config.get("use_dora"):
        raise ValueError(f"{path}: use_dora=True: this engine does not yet support DoRA")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{path}: fan_in_fan_out={config.get('fan_in_fan_out')} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"{path}: LoRA only supports modules_to_save being None, not {config['modules_to_save']}")
    return config


def _pattern_value(pattern: dict[str, Any], name: str, default: float) -> float:
    """PEFT's rank_pattern/alpha_pattern: the value of the first key that the module name ends with."""
    for key, value in (pattern or {}).items():
        if re.search(rf"(^|\.){key}$", name) or re.fullmatch(key, name):
            return float(value)
    return default


def read_adapter(path: str, base: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Check the adapter at ``path`` against the base model (names, shapes, ranks) reading only the
    file's header; ValueError with what is wrong, nothing loaded."""
    from safetensors import safe_open

    root = Path(path)
    config = _read_config(root)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    declared = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if any(isinstance(r, int) and r > max_lora_rank for r in declared):  # vLLM checks the config's ranks too
        raise ValueError(f"LoRA rank {max(declared)} is greater than max_lora_rank {max_lora_rank} ({path})")
    with safe_open(str(root / WEIGHTS_FILE), framework="numpy") as handle:  # the header only: no torch
        shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in shapes:
        match = _NAME.match(name)
        if match is None or match.group(3) not in TARGETS or _PARENT[match.group(3)] != match.group(2):
            raise ValueError(f"{path}: {name} adapts a module LoRA does not support here "
                             f"(supported: {', '.join(TARGETS)} of the decoder layers)")
        layer, module = int(match.group(1)), match.group(3)
        if layer >= base.num_hidden_layers:
            raise ValueError(f"{path}: {name} names layer {layer}; the base model has {base.num_hidden_layers}")
        if module in ("gate_proj", "up_proj", "down_proj") and layer in base.moe_layers:
            raise ValueError(f"{path}: {name} adapts a mixture-of-experts layer's MLP, which is not supported")
        pairs.setdefault((layer, module), {})[match.group(4)] = name
    if not pairs:
        raise ValueError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = []
    for (layer, module), names in sorted(pairs.items()):
        if set(names) != {"A", "B"}:
            raise ValueError(f"{path}: layer {layer} {module} has lora_{''.join(names)} without its pair")
        (rank, a_in), (b_out, b_rank) = shapes[names["A"]], shapes[names["B"]]
        want_in, want_out = module_shape(base, module)
        if a_in != want_in or b_out != want_out or b_rank != rank:
            raise ValueError(
                f"{path}: layer {layer} {module} has lora_A {shapes[names['A']]} and lora_B {shapes[names['B']]}; "
                f"the base model needs [r, {want_in}] and [{want_out}, r]: an adapter of another base model?")
        if rank > max_lora_rank:
            raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank} ({path})")
        peft_name = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        module_alpha = _pattern_value(config.get("alpha_pattern", {}), peft_name, alpha)
        scaling = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        modules.append(AdapterModule(layer, module, names["A"], names["B"], rank, scaling))
    return AdapterSpec(str(root), max(module.rank for module in modules), tuple(modules))


def load_adapter(spec: AdapterSpec, layout: ShardLayout) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (A [r, in], B [out, r]) of each module, float32 on the host, the scaling in B.
    Column-parallel projections (q, k, v, gate, up) split B's rows as the base weight's; row-parallel
    ones (o, down) split A's columns: each rank's partial product sums to the whole with the base's."""
    from safetensors import safe_open

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    with safe_open(str(Path(spec.path) / WEIGHTS_FILE), framework="pt") as handle:
        for module in spec.modules:
            a = handle.get_tensor(module.a_name).float()
            b = handle.get_tensor(module.b_name).float() * module.scaling
            part = layout.slice_of(f"model.layers.{module.layer}.{_PARENT[module.module]}.{module.module}.weight")
            if part is not None and part.dim == 0:
                b = b[part.start : part.stop]
            elif part is not None:
                a = a[:, part.start : part.stop]
            weights[(module.layer, module.module)] = (a.contiguous(), b.contiguous())
    return weights
