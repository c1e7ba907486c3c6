"""Read GGUF (llama.cpp) checkpoints into Hugging Face-named float32 tensors.

Tensor data is memory-mapped from the offsets of the GGUF tensor directory and dequantized with
`gguf.quants.dequantize` (Q4_1, Q8_0, F16, F32, ... ). GGUF lists dims fastest-first, so the
torch shape is the reversed GGUF shape. For the llama architecture llama.cpp's converter reorders
the rows of each q/k head from the HF "rotate half" layout (first half, second half) to interleaved
pairs (r0, r_{d/2}, r1, r_{d/2+1}, ...); `unpermute_qk` undoes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import structlog
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from vllm_actors.models.config import GGUFHeader, GGUFTensorInfo, ModelConfig, read_gguf_header
from vllm_actors.models.parallel import Part

log = structlog.get_logger(__name__)

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name of a llama.cpp tensor name; ValueError for names we do not know."""
    m = _BLOCK_RE.match(gguf_name)
    if m is not None and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m is not None and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head interleave of q/k projection rows (weight [H*D, ...] or bias [H*D])."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    tail = weight.shape[1:]
    # stored row order per head: index 2*i + j holds HF row j*D/2 + i
    return weight.reshape(num_heads, head_dim // 2, 2, *tail).transpose(1, 2).reshape(rows, *tail)


def read_gguf_tensor(path: str | Path, info: GGUFTensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """Dequantized float32 numpy array of one tensor, in torch (reversed GGUF) shape; ``rows``:
    only rows ``[start, stop)`` of a 2-D tensor's first torch dimension (whole quantized rows, read
    from the memory map alone)."""
    qtype = GGMLQuantizationType(info.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    ne0 = info.shape[0]
    if ne0 % block_size != 0:
        raise ValueError(f"{info.name}: row length {ne0} is not a multiple of the {qtype.name} block {block_size}")
    num_rows = int(np.prod(info.shape[1:], dtype=np.int64)) if len(info.shape) > 1 else 1
    row_bytes = ne0 // block_size * type_size
    shape = tuple(reversed(info.shape))
    start, stop = rows if rows is not None and len(info.shape) == 2 else (0, num_rows)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset + start * row_bytes,
                    shape=(stop - start, row_bytes))
    values = dequantize(np.asarray(raw), qtype).astype(np.float32, copy=False)
    return values.reshape((stop - start, *shape[1:]) if len(shape) == 2 else shape)


class GGUFSource:
    """A GGUF file's tensors under their HF names, read one at a time (``load_from``): a
    tensor-parallel rank reads just its rows of a column-parallel weight; of a row-parallel one it
    dequantizes whole rows and keeps its columns (quantized blocks run along the rows)."""

    def __init__(self, path: str | Path, config: ModelConfig | None = None) -> None:
        self.path = path
        self.config = config or ModelConfig.from_path(str(path))
        self.infos: dict[str, GGUFTensorInfo] = {}
        for info in read_gguf_header(path).tensors.values():
            if info.name == "rope_freqs.weight":
                raise ValueError(f"{path}: rope frequency factors (llama3 rope in GGUF) are not supported")
            self.infos[hf_tensor_name(info.name)] = info

    def names(self) -> Iterable[str]:
        return self.infos.keys()

    def shape(self, name: str) -> list[int]:
        return list(reversed(self.infos[name].shape))

    def read(self, name: str, part: Part | None) -> torch.Tensor:
        rows = (part.start, part.stop) if part is not None and part.dim == 0 else None
        array = read_gguf_tensor(self.path, self.infos[name], rows)
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        module = name.rsplit(".", 1)[0]
        if self.config.architecture == "llama" and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            tensor = unpermute_qk(tensor, tensor.shape[0] // self.config.head_dim)  # whole heads, in any part
        if part is not None and part.dim == 1:
            tensor = tensor[:, part.start : part.stop]
        return tensor.contiguous()


def load_gguf_state_dict(
    path: str | Path,
    config: ModelConfig | None = None,
    header: GGUFHeader | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file as float32 CPU tensors keyed and shaped like the HF checkpoint."""
    config = config or ModelConfig.from_path(str(path))
    header = header or read_gguf_header(path)
    state: dict[str, torch.Tensor] = {}
    for info in header.tensors.values():
        if info.name == "rope_freqs.weight":
            raise ValueError(f"{path}: rope frequency factors (llama3 rope in GGUF) are not supported")
        name = hf_tensor_name(info.name)
        array = read_gguf_tensor(path, info)
        # F32 tensors come back as read-only views of the memory map: copy those
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        module = name.rsplit(".", 1)[0]
        if config.architecture == "llama" and module.endswith("self_attn.q_proj"):
            tensor = unpermute_qk(tensor, config.num_attention_heads)
        elif config.architecture == "llama" and module.endswith("self_attn.k_proj"):
            tensor = unpermute_qk(tensor, config.num_key_value_heads)
        state[name] = tensor.contiguous()
    log.debug("gguf_state_dict_loaded", path=str(path), tensors=len(state))
    return state
