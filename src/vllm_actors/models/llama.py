"""One torch decoder serving Llama and Qwen3 (Qwen3 = Llama + per-head RMSNorm on q and k), and
their mixture-of-experts kin Mixtral and Qwen3-MoE (a sparse MLP block, `models/moe.py`, in the
layers `ModelConfig.moe_layers` names).

Tokens of all sequences of a step are flattened to T (no padding); attention goes through the
paged backend of `vllm_actors.kernels.attention`. Parameter names follow Hugging Face's, so HF
state dicts load as they are.

Under tensor parallelism (``tp``, `models/parallel.py`) the modules are built from the rank's local
config (its heads, KV heads, intermediate size and vocabulary rows); ``o_proj`` and ``down_proj``
all-reduce their partial sums, the embedding is vocabulary-parallel and the logits are all-gathered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import structlog
import torch
from torch import nn

from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from vllm_actors.kernels.fused_ops import fuses_kv_write, qk_norm_rope
from vllm_actors.kernels.gemv import linear, silu_mul_linear
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.fused_all_reduce import SLOT_ATTN, SLOT_EMBED, SLOT_MLP
from vllm_actors.models.kv_scales import is_kv_scale_name, read_kv_scales
from vllm_actors.models.moe import SparseMoeBlock
from vllm_actors.models.parallel import Part, ShardLayout, TensorParallel, vocab_parallel_embedding
from vllm_actors.models.rope import RotaryFrequencies, rope_cos_sin, rope_frequencies

KVCache = tuple[torch.Tensor, torch.Tensor]

log = structlog.get_logger(__name__)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by (cos, sin) [T, D]; pairs are (i, i + D/2) (the HF "rotate half" layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, tp: TensorParallel, slot: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(sum + residual), sum + residual), ``sum`` being ``x`` summed over the ranks of
        ``tp`` (``x`` itself without a group): one fused pass (``TensorParallel.all_reduce_rms_norm``)."""
        return tp.all_reduce_rms_norm(x, self.weight, self.eps, residual, slot)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        """``config``: the rank's local config (its heads and KV heads)."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # q, k and v projections in one GEMM; loaded from the checkpoint's q_proj/k_proj/v_proj
        self.qkv_proj = nn.Linear(hidden, config.q_size + 2 * config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        # An fp8 KV cache's scales (float32, one element, on the device; plain attributes that
        # dtype casts leave alone), set by CausalLM.init_kv_scales; None for a cache in the model's dtype.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.calculate_kv_scales = False  # the next forward sets the scales from its k and v amax

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        q_weight = self.q_norm.weight if self.q_norm is not None else None
        k_weight = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        scales = None if self.k_scale is None or self.v_scale is None else (self.k_scale, self.v_scale)
        calculate = self.calculate_kv_scales and scales is not None
        # in place on the GPU, where the same launch also stores k and v in the cache (not while
        # the scales are calculated: from the rotated k, before anything is stored)
        fused = fuses_kv_write(q) and not calculate
        kv_write = (v, kv_cache[0], kv_cache[1], meta.slot_mapping) if fused else None
        q, k = qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, kv_write, scales)
        if calculate and scales is not None:
            kv_quant.calculate_kv_scales(k, v, *scales)
            self.calculate_kv_scales = False
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_written=fused,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip
        return linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj)  # this rank's partial sum


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        # gate and up projections in one GEMM; loaded from the checkpoint's gate_proj/up_proj
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_linear(linear(x, self.gate_up_proj), self.down_proj)  # this rank's partial sum


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None, index: int = 0) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.self_attn = Attention(config)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(config) if index in config.moe_layers else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        backend: AttentionBackend,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's MLP output (the embedding in the first layer: ``residual`` is
        None) and the residual stream before it; returns this layer's MLP output and the residual
        stream before that. Outputs are this rank's partial sums: each norm all-reduces its input
        and adds the residual first (one kernel on GPUs, `models/fused_all_reduce.py`)."""
        slot = SLOT_EMBED if residual is None else SLOT_MLP
        h, residual = self.input_layernorm(x, residual, self.tp, slot)
        h = self.self_attn(h, cos, sin, meta, kv_cache, backend)
        h, residual = self.post_attention_layernorm(h, residual, self.tp, SLOT_ATTN)
        return self.mlp(h), residual


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, tp, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama/Qwen3 causal LM over flattened, unpadded tokens with a paged KV cache."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend | None = None, tp: TensorParallel | None = None
    ) -> None:
        """``config``: the whole model's; ``tp``: this rank's place in a tensor-parallel group
        (its modules then hold its shard: ``local_config``)."""
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.layout = ShardLayout(config, self.tp.rank, self.tp.size)
        self.local_config = local = self.layout.local_config()
        self.model = Decoder(local, self.tp)
        self.lm_head = nn.Linear(local.hidden_size, local.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn_backend = attn_backend
        # kept out of the buffers so dtype casts and meta-device construction never touch it
        self._rope: RotaryFrequencies | None = None
        # per layer, the KV scales the checkpoint holds ({"k": k_scale, "v": v_scale}; load_from)
        self.checkpoint_kv_scales: dict[int, dict[str, float]] = {}
        self.kv_cache_dtype: torch.dtype | None = None  # the cache init_kv_scales prepared the layers for

    def _rope_frequencies(self, device: torch.device) -> RotaryFrequencies:
        if self._rope is None or self._rope.inv_freq.device != device:
            self._rope = rope_frequencies(self.config).to(device)
        return self._rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions: [T] long; returns final-norm hidden states [T, hidden]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} kv caches, got {len(kv_caches)}")
        if self.attn_backend is None:
            self.attn_backend = get_attention_backend(input_ids.device)
        cos, sin = rope_cos_sin(positions, self._rope_frequencies(positions.device))  # [T, D/2] float32
        meta = self.attn_backend.prepare(meta)
        x = vocab_parallel_embedding(input_ids, self.model.embed_tokens.weight, self.layout)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, cos, sin, meta, kv_cache, self.attn_backend, residual)
        return self.model.norm(x, residual, self.tp, SLOT_MLP)[0]

    def init_kv_scales(self, kv_cache_dtype: torch.dtype, calculated: bool = False) -> None:
        """Give every layer the scales of a cache of ``kv_cache_dtype``: none for the model's own
        dtype; for e4m3 the checkpoint's, else 1.0 (vLLM's default; ``calculated``: until the first
        step sets them, so no warning); for e5m2 always 1.0."""
        self.kv_cache_dtype = kv_cache_dtype
        if not kv_quant.is_fp8(kv_cache_dtype):
            for attn in self.attention_layers():
                attn.k_scale = attn.v_scale = None
            return
        device = self.lm_head.weight.device
        from_checkpoint = self.checkpoint_kv_scales if kv_quant.has_scales(kv_cache_dtype) else {}
        if kv_quant.has_scales(kv_cache_dtype) and not from_checkpoint and not calculated:
            log.warning("kv_scales_default", kv_cache_dtype=str(kv_cache_dtype), k_scale=1.0, v_scale=1.0,
                        note="the checkpoint has no k_scale/v_scale: calculate_kv_scales can set them")
        elif self.checkpoint_kv_scales and not from_checkpoint:
            log.info("kv_scales_ignored", kv_cache_dtype=str(kv_cache_dtype), note="fp8_e5m2 takes no scales")
        for index, attn in enumerate(self.attention_layers()):
            given = from_checkpoint.get(index, {})
            attn.k_scale, attn.v_scale = kv_quant.kv_scale_tensors(device, given.get("k", 1.0), given.get("v", 1.0))

    def calculate_kv_scales(self) -> None:
        """The next forward sets every layer's KV scales from its own k and v (vLLM's
        calculate_kv_scales); nothing without an e4m3 cache (init_kv_scales first)."""
        calculate = self.kv_cache_dtype is not None and kv_quant.has_scales(self.kv_cache_dtype)
        for attn in self.attention_layers():
            attn.calculate_kv_scales = calculate

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab] in the model's dtype (the sampler reads bfloat16 as it
        is, and converts to float32 only where it computes with them)."""
        if not self.tp.enabled:
            return linear(hidden, self.lm_head)
        return self.tp.all_gather_columns(linear(hidden, self.lm_head))[:, : self.config.vocab_size]

    # Checkpoint names that fill a slice of one merged parameter: (merged, part, index of the part).
    _MERGED = (
        ("self_attn.qkv_proj", "self_attn.q_proj", 0),
        ("self_attn.qkv_proj", "self_attn.k_proj", 1),
        ("self_attn.qkv_proj", "self_attn.v_proj", 2),
        ("mlp.gate_up_proj", "mlp.gate_proj", 0),
        ("mlp.gate_up_proj", "mlp.up_proj", 1),
    )

    def _merged_slice(self, merged: str, index: int) -> slice:
        c = self.local_config
        if merged.endswith("qkv_proj"):
            bounds = [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        else:
            bounds = [0, c.intermediate_size, 2 * c.intermediate_size]
        return slice(bounds[index], bounds[index + 1])

    def hf_named_weights(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's (Hugging Face) names: views into merged parameters."""
        named: dict[str, torch.Tensor] = {}
        experts: set[int] = set()  # the sparse blocks' parameters: named by the blocks themselves
        for index, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                named.update(layer.mlp.hf_named_weights(f"model.layers.{index}."))
                experts.update(id(param) for param in layer.mlp.parameters())
        for name, param in self.named_parameters():
            if id(param) in experts:
                continue
            parts = [(merged, part, index) for merged, part, index in self._MERGED if f".{merged}." in name]
            for merged, part, index in parts:
                named[name.replace(merged, part)] = param[self._merged_slice(merged, index)]
            if not parts:
                named[name] = param
        return named

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face-named state dict in place (q/k/v and gate/up into their merged
        parameters, this rank's shard of each); missing or unexpected names raise."""
        self.load_from(DictSource(state_dict))

    def load_from(self, source: TensorSource) -> None:
        """Read this rank's part of every weight from ``source`` (only that part: a safetensors
        source reads just those rows or columns); missing or unexpected names raise."""
        targets = self.hf_named_weights()  # tied weights appear once, as model.embed_tokens.weight
        given = {name: name for name in source.names() if not is_kv_scale_name(name)}
        self.checkpoint_kv_scales = read_kv_scales(source.names(), source, self.config.num_hidden_layers)
        if self.config.tie_word_embeddings:
            lm = given.pop("lm_head.weight", None)
            if "model.embed_tokens.weight" not in given and lm is not None:
                given["model.embed_tokens.weight"] = lm
        missing = sorted(set(targets) - set(given))
        unexpected = sorted(set(given) - set(targets))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
        with torch.no_grad():
            for name, source_name in given.items():
                target = targets[name]
                if self.layout.rank0_only(name) and self.tp.rank != 0:
                    target.zero_()  # a row-parallel bias counts once, on rank 0
                    continue
                part = self.layout.slice_of(name)
                shape = source.shape(source_name)
                expected = list(target.shape)
                if part is not None:
                    expected[part.dim] = part.full
                if shape != expected:
                    raise ValueError(f"{name}: shape {tuple(shape)} != expected {tuple(expected)}")
                tensor = source.read(source_name, part)
                rows = tensor.shape[0]  # the last rank's vocabulary shard may be short: zero rows pad it
                target[:rows].copy_(tensor)
                target[rows:].zero_()


class TensorSource(Protocol):
    """Checkpoint tensors by Hugging Face name, read whole or in part."""

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> list[int]: ...

    def read(self, name: str, part: Part | None) -> torch.Tensor: ...


class DictSource:
    """A state dict already in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str, part: Part | None) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor if part is None else tensor.narrow(part.dim, part.start, part.stop - part.start)
