"""On a GPU: the batched LoRA kernels at the Qwen3-8B shape (8 slots of rank 16, q/k/v stacked)
in bfloat16 against torch in float32, eager and replayed from a CUDA graph after the slots per
token changed (the per-row kernels of small steps and the sorted ones); and two PEFT adapters plus
the base through the engine (tiny Qwen3, float32): the Triton kernels with CUDA graphs give the
greedy tokens of the same kernels run eagerly (a difference there is a graph bug, such as stale
slots in padded rows), and the torch path's teacher-forced logprobs of those tokens.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize("tokens", [1, 8, 16, 256, 2048])
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


# Logprobs of two float32 runs through different kernels (summation order, split-K atomics) agree
# to about 1e-5; an adapter applied to the wrong rows moves them by far more than TOLERANCE. Greedy
# runs may part where the top two tokens are within TIE: then the rest of that request is not compared.
TOLERANCE, TIE = 2e-3, 2e-3
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine_runs(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Greedy runs of 9 prompts over two adapters and the base: Triton with CUDA graphs (with
    logprobs, and again without: the graphs that sample), Triton eager (with prompt logprobs), and
    the torch path's teacher-forced prompt logprobs over each prompt plus the graph run's tokens."""
    root = tmp_path_factory.mktemp("gpu_lora")
    first = build_adapter(tiny_qwen3, root / "a", rank=8, seed=1)
    second = build_adapter(tiny_qwen3, root / "b", targets=ATTENTION, rank=16, seed=2)
    loras = [LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second)), None] * 3
    prompts = [[(7 * i + j) % 500 for j in range(5 + 9 * i)] for i in range(len(loras))]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                                   prompt_logprobs=0)

    @contextlib.contextmanager
    def engine(kernel: str, eager: bool) -> Iterator[LLM]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("VLLM_ACTORS_LORA_KERNEL", kernel)  # read at every LoRA product
            with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", enable_lora=True, max_loras=2,
                     max_num_batched_tokens=64, enforce_eager=eager, seed=0) as llm:
                yield llm

    def generate(llm: LLM, token_ids: list[list[int]], params: SamplingParams) -> list[Any]:
        return llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False,
                            lora_request=loras)

    runs: dict[str, Any] = {"loras": loras, "prompts": prompts}
    with engine("triton", eager=False) as llm:
        runs["graphs"] = generate(llm, prompts, with_logprobs)
        runs["graphs_sampled"] = generate(llm, prompts, greedy)
    with engine("triton", eager=True) as llm:
        runs["eager"] = generate(llm, prompts, with_logprobs)
    forced = [p + o.outputs[0].token_ids for p, o in zip(prompts, runs["graphs"], strict=True)]
    with engine("torch", eager=True) as llm:  # the torch path reads the slots on the host: no graphs
        runs["torch"] = generate(llm, forced, SamplingParams(max_tokens=1, prompt_logprobs=0))
    yield runs


def _label(runs: dict[str, Any], index: int) -> str:
    lora = runs["loras"][index]
    return f"request {index} (adapter {lora.lora_name if lora else None}, {len(runs['prompts'][index])} prompt tokens)"


def _assert_same_greedy(runs: dict[str, Any], name_a: str, name_b: str) -> None:
    """Token-identical, except past a near tie (top two within TIE in ``name_a``'s logprobs); the
    chosen tokens' logprobs within TOLERANCE where both have them."""
    for index, (out_a, out_b) in enumerate(zip(runs[name_a], runs[name_b], strict=True)):
        seq_a, seq_b = out_a.outputs[0], out_b.outputs[0]
        tokens_a, tokens_b = seq_a.token_ids, seq_b.token_ids
        assert len(tokens_a) == len(tokens_b) == MAX_TOKENS, (_label(runs, index), len(tokens_a), len(tokens_b))
        differ = next((pos for pos, pair in enumerate(zip(tokens_a, tokens_b)) if pair[0] != pair[1]), None)
        common = MAX_TOKENS if differ is None else differ
        if seq_a.logprobs and seq_b.logprobs:
            for pos in range(common):
                got, want = seq_a.logprobs[pos][tokens_a[pos]].logprob, seq_b.logprobs[pos][tokens_b[pos]].logprob
                assert abs(got - want) < TOLERANCE, (
                    f"{_label(runs, index)}: output position {pos} (token {tokens_a[pos]}): logprob {got:.6f} in "
                    f"{name_a}, {want:.6f} in {name_b}")
        if differ is None:
            continue
        top = seq_a.logprobs[differ] if seq_a.logprobs else {}
        ours, theirs = tokens_a[differ], tokens_b[differ]
        gap = top[ours].logprob - top[theirs].logprob if ours in top and theirs in top else float("inf")
        assert gap < TIE, (
            f"{_label(runs, index)}: {name_a} and {name_b} differ first at output position {differ}: token {ours} "
            f"vs {theirs}, top-2 logprob gap {gap:.2e} in {name_a} (not a near tie); {name_a} {tokens_a}, "
            f"{name_b} {tokens_b}")


def test_engine_graphs_match_eager(engine_runs: dict[str, Any]) -> None:
    """The same Triton kernels with and without CUDA graphs, and the graphs that sample."""
    _assert_same_greedy(engine_runs, "graphs", "eager")
    _assert_same_greedy(engine_runs, "graphs", "graphs_sampled")


def test_engine_triton_matches_torch_path_teacher_forced(engine_runs: dict[str, Any]) -> None:
    """The torch path's logprobs of each prompt's tokens (against the eager Triton run's prompt
    logprobs) and of the graph run's output tokens (against that run's logprobs)."""
    for index, (prompt, forced) in enumerate(zip(engine_runs["prompts"], engine_runs["torch"], strict=True)):
        assert forced.prompt_logprobs is not None
        graphs, eager = engine_runs["graphs"][index], engine_runs["eager"][index]
        assert eager.prompt_logprobs is not None and graphs.outputs[0].logprobs is not None
        tokens = prompt + graphs.outputs[0].token_ids
        for pos in range(1, len(tokens)):
            want = forced.prompt_logprobs[pos][tokens[pos]].logprob
            if pos < len(prompt):
                where, got = f"prompt position {pos}, Triton eager", eager.prompt_logprobs[pos][tokens[pos]].logprob
            else:
                out = pos - len(prompt)
                where = f"output position {out}, Triton with CUDA graphs"
                got = graphs.outputs[0].logprobs[out][tokens[pos]].logprob
            assert abs(got - want) < TOLERANCE, (
                f"{_label(engine_runs, index)}: {where} (token {tokens[pos]}): logprob {got:.6f}, "
                f"torch path {want:.6f}")
