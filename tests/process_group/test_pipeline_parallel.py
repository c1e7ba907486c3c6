"""Pipeline parallelism through the process group on the CPU (gloo point-to-point between the
stages): PP=2, PP=3 (uneven layer counts, a VLLM_PP_LAYER_PARTITION split) and PP=2 x TP=2 give
transformers' greedy tokens (float32) under preemption, chunked prefill and prefix-cache hits; a 2,000-token prompt
in 32 chunks pipelined through the stages (sequence pipeline parallelism) too; structured outputs
and penalties on the last stage (seeded samples in the grammar, penalised greedy outputs as vLLM's
formulas give them over transformers' logits); a SIGKILLed stage takes the replica's stages down,
which come back and finish every request; no process outlives the group."""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TP_LLAMA_SHAPE, TP_QWEN3_SHAPE
from tests.engine.test_correctness import reference_generate
from tests.process_group.test_tensor_parallel import _kill_when, prompts_for
from tests.support.lifecycle import settled_metrics
from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.sampling import StructuredOutputs
from vllm_actors.runtime.run_dir import pid_alive

MAX_TOKENS = 12
LONG_OUTPUTS = 100  # beside the long prompt: running for longer than its prefill at any chunk size
ENGINE = dict(dtype="float32", device="cpu", block_size=16, seed=0)
SHORT = dict(num_gpu_blocks_override=16, max_num_batched_tokens=32, max_model_len=256)  # preemption, chunks
LONG = dict(num_gpu_blocks_override=140, max_num_batched_tokens=64, max_model_len=2100)  # 2,000 tokens: 32 chunks


@pytest.fixture(scope="module")
def qwen3_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 (3 layers, tied embeddings: the last stage holds its own LM head) for 2,000 tokens."""
    return build_checkpoint(tmp_path_factory.mktemp("pp_qwen3"), "qwen3", tie_word_embeddings=True,
                            shape=TP_QWEN3_SHAPE | {"max_position_embeddings": 4096})


@pytest.fixture(scope="module")
def llama5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama of 5 layers (no even split over 2 or 3 stages), 6 KV heads (split at TP=2)."""
    return build_checkpoint(tmp_path_factory.mktemp("pp_llama5"), "llama", tie_word_embeddings=False, num_shards=2,
                            shape=TP_LLAMA_SHAPE | {"num_hidden_layers": 5})


def short_prompts(seed: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(n)] for n in (3, 17, 33, 60, 90, 120, 45, 70)[:count]]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def reference(path: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [tokens for tokens, _ in reference_generate(path, prompts, max_tokens=max_tokens)]


@pytest.fixture(scope="module")
def pp2(qwen3_long: Path) -> Iterator[LLM]:
    """One PP=2 group for the long prompt and the SIGKILL test (which ends it)."""
    with LLM(str(qwen3_long), pipeline_parallel_size=2, **ENGINE, **LONG) as llm:  # type: ignore[arg-type]
        yield llm


def test_pp2_long_prompt_in_chunks_matches_transformers(pp2: LLM, qwen3_long: Path) -> None:
    rng = random.Random(5)
    long, shorts = [rng.randrange(500) for _ in range(2000)], short_prompts(6)
    # The chunk sizes follow the cost model fitted from the measured steps, so who runs beside the
    # long prefill depends on timing: the short requests decode long enough (each token waits for
    # the one before it) to be running when the long prompt needs the pool, which forces preemption.
    params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
              for tokens in [MAX_TOKENS] + [LONG_OUTPUTS] * len(shorts)]
    outputs = pp2.generate([{"prompt_token_ids": prompt} for prompt in [long, *shorts]], params, use_tqdm=False)
    got = [list(output.outputs[0].token_ids) for output in outputs]
    prompts = [long, *shorts]
    metrics = settled_metrics(pp2, lambda m: m.requests_finished == len(prompts) and m.kv_blocks_in_use == 0)
    assert metrics.preemptions > 0, "the KV pool was meant to force preemption"
    assert metrics.prefill_chunks >= 2000 // 64, "the token budget was meant to split the long prompt"
    assert set(metrics.pipeline_bubbles) == {"stage 0", "stage 1"}  # from both stages' step events
    assert all(0.0 <= fraction < 1.0 for fraction in metrics.pipeline_bubbles.values())
    # greedy: the first MAX_TOKENS of each longer output are transformers' MAX_TOKENS
    assert [tokens[:MAX_TOKENS] for tokens in got] == reference(qwen3_long, prompts)


def penalised_reference(path: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Greedy outputs under each request's penalties: transformers' float32 logits of every step,
    penalised by vLLM's formulas (tests/models/test_sampling_controls.py) in float64."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.models.test_sampling_controls import reference as penalised

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt, p in zip(prompts, params, strict=True):
            generated: list[int] = []
            for _ in range(p.max_tokens or 0):
                logits = model(torch.tensor([prompt + generated])).logits[0, -1]
                generated.append(int(penalised(logits, p, prompt, generated).argmax()))
            outputs.append(generated)
    return outputs


def test_pp2_structured_outputs_and_penalties(pp2: LLM, qwen3_long: Path) -> None:
    """The last stage masks and penalises its rows; the stages before it only carry the tokens."""
    choices, number = ["alpha", "beta", "gamma"], r"[1-9][0-9]{2}-[a-c]{2}"
    shapes = (StructuredOutputs(choice=choices), StructuredOutputs(regex=number))
    constrained = [SamplingParams(temperature=1.0, seed=seed, max_tokens=16, structured_outputs=shape)
                   for seed in range(2) for shape in shapes]
    penalised = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=rep,
                                frequency_penalty=frequency, presence_penalty=presence)
                 for rep, frequency, presence in ((1.8, 0.0, 0.0), (1.0, 1.5, 0.5), (0.7, 0.0, -1.0))]
    prompts = short_prompts(11, count=3)
    outputs = pp2.generate([{"prompt_token_ids": prompts[i % 3]} for i in range(len(constrained))] +
                           [{"prompt_token_ids": prompt} for prompt in prompts], constrained + penalised,
                           use_tqdm=False)
    for output, params in zip(outputs, constrained, strict=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        shape = params.structured_outputs
        assert shape is not None
        assert completion.text in choices if shape.choice else re.fullmatch(number, completion.text), completion.text
    got = [list(output.outputs[0].token_ids) for output in outputs[len(constrained):]]
    assert got == penalised_reference(qwen3_long, prompts, penalised)
    assert got != reference(qwen3_long, prompts)  # the penalties changed the outputs


@pytest.mark.parametrize(("pp", "tp", "partition"), [(3, 1, "1,3,1"), (2, 2, None)])
def test_pp_greedy_matches_transformers(llama5: Path, pp: int, tp: int, partition: str | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if partition is not None:  # the workers read it from the environment they inherit
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    prompts = prompts_for(500, seed=pp)  # 10 prompts, four sharing a prefix
    with LLM(str(llama5), pipeline_parallel_size=pp, tensor_parallel_size=tp,  # type: ignore[arg-type]
             **ENGINE, **SHORT) as llm:
        got = greedy(llm, prompts)
        metrics = settled_metrics(llm, lambda m: m.requests_finished == len(prompts) and m.kv_blocks_in_use == 0)
        assert llm.group is not None
        assert sorted(llm.group.pids()) == sorted([f"worker-{rank}" for rank in range(pp * tp)]
                                                  + ["bus", "metrics", "kv_cache_manager", "scheduler"])
    assert metrics.preemptions > 0 and metrics.prefill_chunks > len(prompts) and metrics.prefix_cache_hits > 0
    assert got == reference(llama5, prompts)


def test_pp2_in_each_of_two_replicas_matches_transformers(llama5: Path) -> None:
    """Data parallelism over pipelines: each replica's stages start, meet and serve on their own."""
    prompts = prompts_for(500, seed=7)[:6]
    with LLM(str(llama5), pipeline_parallel_size=2, data_parallel_size=2, **ENGINE, **SHORT) as llm:  # type: ignore[arg-type]
        got = greedy(llm, prompts)
        metrics = settled_metrics(llm, lambda m: m.requests_finished == len(prompts) and m.kv_blocks_in_use == 0)
        assert llm.group is not None
        assert {f"worker-{rank}@{replica}" for rank in (0, 1) for replica in (0, 1)} <= set(llm.group.pids())
    assert {stage.split("@")[1] for stage in metrics.pipeline_bubbles} == {"0", "1"}  # both replicas served
    assert got == reference(llama5, prompts)


def test_more_stages_than_layers_fail_before_any_process_starts(llama5: Path) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 6 is larger than the model's 5 layers"):
        LLM(str(llama5), pipeline_parallel_size=6, **ENGINE)  # type: ignore[arg-type]


def sigkill_under_load_loses_nothing(llm: LLM, victim: str, extra_tokens: int, prompts: list[list[int]],
                                     model: Path) -> None:
    """SIGKILL worker ``victim`` once ``extra_tokens`` more tokens are out while ``prompts`` run greedily:
    both workers restart once, the outputs are transformers', no process is left after shutdown."""
    group = llm.group
    assert group is not None
    before = group.pids()
    generated = settled_metrics(llm, lambda m: True).generation_tokens
    killed = threading.Event()
    killer = threading.Thread(target=_kill_when, args=(llm, before[victim], generated + extra_tokens, killed),
                              daemon=True)
    killer.start()
    got = greedy(llm, prompts, max_tokens=16)
    killer.join(timeout=10)
    assert killed.is_set(), f"{victim} was not killed during the run"
    after = group.pids()
    assert after["worker-0"] != before["worker-0"] and after["worker-1"] != before["worker-1"]
    assert group.restarts() == {"worker-0": 1, "worker-1": 1}
    llm.shutdown()
    assert got == reference(model, prompts, max_tokens=16)
    assert group.stopped
    assert not [pid for pid in set(before.values()) | set(after.values()) if pid_alive(pid)]


def test_sigkill_of_a_stage_restarts_the_stages_and_loses_nothing(pp2: LLM, qwen3_long: Path) -> None:
    sigkill_under_load_loses_nothing(pp2, "worker-0", 40, short_prompts(9, count=6), qwen3_long)


