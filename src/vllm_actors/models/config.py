"""Model hyper-parameters read from a Hugging Face directory or a GGUF file.

This module must not import torch: the scheduler and the frontend use it too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_actors.models import registry
from vllm_actors.models.families import GEMMA_TYPES, family_fields, rope_overrides
from vllm_actors.models.moe_config import MOE_ARCHITECTURES, moe_fields
from vllm_actors.models.quant_config import Fp8Scheme, fp8_scheme
from vllm_actors.models.rope_config import derived_max_model_len, normalize_rope_scaling, rope_sources

Source = Literal["hf", "gguf"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture figures for a decoder-only Llama-family model."""

    architecture: str  # the registry's model_type (config.json `model_type`): "llama", "qwen3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str
    source: Source
    path: str
    # mixture of experts (models/moe_config.py): experts per MoE layer (0: a dense model), chosen per
    # token, their intermediate size, whether the top-k probabilities are renormalised, which layers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # The dense families' options beyond Llama (`models/families.py`); the defaults are Llama's.
    qkv_bias: bool = False  # q/k/v projections biased without o_proj (Qwen2)
    sliding_window: int | None = None  # keys a query of a sliding layer sees (itself included)
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention"
    attn_logit_softcapping: float | None = None  # c * tanh(score / c) in attention
    final_logit_softcapping: float | None = None  # the same on the logits
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5
    hidden_activation: str = "silu"  # of the gated MLP: silu or gelu_pytorch_tanh
    gemma_norms: bool = False  # RMSNorm by (1 + w); a norm after attention and around the MLP
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    local_rope_theta: float | None = None  # plain rotary base of the sliding layers (Gemma 3)
    quantization: Fp8Scheme | None = None  # FP8 weights (`models/quant_config.py`); None: in torch_dtype

    def __post_init__(self) -> None:
        registry.entry_for_model_type(self.architecture)  # unknown: ValueError naming the supported list
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``; None: it attends to the whole context."""
        if self.sliding_window is None or self.layer_types is None:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(scalar) ** -0.5

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the config allows (max_position_embeddings, stretched by the rope
        scaling factor where the type does: `rope_config.derived_max_model_len`)."""
        return derived_max_model_len(self.max_position_embeddings, self.rope_scaling)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (JSON/msgpack friendly); `from_dict` is its inverse."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict of this dataclass's fields (e.g. `to_dict()` output); unknown keys raise."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {unknown}")
        values = dict(data)
        values["eos_token_ids"] = [int(t) for t in values.get("eos_token_ids", [])]
        values["moe_layers"] = tuple(int(i) for i in values.get("moe_layers", ()))
        if isinstance(values.get("quantization"), dict):
            values["quantization"] = Fp8Scheme.from_dict(values["quantization"])
        return cls(**values)

    @classmethod
    def from_path(cls, path: str) -> ModelConfig:
        """Read a Hugging Face model directory (config.json) or a `.gguf` file."""
        p = Path(path)
        if p.is_file() and p.suffix.lower() == ".gguf":
            return _from_gguf(p)
        if p.is_dir():
            config_file = p / "config.json"
            if not config_file.is_file():
                raise FileNotFoundError(f"{p} has no config.json")
            config = json.loads(config_file.read_text())
            gen_file = p / "generation_config.json"
            gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
            return cls.from_hf_config(config, generation_config=gen, path=str(p))
        if not p.exists():
            raise FileNotFoundError(f"model path {path!r} does not exist")
        raise ValueError(f"{path!r} is neither a Hugging Face model directory nor a .gguf file")

    @classmethod
    def from_hf_config(
        cls,
        config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        path: str = "",
    ) -> ModelConfig:
        """Build from the contents of a Hugging Face config.json (and optional generation_config.json)."""
        arch = registry.resolve(config).model_type
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden // heads
        rope_theta, scaling_src = rope_sources(config)
        extra = family_fields(arch, config)
        if arch in MOE_ARCHITECTURES.values():
            extra.update(moe_fields(config, arch))
        two_ropes = rope_overrides(arch, config)
        if two_ropes is not None:
            rope_theta, scaling_src, extra["local_rope_theta"] = two_ropes
        max_positions = int(config.get("max_position_embeddings", 2048))
        original = config.get("original_max_position_embeddings")  # top-level (Phi-3 style): preferred
        scaling = normalize_rope_scaling(scaling_src, max_positions, None if original is None else int(original))
        eos = None
        if generation_config is not None:
            eos = generation_config.get("eos_token_id")
        if eos is None:
            eos = config.get("eos_token_id")
        bos = config.get("bos_token_id")
        if bos is None and generation_config is not None:
            bos = generation_config.get("bos_token_id")
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            # transformers leaves out a value equal to its defaults: Gemma's tie, the others' not
            tie_word_embeddings=bool(config.get("tie_word_embeddings", arch in GEMMA_TYPES)),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            eos_token_ids=_as_id_list(eos),
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=str(dtype).removeprefix("torch."),
            source="hf",
            path=path,
            quantization=fp8_scheme(config),
            **extra,
        )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# --- GGUF header -------------------------------------------------------------------------------
# gguf.GGUFReader builds numpy views for every token string and takes seconds on a 49k vocabulary,
# so the header (metadata + tensor directory) is parsed here directly. Format facts: little-endian;
# magic "GGUF", uint32 version, uint64 tensor count, uint64 kv count, then kv pairs (string key,
# uint32 value type, value), then tensor infos (string name, uint32 n_dims, uint64 dims (ne0 first),
# uint32 ggml type, uint64 offset relative to the aligned data section).

_GGUF_MAGIC = b"GGUF"
_GGUF_STRING = 8
_GGUF_ARRAY = 9
_GGUF_SCALARS: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8",
}
_GGUF_BOOL = 7


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF tensor directory; `shape` is in GGUF order (ne0, the fastest dim, first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        import numpy as np

        dt = np.dtype(fmt)
        value = np.frombuffer(self.buf, dtype=dt, count=1, offset=self.pos)[0]
        self.pos += dt.itemsize
        return value.item()

    def u32(self) -> int:
        v = int.from_bytes(self.buf[self.pos : self.pos + 4], "little")
        self.pos += 4
        return v

    def u64(self) -> int:
        v = int.from_bytes(self.buf[self.pos : self.pos + 8], "little")
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            etype = self.u32()
            count = self.u64()
            if etype == _GGUF_STRING:
                return [self.string() for _ in range(count)]
            if etype == _GGUF_ARRAY:
                return [self.value(_GGUF_ARRAY) for _ in range(count)]
            import numpy as np

            dt = np.dtype(_GGUF_SCALARS[etype])
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += dt.itemsize * count
            return [bool(x) for x in arr] if etype == _GGUF_BOOL else arr.tolist()
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        v = self.scalar(_GGUF_SCALARS[vtype])
        return bool(v) if vtype == _GGUF_BOOL else v


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the metadata and the tensor directory of a GGUF (v2/v3) file without reading tensor data."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            if bytes(buf[:4]) != _GGUF_MAGIC:
                raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
            cur = _Cursor(buf)
            cur.pos = 4
            version = cur.u32()
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
            n_tensors = cur.u64()
            n_kv = cur.u64()
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.u32())
            infos: list[tuple[str, tuple[int, ...], int, int]] = []
            for _ in range(n_tensors):
                name = cur.string()
                ndim = cur.u32()
                shape = tuple(cur.u64() for _ in range(ndim))
                ggml_type = cur.u32()
                infos.append((name, shape, ggml_type, cur.u64()))
            alignment = int(metadata.get("general.alignment", 32))
            data_offset = (cur.pos + alignment - 1) // alignment * alignment
        finally:
            buf.release()
    tensors = {n: GGUFTensorInfo(n, s, t, data_offset + o) for n, s, t, o in infos}
    return GGUFHeader(version=version, metadata=metadata, tensors=tensors, data_offset=data_offset)


def _from_gguf(path: Path) -> ModelConfig:
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in registry.gguf_model_types():
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(registry.gguf_model_types())}"
        )
    if int(meta.get(f"{arch}.expert_count", 0)):  # Mixtral's GGUF files say "llama"
        raise ValueError(f"GGUF {path}: mixture-of-experts GGUF files are not supported (load the safetensors)")

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file {path} lacks metadata key {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"GGUF {path}: key_length {head_dim} != value_length {value_dim} is not supported")
    rot_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise ValueError(f"GGUF {path}: partial rotary (rope.dimension_count {rot_dim} != {head_dim}) unsupported")
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"GGUF {path}: unsupported rope scaling type {scaling_type!r}")
    tensor_names = set(header.tensors)
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"GGUF {path}: rope frequency factors (rope_freqs.weight, llama3 rope) are not supported")

    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens)
    else:
        vocab_size = int(need("vocab_size"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=arch == "qwen3",
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        eos_token_ids=_as_id_list(eos),
        bos_token_id=None if bos is None else int(bos),
        torch_dtype="float32",
        source="gguf",
        path=str(path),
    )
