"""``vllm-actors bench throughput``'s workload: nano-vllm's requests, and the model directories of
the benchmarks' shapes (Qwen3-0.6B by default, Qwen3-8B (also in block-wise FP8), Llama-3.2-1B,
Llama-3-8B with a million-token RoPE, the mixture-of-experts Qwen3-30B-A3B; random weights)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPERATURE = 0.6
DEFAULT_NUM_REQUESTS = 256
PROMPT_LEN_RANGE = (100, 1024)
OUTPUT_LEN_RANGE = (100, 1024)
TOKEN_ID_RANGE = (0, 10000)
DEFAULT_SEED = 0
EXPECTED_OUTPUT_TOKENS = 133_966  # of the default workload (256 requests, seed 0)

# Qwen3-0.6B's config.json (the shape; the weights are random).
QWEN3_0_6B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.max_tokens[:count])

    def fit_vocab(self, vocab_size: int) -> Workload:
        """Token ids folded into ``[0, vocab_size)`` (only tiny test models have fewer than 10,001)."""
        if vocab_size > TOKEN_ID_RANGE[1]:
            return self
        return Workload([[token % vocab_size for token in prompt] for prompt in self.prompts], self.max_tokens)


# The shared-prefix workload (SGLang's "generated shared prefix" benchmark at its defaults): groups of
# prompts that share a long system prompt, each with a question of its own.
SHARED_PREFIX_DEFAULTS = {"groups": 64, "per_group": 16, "prefix_len": 2048, "question_len": 128, "output_len": 256}


def make_shared_prefix_workload(
    groups: int = 64, per_group: int = 16, prefix_len: int = 2048, question_len: int = 128, output_len: int = 256,
    seed: int = DEFAULT_SEED,
) -> Workload:
    """``groups * per_group`` requests: each group's prompts start with the same ``prefix_len``
    random tokens and end with ``question_len`` of their own; every request asks for ``output_len``
    tokens. Requests are interleaved across groups (request i is of group i % groups), so an engine
    meets every prefix early, as a server would."""
    if min(groups, per_group, prefix_len, question_len, output_len) < 1:
        raise ValueError("groups, per_group, prefix_len, question_len and output_len must each be at least 1")
    rng = random.Random(seed)
    prefixes = [[rng.randint(*TOKEN_ID_RANGE) for _ in range(prefix_len)] for _ in range(groups)]
    prompts = [prefixes[index % groups] + [rng.randint(*TOKEN_ID_RANGE) for _ in range(question_len)]
               for index in range(groups * per_group)]
    return Workload(prompts, [output_len] * len(prompts))


def make_workload(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = DEFAULT_SEED,
) -> Workload:
    """nano-vllm's requests: at least the standard 256 are drawn (so a subset is the head of the
    standard workload), then the first ``num_requests`` are kept; prompts are cut to
    ``max_input_len`` and ``max_tokens`` capped at ``max_output_len`` (for scaled-down runs)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    rng = random.Random(seed)  # the same stream as random.seed(seed) and the module's functions
    drawn = max(num_requests, DEFAULT_NUM_REQUESTS)
    prompts = [
        [rng.randint(*TOKEN_ID_RANGE) for _ in range(rng.randint(*PROMPT_LEN_RANGE))] for _ in range(drawn)
    ]
    max_tokens = [rng.randint(*OUTPUT_LEN_RANGE) for _ in range(drawn)]
    prompts, max_tokens = prompts[:num_requests], max_tokens[:num_requests]
    if max_input_len is not None:
        prompts = [prompt[:max_input_len] for prompt in prompts]
    if max_output_len is not None:
        max_tokens = [min(limit, max_output_len) for limit in max_tokens]
    return Workload(prompts, max_tokens)


# Qwen3-8B's shape (tensor-parallel benchmarks: 32 heads, 8 KV heads, untied LM head).
QWEN3_8B_CONFIG: dict[str, Any] = {
    **QWEN3_0_6B_CONFIG, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
}
# Llama-3.2-1B's config.json (long-context benchmarks: llama3 rope scaling, 131,072 positions, head dim 64).
LLAMA_3_2_1B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# Llama-3-8B's shape with a million-token RoPE: the dimensions of Meta's Llama-3-8B (32 heads over 8 KV
# heads, 128 KiB of bf16 KV per token) and the RoPE of Gradient's Llama-3-8B-Instruct-Gradient-1048k
# (its config.json: rope_theta 3,580,165,449, max_position_embeddings 1,048,576, no rope_scaling).
LLAMA_3_8B_1M_CONFIG: dict[str, Any] = {
    **LLAMA_3_2_1B_CONFIG, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 1048576,
    "rope_theta": 3580165449.0, "rope_scaling": None, "tie_word_embeddings": False,
}
# Qwen3-8B-FP8's: block-wise FP8 weights as Qwen ships them (random, quantized at load_format=dummy).
QWEN3_8B_FP8_CONFIG: dict[str, Any] = {
    **QWEN3_8B_CONFIG, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                               "weight_block_size": [128, 128]},
}
# Qwen3-30B-A3B's config.json: 48 layers, each a sparse MLP of 128 experts (8 per token, their weights
# renormalised); 30.5B parameters, about 61 GB in bf16 (one 80 GB H100 keeps about 10 GB for the KV cache).
QWEN3_30B_A3B_CONFIG: dict[str, Any] = {
    **QWEN3_0_6B_CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "tie_word_embeddings": False, "max_window_layers": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": QWEN3_0_6B_CONFIG, "qwen3-8b": QWEN3_8B_CONFIG, "qwen3-8b-fp8": QWEN3_8B_FP8_CONFIG,
    "llama-3.2-1b": LLAMA_3_2_1B_CONFIG, "llama-3-8b-1m": LLAMA_3_8B_1M_CONFIG,
    "qwen3-30b-a3b": QWEN3_30B_A3B_CONFIG,
}


def write_model_dir(path: Path, config: dict[str, Any] | None = None) -> Path:
    """A Hugging Face directory with only ``config.json`` (for ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or QWEN3_0_6B_CONFIG, indent=2) + "\n")
    return path
