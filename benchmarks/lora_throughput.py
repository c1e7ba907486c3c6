"""LoRA throughput on a model shape with dummy weights: N requests spread over K random rank-r
adapters, against the same requests without adapters (same engine), and batch-1 decode with and
without an adapter; ``--engine vllm`` runs the same with vLLM (``vllm.LLM`` + ``LoRARequest``)
for the comparison on the same machine. Prints one JSON line per measurement.

    python benchmarks/lora_throughput.py --model-shape qwen3-8b --num-requests 256 --num-adapters 8 --rank 16
    python benchmarks/lora_throughput.py --model-shape qwen3-8b --num-requests 256 --num-adapters 8 --rank 16 \
        --engine vllm
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The repository instead of this folder: a module here named like a package vLLM or transformers imports would
# shadow it (transformers probes `import kernels`, for one).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: dict[str, Any], rank: int, seed: int) -> Path:
    """A PEFT adapter of random A and B (bf16) on every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            parent = "self_attn" if module in MODULES[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{name}.lora_A.weight"] = (0.01 * torch.randn(rank, fan_in, generator=gen)).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (0.01 * torch.randn(fan_out, rank, generator=gen)).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}))
    return path


def main() -> int:
    from vllm_actors.bench.throughput_workload import MODEL_SHAPES, write_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    parser.add_argument("--engine", choices=["ours", "vllm"], default="ours")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch1-tokens", type=int, default=256)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    config = MODEL_SHAPES[args.model_shape]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lora-bench-"))
    model = write_model_dir(work / args.model_shape, config)
    adapters = [write_adapter(work / f"adapter-{i}", config, args.rank, seed=i) for i in range(args.num_adapters)]
    engine_args = dict(load_format="dummy", dtype="bfloat16", enable_lora=True, max_loras=args.num_adapters,
                       max_lora_rank=args.rank, max_cpu_loras=args.num_adapters, skip_tokenizer_init=True,
                       max_model_len=args.input_len + args.output_len + 64, seed=0)
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    else:
        from vllm_actors import LLM, LoRARequest, SamplingParams  # type: ignore[assignment]
    llm = LLM(str(model), **engine_args)
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_requests)]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def timed(batch: list[Any], lora: Any, label: str, max_tokens: int | None = None) -> None:
        sampling = params if max_tokens is None else SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(batch, sampling, use_tqdm=False, lora_request=lora)
        seconds = time.perf_counter() - started
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        print(json.dumps({"engine": args.engine, "shape": args.model_shape, "run": label, "requests": len(batch),
                          "output_tokens": tokens, "seconds": round(seconds, 3),
                          "output_tok_s": round(tokens / seconds, 1)}), flush=True)

    per_prompt = [loras[i % len(loras)] for i in range(args.num_requests)]
    timed(prompts[:16], per_prompt[:16], "warm-up")  # every adapter loaded, kernels compiled
    timed(prompts[:16], None, "warm-up")
    timed(prompts, per_prompt, f"{args.num_adapters} adapters of rank {args.rank}")
    timed(prompts, None, "no adapter (same engine)")
    timed(prompts[:1], loras[0], "batch-1 with an adapter", args.batch1_tokens)
    timed(prompts[:1], None, "batch-1 without", args.batch1_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
