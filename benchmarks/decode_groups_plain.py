"""GPU: the Triton decode kernel on plain decode rows with and without ``decode_groups`` (a
speculating engine's decode graphs read the query groups on every plain step too: each row its own
group), at SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, bf16, block
size 16), ``--seqs`` sequences of ``--context`` keys, the splits chosen for ``--max-seq-len`` keys as
a decode graph's are (it is captured for max_model_len). Prints the medians of ``triton.testing.do_bench``
in microseconds per kernel, of eager calls and of a CUDA graph of ``LAYERS`` calls (a step's: SmolLM2 has
30 layers; the graph's figure is free of launch costs). On a CPU (``TRITON_INTERPRET=1``, float32) it only
checks that both agree.

    python benchmarks/decode_groups_plain.py --seqs 64 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vllm_actors.actors.worker.step_data import BatchInput  # noqa: E402
from vllm_actors.kernels.triton_decode import paged_attention_decode  # noqa: E402
from vllm_actors.runner.verify_rows import group_bounds  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def compare(seqs: int, context: int, max_seq_len: int, device: str) -> str:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    blocks = -(-context // BLOCK)
    k = torch.randn(seqs * blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(seqs, HEADS, HEAD_DIM, device=device, dtype=dtype)
    tables = torch.arange(seqs * blocks, device=device, dtype=torch.int32).view(seqs, blocks)
    starts = torch.arange(seqs + 1, device=device, dtype=torch.int32)
    lens = torch.full((seqs,), context, device=device, dtype=torch.int32)
    alone = torch.from_numpy(group_bounds(BatchInput([], [], [], [], [], []), seqs).copy()).to(device)

    def run(groups: torch.Tensor | None) -> torch.Tensor:
        return paged_attention_decode(q, k, v, starts, lens, tables, max_seq_len, HEAD_DIM**-0.5, decode_groups=groups)

    plain, grouped = run(None), run(alone)
    error = (plain.float() - grouped.float()).abs().max().item()
    if error > 1e-2:
        raise AssertionError(f"the grouped kernel disagrees by {error}")
    if device != "cuda":
        return f"{seqs} sequences: both agree (CPU: no timing)"
    import triton.testing

    figures = []
    for name, groups in (("plain", None), ("with decode_groups", alone)):
        eager_us = triton.testing.do_bench(lambda groups=groups: run(groups), rep=200) * 1e3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(LAYERS):
                run(groups)
        graph_us = triton.testing.do_bench(graph.replay, rep=200) * 1e3 / LAYERS
        figures.append(f"{name} {eager_us:.2f} us eager, {graph_us:.2f} us in a graph")
    return f"{seqs} sequences of {context} keys: " + "; ".join(figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--max-seq-len", type=int, default=8192, help="the splits' key bound (graphs: max_model_len)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seqs in args.seqs:
        print(compare(seqs, args.context, args.max_seq_len, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
