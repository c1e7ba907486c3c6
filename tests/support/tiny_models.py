"""Tiny, deterministic test checkpoints: a byte-level BPE tokenizer and random Llama/Qwen3 models
(and their mixture-of-experts kin, Qwen3-MoE and Mixtral).

Everything here is built on the spot (no downloads) and is deterministic across runs, so tests
can compare our engine against transformers on exactly the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 1024
# 4 experts of intermediate 32, 2 per token. Qwen3-MoE: layer 1 dense (mlp_only_layers), the top-2
# probabilities as they are (norm_topk_prob false; Mixtral always renormalises them).
MOE_SHAPE: dict[str, Any] = {"num_experts_per_tok": 2}
QWEN3_MOE_SHAPE: dict[str, Any] = {"num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                   "decoder_sparse_step": 1, "norm_topk_prob": False}
MIXTRAL_SHAPE: dict[str, Any] = {"num_local_experts": 4, "intermediate_size": 32, "sliding_window": None}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS_LINES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A small model is trained on a tiny corpus so that tests run fast.",
    "Hello world! How are you today? I am fine, thank you.",
    "The cat sat on the mat and looked at the moon in the night sky.",
    "Once upon a time there was a little engine that could count to ten.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Paged attention stores keys and values in fixed size blocks.",
    "The scheduler decides which sequences run in each step of the engine.",
    "Actors send messages to each other and never share mutable state.",
    "What is the capital of France? The capital of France is Paris.",
    "Water boils at one hundred degrees and freezes at zero degrees.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "In the beginning the user asked a question and the assistant gave an answer.",
    "Please write a short poem about the river, the trees and the mountains.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048 and 3.14159 appear in text.",
    "Punctuation: commas, periods. Colons: semicolons; quotes \"like this\" and 'that'!",
    "Brackets (round) [square] {curly} <angle> and symbols @ # $ % ^ & * - + = / \\ | ~ `",
    "system user assistant tool function call result message content role",
    "def main(): return 0  # a line of code with spaces and tabs\tand newlines\n",
    "The weather today is sunny with a light breeze from the west.",
    "Good morning, good afternoon, good evening and good night.",
    "Large language models predict the next token given all the previous tokens.",
)


def _corpus() -> list[str]:
    lines = list(_CORPUS_LINES)
    lines.append(" ".join(str(i) for i in range(200)))
    lines.append("".join(chr(c) for c in range(32, 127)))
    # repeat so frequent pairs are clearly frequent; order is fixed, so training is deterministic
    return lines * 4


THINK_TOKENS = ("<think>", "</think>")  # a reasoning model's tags (added tokens, not special: they decode)


def build_tokenizer(path: Path, added_tokens: tuple[str, ...] = ()) -> None:
    """Train a ~512-entry byte-level BPE and write tokenizer.json + tokenizer_config.json to path;
    ``added_tokens`` (e.g. THINK_TOKENS) come after, as non-special added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tok.save(str(path / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        } | {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                      "single_word": False, "special": False}
            for t in added_tokens
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _tokenizer_ids(path: Path) -> tuple[int, dict[str, int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return tok.get_vocab_size(), ids


def build_checkpoint(
    path: Path,
    arch: str,
    tie_word_embeddings: bool,
    num_shards: int = 1,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    shape: dict[str, Any] | None = None,
    added_tokens: tuple[str, ...] = (),
) -> Path:
    """Build a tiny random float32 checkpoint (HF layout) with its tokenizer at path: arch "llama",
    "qwen3", "qwen3_moe", "mixtral" (MoE: ``MOE_SHAPE`` and the family's shape; experts saved one
    tensor each), or one of `tiny_families.FAMILIES` (qwen2, mistral, gemma2, gemma3_text, phi3).

    rope_scaling: extra HF rope parameters, e.g. {"rope_type": "llama3", "factor": 8.0, ...}.
    shape: overrides of the sizes (num_attention_heads, num_key_value_heads, intermediate_size, ...)
    and of a family's options (sliding_window, ...).
    """
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    path = Path(path)
    build_tokenizer(path, added_tokens)
    vocab_size, ids = _tokenizer_ids(path)
    eos_id = ids[EOS_TOKEN]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=ids["<|endoftext|>"],
        attention_bias=False,
        torch_dtype="float32",
    )
    common.update({"qwen3_moe": MOE_SHAPE | QWEN3_MOE_SHAPE, "mixtral": MOE_SHAPE | MIXTRAL_SHAPE}.get(arch, {}))
    common.update(shape or {})
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope.update(rope_scaling)
    model: torch.nn.Module
    if arch == "llama":
        config = LlamaConfig(**common, mlp_bias=False, rope_parameters=rope)
        config.rope_theta = 10000.0
        model_cls = LlamaForCausalLM
    elif arch == "qwen3":
        config = Qwen3Config(**common, rope_parameters=rope)
        config.rope_theta = 10000.0
        model_cls = Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, rope_parameters=rope)
        model_cls = Qwen3MoeForCausalLM
    elif arch == "mixtral":
        config = MixtralConfig(**common, rope_parameters=rope)
        model_cls = MixtralForCausalLM
    else:
        from tests.support.tiny_families import family_config

        config, model_cls = family_config(arch, common, rope)

    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                # norms near 1.0, slightly perturbed so a mis-applied norm is detectable
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.eval()

    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if num_shards > 1:
        shard = max(1, total_bytes // num_shards + 1)
        model.save_pretrained(path, max_shard_size=shard, safe_serialization=True)
    else:
        model.save_pretrained(path, max_shard_size=10 * total_bytes + (1 << 20), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, bos_token_id=None, pad_token_id=ids["<|endoftext|>"]).save_pretrained(path)
    return path


class PagedRunner:
    """Drives a CausalLM step by step through a paged KV cache, like a minimal model runner.

    Blocks are handed out from a shuffled free list (so block tables are non-contiguous) and the
    caches start full of noise (so reading a slot never written shows up in the logits).
    """

    def __init__(self, model: Any, block_size: int = 16, num_blocks: int = 64, seed: int = 0) -> None:
        import torch

        config = getattr(model, "local_config", model.config)  # a tensor-parallel rank's KV heads
        param = next(model.parameters())
        gen = torch.Generator().manual_seed(seed)
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)

        def noise() -> torch.Tensor:
            return torch.randn(shape, generator=gen).to(dtype=param.dtype, device=param.device)

        self.kv_caches = [(noise(), noise()) for _ in range(config.num_hidden_layers)]
        self.free: list[int] = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, Any]:
        """Feed chunks[seq_id] (new token ids) of each sequence in one batch; returns logits per sequence."""
        import torch

        from vllm_actors.kernels.attention import build_attention_metadata

        device = next(self.model.parameters()).device
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, tokens in chunks.items():
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            self.lens[seq_id] = end
            ids.extend(tokens)
            positions.extend(range(start, end))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, device)
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                meta,
                self.kv_caches,
            )
            logits = self.model.compute_logits(hidden)
        out: dict[int, Any] = {}
        offset = 0
        for seq_id, n in zip(chunks, query_lens):
            out[seq_id] = logits[offset : offset + n]
            offset += n
        return out


def llama_cpp_permute_qk(weight: Any, num_heads: int) -> Any:
    """The row order llama.cpp's converter stores llama q/k projections in (per head: 0, D/2, 1, D/2+1, ...)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


_GGUF_BLOCK_TENSORS: dict[str, str] = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def build_gguf(hf_dir: Path, out_path: Path, raw: dict[str, tuple[Any, Any]] | None = None) -> Path:
    """Convert a tiny HF checkpoint of build_checkpoint to an all-F32 GGUF file the way llama.cpp lays it out;
    ``raw``: HF name -> (quantized bytes in llama.cpp's row order, GGMLQuantizationType) written instead."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    state: dict[str, np.ndarray] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    eos_id = vocab[EOS_TOKEN]

    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(eos_id)
    w.add_chat_template(CHATML_TEMPLATE)

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, array in sorted(state.items()):
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_BLOCK_TENSORS[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = llama_cpp_permute_qk(array, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = llama_cpp_permute_qk(array, kv_heads)
        if raw is not None and name in raw:
            w.add_tensor(gname, raw[name][0], raw_dtype=raw[name][1])
            continue
        w.add_tensor(gname, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
