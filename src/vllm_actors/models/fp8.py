"""FP8 checkpoints (``models/quant_config.py``) in the model: projections that keep their float8
weights and scales (``Fp8Linear``, Triton FP8 GEMMs), or weights dequantized at load.

Where the FP8 GEMMs run (``VLLM_ACTORS_FP8_GEMM``: Triton on CUDA), ``use_fp8_linears`` replaces the
attention and dense MLP projections by ``Fp8Linear``s before the weights load; every other weight
the checkpoint quantized (the experts of a mixture-of-experts layer, an LM head, a projection whose
shard does not split into whole scale blocks) is dequantized by ``Fp8Source`` as it is read, into
the model's dtype. Elsewhere (the CPU) every weight is dequantized at load.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog
import torch
from torch import nn

from vllm_actors.envs import envs
from vllm_actors.kernels import choice, fp8_gemv, fp8_quant_fused
from vllm_actors.kernels.fp8_gemm import (
    FP8_DTYPE,
    HAVE_TRITON,
    GemmPlan,
    QuantizedActivations,
    dequantize_weight,
    fp8_linear,
    fp8_linear_quantized,
    gemm_plan,
    gemv_rows,
    quantize_weight,
    weight_groups,
)
from vllm_actors.kernels.fused_ops import silu_and_mul, use_triton
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.parallel import Part, TensorParallel
from vllm_actors.models.quant_config import Fp8Scheme
from vllm_actors.models.tensor_source import TensorSource

log = structlog.get_logger(__name__)

# The projections that may stay FP8: (module attribute path in a layer, the checkpoint's parts of it)
_PROJECTIONS = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.o_proj", ("self_attn.o_proj",)),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.down_proj", ("mlp.down_proj",)),
)


def keeps_fp8(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on ``device`` (the Triton GEMMs; else dequantized at load)."""
    return choice.use_triton("VLLM_ACTORS_FP8_GEMM", HAVE_TRITON, device)


class Fp8Linear(nn.Module):
    """A projection with a float8_e4m3fn weight ``[N, K]`` and float32 scales under the checkpoint's
    name (``weight_scale_inv`` per block, or ``weight_scale`` ``[N, 1]`` per output channel)."""

    def __init__(self, linear: nn.Linear, scheme: Fp8Scheme) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        device = linear.weight.device
        self.block = scheme.block_size
        self.scale_name = scheme.scale_name
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        group_n, group_k = weight_groups(self.weight.shape, self.block)
        scale = torch.empty(-(-out_features // group_n), -(-in_features // group_k), dtype=torch.float32,
                            device=device)
        self.register_parameter(self.scale_name, nn.Parameter(scale, requires_grad=False))
        self.bias = linear.bias

    @property
    def scales(self) -> torch.Tensor:
        scale: torch.Tensor = getattr(self, self.scale_name)
        return scale

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """``x``: the activations, or already quantized for this projection (``fused_plan``)."""
        if isinstance(x, QuantizedActivations):
            return fp8_linear_quantized(x, self.weight, self.scales, self.block, self.bias)
        return fp8_linear(x, self.weight, self.scales, self.block, self.bias)

    @property
    def group_k(self) -> int:
        """The activations' quantization group along K."""
        return weight_groups(self.weight.shape, self.block)[1]

    def fused_plan(self, x: torch.Tensor) -> GemmPlan | None:
        """The GEMM's plan where the producer of this projection's input (``x``'s rows, on its device)
        should quantize it itself (``VLLM_ACTORS_FP8_FUSED_QUANT``, the quantized path, the producers'
        Triton kernels), else None: the GEMV's rows, and CUDA-graph capture unless the setting says
        ``graphs``, keep the unfused path."""
        mode = envs.VLLM_ACTORS_FP8_FUSED_QUANT
        if (mode == "off" or x.dim() != 2 or x.shape[0] == 0 or x.stride(1) != 1 or not use_triton(x)
                or not fp8_quant_fused.takes(self.group_k, self.weight.shape[1])):
            return None
        if mode != "graphs" and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        plan = gemm_plan(x, self.weight, self.scales, self.block)
        return None if plan.gemv else plan

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))``; with ``VLLM_ACTORS_FP8_GEMV_SILU`` (off: slower, measured) the
        weight-only GEMV reads SiLU(gate) * up itself at one row."""
        if (gate_up.dim() == 2 and gate_up.shape[0] == 1 and gemv_rows() >= 1
                and gate_up.stride(1) == 1 and envs.VLLM_ACTORS_FP8_GEMV_SILU
                and fp8_gemv.takes(self.weight, self.scales, self.block)):
            return fp8_gemv.fp8_gemv(gate_up, self.weight, self.scales, self.block, self.bias, silu_mul=True)
        plan = self.fused_plan(gate_up)
        if plan is not None:  # SiLU(gate) * up written quantized for this GEMM
            return self(fp8_quant_fused.silu_mul_quant(gate_up, self.group_k, plan.layout))
        return self(silu_and_mul(gate_up))

    def init_dummy(self, generator: torch.Generator) -> None:
        """Random weights as ``init_dummy_weights`` draws them (normal(0, 0.02)), quantized."""
        drawn = torch.empty(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        drawn.normal_(0.0, 0.02, generator=generator)
        weight, scale = quantize_weight(drawn, self.block)
        self.weight.copy_(weight)
        self.scales.copy_(scale)


def fp8_input(owner: nn.Module, name: str) -> Fp8Linear | None:
    """``owner``'s projection ``name`` where its input may come quantized by the norm before it: an
    ``Fp8Linear`` with the fused quantization on and no LoRA adapters (they read the activations)."""
    linear = getattr(owner, name, None)
    if (not isinstance(linear, Fp8Linear) or getattr(owner, "lora", None) is not None
            or envs.VLLM_ACTORS_FP8_FUSED_QUANT == "off"):
        return None
    return linear


def rms_norm_quant_for(
    linear: Fp8Linear, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    tp: TensorParallel,
) -> tuple[QuantizedActivations, torch.Tensor] | None:
    """``tp.all_reduce_rms_norm(x, ...)`` with the normed rows quantized for ``linear`` in the same
    kernel, or None where ``linear`` takes its input unquantized or the all-reduce fuses the norm."""
    if tp.fused is not None and tp.fused.fits(x):  # the all-reduce's kernel norms: not fused here
        return None
    plan = linear.fused_plan(x)
    if plan is None:
        return None
    return fp8_quant_fused.rms_norm_quant(tp.all_reduce(x), weight, eps, residual, linear.group_k, plan.layout)


def _whole_blocks(part_rows: list[int], cols: int, split_cols: bool, scheme: Fp8Scheme) -> bool:
    """Whether each checkpoint part of a projection (this rank's rows of it) is whole scale blocks, and
    its columns too when a rank holds a slice of them: then the parts' scales stack into one tensor
    and a rank's scales are whole rows or columns of the checkpoint's."""
    if scheme.block_size is None:
        return True
    group_n, group_k = scheme.block_size
    return all(rows % group_n == 0 for rows in part_rows) and (not split_cols or cols % group_k == 0)


def use_fp8_linears(model: nn.Module, config: ModelConfig, scheme: Fp8Scheme, tp_size: int) -> None:
    """Replace the layers' attention and dense MLP projections by ``Fp8Linear``s (before the model's
    parameters are materialised), except those the checkpoint leaves unquantized and those whose
    parts or shard are not whole scale blocks (those load dequantized). ``config``: the rank's
    local config."""
    part_rows = {
        "self_attn.qkv_proj": [config.q_size, config.kv_size, config.kv_size],
        "self_attn.o_proj": [config.hidden_size],
        "mlp.gate_up_proj": [config.intermediate_size] * 2,
        "mlp.down_proj": [config.hidden_size],
    }
    kept, dequantized = 0, []
    for index, layer in enumerate(model.get_submodule("model.layers").children()):
        if not hasattr(layer, "self_attn"):  # a layer of another pipeline stage: a placeholder here
            continue
        for path, parts in _PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr, None)
            if not isinstance(linear, nn.Linear):
                continue  # a sparse MoE block: its experts load dequantized
            if any(scheme.ignores(f"model.layers.{index}.{part}") for part in parts):
                continue
            split_cols = tp_size > 1 and path in ("self_attn.o_proj", "mlp.down_proj")
            if not _whole_blocks(part_rows[path], linear.in_features, split_cols, scheme):
                dequantized.append(f"model.layers.{index}.{path}")
                continue
            setattr(owner, attr, Fp8Linear(linear, scheme))
            kept += 1
    if dequantized:
        log.info("fp8_modules_dequantized", count=len(dequantized), first=dequantized[0],
                 why="their parts or shard are not whole scale blocks")
    log.debug("fp8_modules", kept=kept, architecture=config.architecture)


def merged_rows(name: str, rows: slice, scheme: Fp8Scheme | None) -> slice:
    """The rows of a merged parameter ``name`` holding one checkpoint part (``rows`` in weight rows):
    of a block scale, those rows in blocks."""
    if scheme is None or scheme.block_size is None or not name.endswith("." + scheme.scale_name):
        return rows
    group_n = scheme.block_size[0]
    return slice(rows.start // group_n, rows.stop // group_n)


class Fp8Source:
    """A checkpoint's tensors as the model takes them: a quantized weight the model holds in FP8
    (``fp8_names``) with its scale (a per-tensor scale as a per-channel ``[N, 1]`` one); any other
    quantized weight dequantized into float32 as it is read, its scale hidden."""

    def __init__(self, source: TensorSource, scheme: Fp8Scheme, fp8_names: set[str]) -> None:
        self.source, self.scheme = source, scheme
        names = set(source.names())
        static = sorted(name for name in names if name.endswith(".input_scale"))
        if static:
            raise ValueError(f"static FP8 activation scales ({static[0]}, ...) are not supported: only dynamic "
                             "activations")
        self.quantized = {name for name in names if name.endswith(".weight") and self._scale_of(name) in names}
        plain = sorted(fp8_names - self.quantized)
        if plain:
            raise ValueError(f"{plain[0]} is not quantized in the checkpoint (no {self._scale_of(plain[0])}); "
                             "list its module in the quantization_config's ignore list")
        self.fp8_names = fp8_names
        self._hidden = {self._scale_of(name) for name in self.quantized - fp8_names}
        self._scales = {self._scale_of(name): name for name in fp8_names}

    def _scale_of(self, weight_name: str) -> str:
        return weight_name.removesuffix("weight") + self.scheme.scale_name

    def names(self) -> Iterable[str]:
        return [name for name in self.source.names() if name not in self._hidden]

    def shape(self, name: str) -> list[int]:
        weight = self._scales.get(name)
        if weight is not None and self.scheme.block_size is None:
            return [self.source.shape(weight)[0], 1]
        return self.source.shape(name)

    def read(self, name: str, part: Part | None) -> torch.Tensor:
        weight = self._scales.get(name)
        if weight is not None and self.scheme.block_size is None:  # one column of scales, one per row
            scale = self.source.read(name, None).float()
            rows = self.source.shape(weight)[0]
            column = scale.reshape(-1, 1).expand(rows, 1) if scale.numel() == 1 else scale.reshape(rows, 1)
            return column if part is None else column[part.start : part.stop]
        if name in self.quantized and name not in self.fp8_names:
            return self._dequantized(name, part)
        return self.source.read(name, part)

    def _dequantized(self, name: str, part: Part | None) -> torch.Tensor:
        """float32 rows or columns of a quantized weight: of a block-scaled one, the whole blocks
        around ``part`` dequantized, then cut to it."""
        scale_name = self._scale_of(name)
        block = self.scheme.block_size
        if block is None:  # one scale, or one per row
            scale = self.source.read(scale_name, None)
            if scale.numel() > 1:
                scale = scale.reshape(-1, 1)
                if part is not None and part.dim == 0:
                    scale = scale[part.start : part.stop]
            return dequantize_weight(self.source.read(name, part), scale, None)
        if part is None:
            return dequantize_weight(self.source.read(name, None), self.source.read(scale_name, None), block)
        size = block[part.dim]
        first, last = part.start // size, -(-part.stop // size)
        whole = Part(part.dim, first * size, min(last * size, part.full), part.full)
        weight = self.source.read(name, whole)
        scale = self.source.read(scale_name, Part(part.dim, first, last, -(-part.full // size)))
        dequantized = dequantize_weight(weight, scale, block)
        return dequantized.narrow(part.dim, part.start - whole.start, part.stop - part.start)
