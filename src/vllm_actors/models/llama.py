"""One torch decoder serving Llama and Qwen3 (Qwen3 = Llama + per-head RMSNorm on q and k).

Tokens of all sequences of a step are flattened to T (no padding); attention goes through the
paged backend of `vllm_actors.kernels.attention`. Parameter names follow Hugging Face's, so HF
state dicts load as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_actors.kernels.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from vllm_actors.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def rope_inv_freq(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2] (float32), with llama3 frequency scaling if configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope scaling {scaling}")
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between blended
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

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
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
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
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama/Qwen3 causal LM over flattened, unpadded tokens with a paged KV cache."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn_backend = attn_backend
        # kept out of the buffers so dtype casts and meta-device construction never touch it
        self._inv_freq: torch.Tensor | None = None

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = rope_inv_freq(self.config, device=device)
        return self._inv_freq

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
        inv_freq = self._rope_inv_freq(positions.device)
        angles = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, D/2], float32
        angles = torch.cat((angles, angles), dim=-1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv_cache, self.attn_backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face-named state dict in place; missing or unexpected names raise."""
        params = dict(self.named_parameters())  # tied weights appear once, as model.embed_tokens.weight
        expected = set(params)
        given = dict(state_dict)
        if self.config.tie_word_embeddings:
            lm = given.pop("lm_head.weight", None)
            if "model.embed_tokens.weight" not in given and lm is not None:
                given["model.embed_tokens.weight"] = lm
        missing = sorted(expected - set(given))
        unexpected = sorted(set(given) - expected)
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
        with torch.no_grad():
            for name, tensor in given.items():
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                param.copy_(tensor)


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Zeroed per-layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]
