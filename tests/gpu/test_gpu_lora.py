"""On a GPU: the batched LoRA kernels at the Qwen3-8B shape (8 slots of rank 16, q/k/v stacked)
in bfloat16 against torch in float32, eager and replayed from a CUDA graph after the slots per
token changed; and two PEFT adapters plus the base through the engine with CUDA graphs give the
torch path's greedy tokens (tiny Qwen3, float32).

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.lora_adapters import ATTENTION, build_adapter
from vllm_actors import LLM, LoRARequest, SamplingParams
from vllm_actors.kernels import lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN, Q, KV, INTER, SLOTS, RANK = 4096, 4096, 1024, 12288, 8, 16


def _slots(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-1, SLOTS, (tokens,), generator=gen, device="cuda", dtype=torch.int32)


def _reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = y.float().clone()
    lora.lora_torch(x.float(), out, a.float(), b.float(), lora.lora_metadata(slots, SLOTS))
    return out


@pytest.mark.parametrize("tokens", [1, 8, 256, 2048])
@pytest.mark.parametrize("k, n, stacked", [(HIDDEN, Q + 2 * KV, 3), (Q, HIDDEN, 1), (HIDDEN, 2 * INTER, 2),
                                           (INTER, HIDDEN, 1)])
def test_bf16_kernels_close_to_float32_torch_and_graph_replay(tokens: int, k: int, n: int, stacked: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_LORA_KERNEL", "triton")
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn((tokens, k), generator=gen, device="cuda").bfloat16()
    y = torch.randn((tokens, n), generator=gen, device="cuda").bfloat16()
    a = (0.05 * torch.randn((SLOTS, stacked * RANK, k), generator=gen, device="cuda")).bfloat16()
    b = (0.05 * torch.randn((SLOTS, n, stacked * RANK), generator=gen, device="cuda")).bfloat16()
    slots = _slots(tokens, tokens)
    got = y.clone()
    lora.add_lora(x, got, a, b, lora.lora_metadata(slots, SLOTS))
    want = _reference(x, y, a, b, slots)
    assert float((got.float() - want).norm() / want.norm()) < 1e-2
    # in a graph: the metadata is computed inside, from a slot buffer refilled before the replay
    static_y = y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora.add_lora(x, static_y, a, b, lora.lora_metadata(slots, SLOTS))
    slots.copy_(_slots(tokens, tokens + 1))
    static_y.copy_(y)
    graph.replay()
    want = _reference(x, y, a, b, slots)
    assert float((static_y.float() - want).norm() / want.norm()) < 1e-2


def test_engine_with_graphs_matches_torch_path(tiny_qwen3: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    first = build_adapter(tiny_qwen3, tmp_path / "a", rank=8, seed=1)
    second = build_adapter(tiny_qwen3, tmp_path / "b", targets=ATTENTION, rank=16, seed=2)
    loras = [LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second)), None] * 3
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 for j in range(5 + 9 * i)]} for i in range(len(loras))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for choice in ("torch", "triton"):
        monkeypatch.setenv("VLLM_ACTORS_LORA_KERNEL", choice)
        eager = {"enforce_eager": True} if choice == "torch" else {}  # the torch path reads slots on the host
        with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", enable_lora=True, max_loras=2,
                 max_num_batched_tokens=64, seed=0, **eager) as llm:  # type: ignore[arg-type]
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        tokens[choice] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]
