"""The batched LoRA kernels alone at small token counts (needs a CUDA GPU): the per-row pair
(``kernels/lora_rows.py``) against the sorted shrink + expand (``kernels/lora.py``) on the four
fused projections of a model shape, each replayed from a CUDA graph of ``--layers`` calls (as a
decode step runs them). Prints one JSON line per (tokens, projection, path): microseconds per call.
``lora.ROW_TOKENS`` is where the engine switches from the first to the second.

    python benchmarks/lora_kernels.py --model-shape qwen3-8b --tokens 1 2 4 8 16 32 --rank 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time(path: str, x: Any, y: Any, a: Any, b: Any, slots: Any, meta: Any, layers: int, replays: int) -> float:
    """Microseconds per call of one path, replayed from a CUDA graph of ``layers`` calls."""
    import torch

    from vllm_actors.kernels import lora, lora_rows

    def call() -> None:
        if path == "rows":
            lora_rows.lora_rows(x, y, a, b, slots)
        else:
            lora.lora_expand(lora.lora_shrink(x, a, meta), b, y, meta)

    call()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) * 1000 / (replays * layers)


def main() -> int:
    import torch

    from vllm_actors.bench.throughput_workload import MODEL_SHAPES
    from vllm_actors.kernels import lora

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--adapters-in-step", type=int, default=1, help="slots the step's tokens use, round robin")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    config = MODEL_SHAPES[args.model_shape]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    projections = {"qkv": (hidden, q + 2 * kv, 3), "o": (q, hidden, 1), "gate_up": (hidden, 2 * inter, 2),
                   "down": (inter, hidden, 1)}
    device, dtype = torch.device("cuda"), torch.bfloat16
    for tokens in args.tokens:
        slots = (torch.arange(tokens, device=device) % args.adapters_in_step).to(torch.int32)
        meta = lora.lora_metadata(slots, args.slots)
        for name, (k, n, stacked) in projections.items():
            rank = stacked * args.rank
            x = torch.randn((tokens, k), device=device, dtype=dtype)
            y = torch.zeros((tokens, n), device=device, dtype=dtype)
            a = 0.01 * torch.randn((args.slots, rank, k), device=device, dtype=dtype)
            b = 0.01 * torch.randn((args.slots, n, rank), device=device, dtype=dtype)
            for path in ("rows", "sorted"):
                per_call = _time(path, x, y, a, b, slots, meta, args.layers, args.replays)
                print(json.dumps({"shape": args.model_shape, "tokens": tokens, "projection": name, "rank": rank,
                                  "path": path, "us_per_call": round(per_call, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
