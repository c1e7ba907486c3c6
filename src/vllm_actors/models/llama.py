"""One torch decoder serving Llama and the dense families built like it: Qwen3 (per-head RMSNorm
on q and k), Qwen2 (q/k/v bias), Mistral (sliding window), Gemma 2 and Gemma 3's text model (soft
caps, sliding layers, a scaled embedding, GELU, (1 + w) norms around each block; Gemma 3 also q/k
norms and a second rotary base for its sliding layers); and the mixture-of-experts kin Mixtral
and Qwen3-MoE (a sparse MLP block, `models/moe.py`, in the layers `ModelConfig.moe_layers` names).
The options come from `ModelConfig` (`models/families.py` reads them from config.json).

Tokens of all sequences of a step are flattened to T (no padding); attention goes through the
paged backend of `vllm_actors.kernels.attention`. Parameter names follow Hugging Face's, so HF
state dicts load as they are.

Under tensor parallelism (``tp``, `models/parallel.py`) the modules are built from the rank's local
config (its heads, KV heads, intermediate size and vocabulary rows); ``o_proj`` and ``down_proj``
all-reduce their partial sums, the embedding is vocabulary-parallel and the logits are all-gathered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from vllm_actors.kernels.fused_ops import fuses_kv_write, qk_norm_rope, silu_and_mul
from vllm_actors.kernels.gemv import linear, silu_mul_linear
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.fp8 import Fp8Linear, QuantizedActivations, fp8_input, merged_rows, rms_norm_quant_for
from vllm_actors.models.fused_all_reduce import SLOT_ATTN, SLOT_EMBED, SLOT_MLP
from vllm_actors.models.kv_scales import KvScaleSetup
from vllm_actors.models.llama_weights import CheckpointWeights
from vllm_actors.models.moe import SparseMoeBlock
from vllm_actors.models.parallel import ShardLayout, TensorParallel, vocab_parallel_embedding
from vllm_actors.models.pipeline import PipelineStage
from vllm_actors.models.rope import RotaryFrequencies, rope_cos_sin, rope_frequencies
from vllm_actors.models.tensor_source import DictSource, TensorSource

__all__ = ["CausalLM", "DictSource", "TensorSource"]

KVCache = tuple[torch.Tensor, torch.Tensor]
_LOCAL = TensorParallel()  # a norm over values already summed across the ranks: no all-reduce


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, tp: TensorParallel, slot: int,
        fp8_next: Fp8Linear | None = None,
    ) -> tuple[Any, torch.Tensor]:
        """(RMSNorm(sum + residual), sum + residual), ``sum`` being ``x`` summed over the ranks of
        ``tp`` (``x`` itself without a group): one fused pass (``TensorParallel.all_reduce_rms_norm``).
        ``fp8_next``: the FP8 projection the output feeds, for which the norm may write it quantized
        (``QuantizedActivations``, `models/fp8.py` ``rms_norm_quant_for``)."""
        if fp8_next is not None:
            fused = rms_norm_quant_for(fp8_next, x, self.weight, self.eps, residual, tp)
            if fused is not None:
                return fused
        return tp.all_reduce_rms_norm(x, self.weight, self.eps, residual, slot)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        """``config``: the rank's local config (its heads and KV heads); ``layer``: this layer's index."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_sliding_window(layer)
        self.logits_soft_cap = config.attn_logit_softcapping
        # Gemma 3's sliding layers rotate by their own base (CausalLM computes both)
        self.local_rope = config.local_rope_theta is not None and config.layer_types is not None and (
            config.layer_types[layer] == "sliding_attention"
        )
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # q, k and v projections in one GEMM; loaded from the checkpoint's q_proj/k_proj/v_proj
        self.qkv_proj = nn.Linear(hidden, config.q_size + 2 * config.kv_size, bias=bias or config.qkv_bias)
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
        self.lora: Any = None  # LoRA adapters' hooks (lora/manager.py), when the engine serves them

    def forward(
        self,
        x: torch.Tensor | QuantizedActivations,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        qkv = linear(x, self.qkv_proj) if isinstance(x, torch.Tensor) else self.qkv_proj(x)
        t = qkv.shape[0]
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
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
        # the layer's options only where set: a backend written before them still serves the others
        options: dict[str, Any] = {}
        if self.sliding_window is not None:
            options["sliding_window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            options["logits_soft_cap"] = self.logits_soft_cap
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_written=fused,
            k_scale=self.k_scale, v_scale=self.v_scale, **options,
        )  # fmt: skip
        out = out.reshape(t, self.num_heads * self.head_dim)
        o = linear(out, self.o_proj)  # this rank's partial sum
        if self.lora is not None:
            self.lora.add("o", out, o)
        return o


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        # gate and up projections in one GEMM; loaded from the checkpoint's gate_proj/up_proj
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gelu = config.hidden_activation == "gelu_pytorch_tanh"
        self.lora: Any = None  # LoRA adapters' hooks (lora/manager.py), when the engine serves them

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj) if isinstance(x, torch.Tensor) else self.gate_up_proj(x)
        if self.lora is not None:
            assert isinstance(x, torch.Tensor)  # `fp8_input`: never quantized under adapters
            return self._forward_lora(x, gate_up)
        if self.gelu:  # Gemma: gelu(gate, tanh approximation) * up
            gate, up = gate_up.chunk(2, dim=-1)
            return linear(F.gelu(gate, approximate="tanh") * up, self.down_proj)
        return silu_mul_linear(gate_up, self.down_proj)  # this rank's partial sum

    def _forward_lora(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """The same with the adapters' products added to gate_up and down (the activation kept)."""
        self.lora.add("gate_up", x, gate_up)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.gelu(gate, approximate="tanh") * up
        else:
            hidden = silu_and_mul(gate_up)
        out = linear(hidden, self.down_proj)
        self.lora.add("down", hidden, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None, layer: int = 0) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.self_attn = Attention(config, layer)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(config, layer) if layer in config.moe_layers else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Gemma: attention and MLP outputs normed before the residual add, the MLP's input by its own norm
        self.gemma_norms = config.gemma_norms
        if config.gemma_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        if self.gemma_norms:  # outputs are whole sums here: each post-norm all-reduces its input
            h, residual = self.input_layernorm(x, residual, _LOCAL, slot)
            h = self.self_attn(h, cos, sin, meta, kv_cache, backend)
            h = self.post_attention_layernorm(h, None, self.tp, SLOT_ATTN)[0]
            h, residual = self.pre_feedforward_layernorm(h, residual, _LOCAL, SLOT_ATTN)
            return self.post_feedforward_layernorm(self.mlp(h), None, self.tp, SLOT_MLP)[0], residual
        h, residual = self.input_layernorm(x, residual, self.tp, slot, fp8_input(self.self_attn, "qkv_proj"))
        h = self.self_attn(h, cos, sin, meta, kv_cache, backend)
        h, residual = self.post_attention_layernorm(h, residual, self.tp, SLOT_ATTN,
                                                    fp8_input(self.mlp, "gate_up_proj"))
        return self.mlp(h), residual


class MissingLayer(nn.Module):
    """A module another pipeline stage holds (vLLM's PPMissingLayer): no parameters here."""


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        """``stage``: this worker's pipeline stage; it builds only its layers (the embedding on the
        first stage, the final norm on the last), the others as ``MissingLayer``."""
        super().__init__()
        stage = stage or PipelineStage()
        own = stage.layers(config.num_hidden_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if stage.is_first else MissingLayer()
        self.layers = nn.ModuleList(DecoderLayer(config, tp, i) if i in own else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else MissingLayer()


class CausalLM(CheckpointWeights, KvScaleSetup):
    """Llama/Qwen3 causal LM over flattened, unpadded tokens with a paged KV cache."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend | None = None, tp: TensorParallel | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        """``config``: the whole model's; ``tp``: this rank's place in a tensor-parallel group
        (its modules then hold its shard: ``local_config``); ``stage``: its pipeline stage (its
        layers only; ``forward`` then takes and returns what passes between stages)."""
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage()
        self.layout = ShardLayout(config, self.tp.rank, self.tp.size)
        self.local_config = local = self.layout.local_config()
        self.model = Decoder(local, self.tp, self.stage)
        self.lm_head: nn.Module = nn.Linear(local.hidden_size, local.vocab_size, bias=False) \
            if self.stage.is_last else MissingLayer()
        self.tie_weights()
        self.attn_backend = attn_backend
        # kept out of the buffers so dtype casts and meta-device construction never touch it
        self._rope: RotaryFrequencies | None = None
        self._local_rope: RotaryFrequencies | None = None  # Gemma 3's sliding layers
        # per layer, the KV scales the checkpoint holds ({"k": k_scale, "v": v_scale}; load_from)
        self.checkpoint_kv_scales: dict[int, dict[str, float]] = {}
        self.kv_cache_dtype: torch.dtype | None = None  # the cache init_kv_scales prepared the layers for
        self.lora_batch: Any = None  # the step's LoRA slots per token (lora/slots.py), when adapters are served
        self.aux_hidden: Any = None  # EAGLE-3's hook on layers' input streams (models/eagle3.py), when it drafts

    @property
    def ties_embeddings(self) -> bool:
        """The LM head is the embedding (tied, and one stage holds both)."""
        return self.config.tie_word_embeddings and self.stage.is_first and self.stage.is_last

    def tie_weights(self) -> None:
        if self.ties_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def stage_layers(self) -> list[DecoderLayer]:
        """The decoder layers this stage holds, in order."""
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def _rope_frequencies(self, device: torch.device) -> RotaryFrequencies:
        if self._rope is None or self._rope.inv_freq.device != device:
            self._rope = rope_frequencies(self.config).to(device)
        return self._rope

    def _local_rope_frequencies(self, device: torch.device) -> RotaryFrequencies | None:
        theta = self.config.local_rope_theta
        if theta is not None and (self._local_rope is None or self._local_rope.inv_freq.device != device):
            local = dataclasses.replace(self.config, rope_theta=theta, rope_scaling=None)
            self._local_rope = rope_frequencies(local).to(device)
        return self._local_rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] long; returns final-norm hidden states [T, hidden]. A pipeline
        stage after the first takes ``intermediate`` (the previous stage's output and residual,
        [2, T, hidden]) instead of embedding ``input_ids``; one before the last returns its own."""
        layers = self.stage_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} kv caches, got {len(kv_caches)}")
        if self.attn_backend is None:
            self.attn_backend = get_attention_backend(input_ids.device)
        cos, sin = rope_cos_sin(positions, self._rope_frequencies(positions.device))  # [T, D/2] float32
        local = self._local_rope_frequencies(positions.device)
        local_cos, local_sin = (cos, sin) if local is None else rope_cos_sin(positions, local)
        meta = self.attn_backend.prepare(meta)
        if self.lora_batch is not None:
            self.lora_batch.begin(input_ids.shape[0])
        norm_tp = _LOCAL if self.config.gemma_norms else self.tp  # Gemma's layers take whole sums
        residual: torch.Tensor | None = None
        if intermediate is not None:
            x, residual = intermediate[0], intermediate[1]
        else:
            assert isinstance(self.model.embed_tokens, nn.Embedding)  # the first stage's
            x = vocab_parallel_embedding(input_ids, self.model.embed_tokens.weight, self.layout)
            if self.config.gemma_norms:
                x = self.tp.all_reduce(x) * self._embed_scale(x.dtype)
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if self.aux_hidden is not None:
                self.aux_hidden.take(index, x, residual)
            c, s = (local_cos, local_sin) if layer.self_attn.local_rope else (cos, sin)
            x, residual = layer(x, c, s, meta, kv_cache, self.attn_backend, residual)
        if self.aux_hidden is not None:
            self.aux_hidden.store(meta.slot_mapping)
        if not self.stage.is_last:
            assert residual is not None
            return torch.stack((x, residual))
        return self.model.norm(x, residual, norm_tp, SLOT_MLP)[0]

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """The embedding scale rounded to the model's dtype, as transformers multiplies by it."""
        return float(torch.tensor(self.config.embed_scale, dtype=dtype).item())

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.stage_layers()]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab] in the model's dtype (the sampler reads bfloat16 as it
        is, and converts to float32 only where it computes with them)."""
        assert isinstance(self.lm_head, nn.Linear)  # the last stage's
        logits = linear(hidden, self.lm_head)
        if self.tp.enabled:
            logits = self.tp.all_gather_columns(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
            if isinstance(layer, DecoderLayer) and isinstance(layer.mlp, SparseMoeBlock):
                named.update(layer.mlp.hf_named_weights(f"model.layers.{index}."))
                experts.update(id(param) for param in layer.mlp.parameters())
        for name, param in self.named_parameters():
            if id(param) in experts:
                continue
            parts = [(merged, part, index) for merged, part, index in self._MERGED if f".{merged}." in name]
            for merged, part, index in parts:  # (an FP8 block scale: those rows in blocks)
                rows = merged_rows(name, self._merged_slice(merged, index), self.config.quantization)
                named[name.replace(merged, part)] = param[rows]
            if not parts:
                named[name] = param
        return named
