"""Tiny GGUF files in the quantization mixes users download (Q4_K_M, Q5_K_M, Q6_K, Q8_0), and the
float32 Hugging Face checkpoint of their dequantized weights (the reference transformers runs).

The `gguf` package dequantizes every K-quant but quantizes none, so a K-quant tensor here is random
blocks of its type (random 4/5/6-bit values and sub-block scales, a small float16 super-block scale);
Q8_0 tensors are the model's own weights quantized by `gguf.quants.quantize`. The reference holds
`gguf.quants.dequantize` of each tensor, its q/k rows put back from llama.cpp's order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.support.tiny_models import build_gguf, llama_cpp_permute_qk

# llama.cpp's mixes, simplified: "_M" gives attn_v, ffn_down and the output Q6_K; norms stay F32
PRESETS: dict[str, tuple[str, str]] = {  # preset -> (most weights, attn_v / ffn_down / output)
    "Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K"), "Q6_K": ("Q6_K", "Q6_K"), "Q8_0": ("Q8_0", "Q8_0"),
}
# the float16 super-block scales (d, dmin) of each K-quant's random blocks and their byte offsets
_SCALES: dict[str, tuple[float, list[int]]] = {"Q4_K": (1e-4, [0, 2]), "Q5_K": (5e-5, [0, 2]), "Q6_K": (2e-5, [208])}
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "num_hidden_layers": 2}  # rows of whole 256-value K-quant super-blocks


def _random_blocks(rows: int, cols: int, qtype: Any, rng: Any) -> Any:
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale, offsets = _SCALES[qtype.name]
    for offset in offsets:
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, cols // block * size)


def build_kquant_gguf(hf_dir: Path, out_dir: Path, preset: str, seed: int = 0) -> tuple[Path, Path]:
    """(GGUF file, reference HF directory) of ``hf_dir`` (a tiny Llama of ``SHAPE``) in ``preset``."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    main, special = (GGMLQuantizationType[name] for name in PRESETS[preset])
    config = json.loads((hf_dir / "config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    reference = out_dir / f"{preset}-dequantized"
    shutil.copytree(hf_dir, reference)
    state = load_file(str(hf_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    raw: dict[str, tuple[Any, Any]] = {}
    for name, tensor in state.items():
        if tensor.dim() != 2:
            continue
        qtype = special if name.endswith(("v_proj.weight", "down_proj.weight")) or name == "lm_head.weight" else main
        module = name.rsplit(".", 2)[-2]
        stored = tensor.numpy()
        if module in heads:  # llama.cpp's row order
            stored = llama_cpp_permute_qk(stored, heads[module])
        if qtype == GGMLQuantizationType.Q8_0:
            blocks = quantize(np.ascontiguousarray(stored, dtype=np.float32), qtype)
        else:
            blocks = _random_blocks(*stored.shape, qtype, rng)
        values = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32))
        if module in heads:  # back to Hugging Face's order
            order = llama_cpp_permute_qk(np.arange(values.shape[0]), heads[module])
            values = values[torch.from_numpy(np.argsort(order))]
        state[name] = values.contiguous()
        raw[name] = (blocks, qtype)
    save_file(state, str(reference / "model.safetensors"), metadata={"format": "pt"})
    return build_gguf(reference, out_dir / f"tiny-{preset}.gguf", raw), reference
