"""LoRA through the engine: two PEFT adapters and the base model in one batch give transformers +
PEFT's greedy tokens in float32 (Qwen3 in process; Llama over TP=2 ranks on gloo, in a process group:
the adapter crosses the wire to the ranks), one adapter for all prompts or one per prompt; the
prefix cache keeps each adapter's blocks apart; bad adapters raise before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.lora_adapters import ATTENTION, build_adapter, reference_greedy
from vllm_actors import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8
ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, seed=0, enable_lora=True,
              max_lora_rank=16)
PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 40, 41], [200, 201, 202, 9, 8], [300, 301, 302, 303, 304, 305]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": prompt} for prompt in prompts]


def _tokens(outputs: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def qwen3_adapters(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora_engine_qwen3")
    return (build_adapter(tiny_qwen3, root / "a", rank=8, seed=11),
            build_adapter(tiny_qwen3, root / "b", targets=ATTENTION, rank=16, seed=12, use_rslora=True))


@pytest.fixture(scope="module")
def qwen3_llm(tiny_qwen3: Path):  # type: ignore[no-untyped-def]
    with LLM(str(tiny_qwen3), executor="inprocess", max_loras=2, max_cpu_loras=2, **ENGINE) as llm:  # type: ignore[arg-type]
        yield llm


def test_two_adapters_and_the_base_in_one_batch(qwen3_llm: LLM, tiny_qwen3: Path,
                                                qwen3_adapters: tuple[Path, Path]) -> None:
    first, second = qwen3_adapters
    loras = [LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second)), None]
    got = _tokens(qwen3_llm.generate(_inputs(PROMPTS), GREEDY, use_tqdm=False, lora_request=loras))
    want = [reference_greedy(tiny_qwen3, adapter, prompt, MAX_TOKENS)
            for adapter, prompt in zip((first, second, None), PROMPTS, strict=True)]
    assert got == want
    # one adapter for every prompt: the first prompt under b, and the base's tokens differ from a's
    one = _tokens(qwen3_llm.generate(_inputs(PROMPTS[:1] * 2), GREEDY, use_tqdm=False, lora_request=loras[1]))
    assert one == [reference_greedy(tiny_qwen3, second, PROMPTS[0], MAX_TOKENS)] * 2
    assert reference_greedy(tiny_qwen3, None, PROMPTS[0], MAX_TOKENS) != want[0]  # the adapter matters


def test_prefix_cache_is_kept_apart_per_adapter(qwen3_llm: LLM, qwen3_adapters: tuple[Path, Path]) -> None:
    """A long prompt cached under adapter a, then under b, then the base: every request computes
    its own blocks (no hit across adapters), and a repeat under a hits a's."""
    first, second = qwen3_adapters
    prompt = list(range(10, 30))
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    cached = []
    for lora in (LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second)), None,
                 LoRARequest("a", 1, str(first))):
        output = qwen3_llm.generate(_inputs([prompt]), one_token, use_tqdm=False, lora_request=lora)[0]
        cached.append(output.num_cached_tokens)
    assert cached[:3] == [0, 0, 0] and cached[3] > 0


def test_bad_adapters_raise_before_sending(qwen3_llm: LLM, tiny_llama_tp: Path, tmp_path: Path,
                                           tiny_qwen3: Path) -> None:
    wrong_base = build_adapter(tiny_llama_tp, tmp_path / "llama", targets=("gate_proj",), rank=4)
    with pytest.raises(ValueError, match="another base model"):
        qwen3_llm.generate(_inputs(PROMPTS[:1]), GREEDY, lora_request=LoRARequest("x", 7, str(wrong_base)))
    big = build_adapter(tiny_qwen3, tmp_path / "big", targets=("q_proj",), rank=32)
    with pytest.raises(ValueError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        qwen3_llm.generate(_inputs(PROMPTS[:1]), GREEDY, lora_request=LoRARequest("x", 8, str(big)))
    with pytest.raises(ValueError, match="lora_request has 1 values for 2 prompts"):
        qwen3_llm.generate(_inputs(PROMPTS[:2]), GREEDY, lora_request=[None])
    assert not qwen3_llm.has_unfinished_requests()


def test_lora_needs_enable_lora(tiny_qwen3: Path, qwen3_adapters: tuple[Path, Path]) -> None:
    llm = LLM.__new__(LLM)  # the check runs before the engine: no engine needed to see it refuse
    from vllm_actors.engine_args import make_engine_config
    from vllm_actors.lora.check import AdapterCheck

    llm._check_adapter = AdapterCheck.of(make_engine_config(str(tiny_qwen3), {}))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm._loras(LoRARequest("a", 1, str(qwen3_adapters[0])), 1)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "somewhere")


def test_llama_adapters_over_two_ranks(tiny_llama_tp: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """TP=2 (gloo): B of q/k/v/gate/up split by rows, A of o/down by columns, each rank's partial sum."""
    root = tmp_path_factory.mktemp("lora_engine_llama")
    first = build_adapter(tiny_llama_tp, root / "a", rank=8, seed=21)
    second = build_adapter(tiny_llama_tp, root / "b", targets=("q_proj", "v_proj", "o_proj", "down_proj"), rank=4,
                           seed=22)
    loras = [LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second)), None]
    with LLM(str(tiny_llama_tp), tensor_parallel_size=2, max_loras=2, **ENGINE) as llm:  # type: ignore[arg-type]
        got = _tokens(llm.generate(_inputs(PROMPTS), GREEDY, use_tqdm=False, lora_request=loras))
    want = [reference_greedy(tiny_llama_tp, adapter, prompt, MAX_TOKENS)
            for adapter, prompt in zip((first, second, None), PROMPTS, strict=True)]
    assert got == want
