"""The offline API: vLLM's names, seeded sampling, n > 1, stop strings, bad input, and vLLM's engine
commands (sleep, wake_up, is_sleeping, reset_prefix_cache) of a process group and in process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_actors import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):
    with LLM(str(tiny_qwen3), dtype="float32", max_num_batched_tokens=128, seed=0) as engine:
        yield engine


def test_seeded_sampling_ignores_the_batch_around_it(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("the quick brown fox", seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["a b c", "the quick brown fox", "numbers 1 2 3 4 5 6 7 8 9", "hello"]
    together = llm.generate(crowd, [other, seeded, other, other], use_tqdm=False)[1].outputs[0].token_ids
    later = llm.generate(["zzz", "the quick brown fox"], [other, seeded], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == together == later


def test_n_gives_distinct_samples(llm: LLM) -> None:
    output = llm.generate("once upon a time", SamplingParams(n=4, temperature=1.0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    seeded = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    first = llm.generate("once upon a time", seeded, use_tqdm=False)[0]
    again = llm.generate("once upon a time", seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_outputs_keep_prompt_order_and_fields(llm: LLM) -> None:
    prompts = ["one", "two two", {"prompt_token_ids": [5, 6, 7]}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["one", "two two", None]
    assert outputs[2].prompt_token_ids == [5, 6, 7]
    tokenizer = llm.get_tokenizer()
    for output in outputs:
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason == "length" and len(completion.token_ids) == 5
        assert completion.text == tokenizer.decode(completion.token_ids)


def test_stop_strings_are_cut_from_the_output(llm: LLM) -> None:
    free = llm.generate("the", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a better stop string from {text!r}"
    cut = llm.generate("the", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate("the", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        ("hi", {"temperature": -1.0}, "temperature"),
        ({"prompt_token_ids": []}, {}, "prompt"),
        ({"prompt_token_ids": [10**9]}, {}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 5000}, {}, "max_model_len"),
        (12345, {}, "prompt"),
        ({"text": "no key"}, {}, "prompt"),
    ],
)
def test_bad_input_raises_and_the_engine_keeps_serving(llm: LLM, prompts, params, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate(["fine prompt", prompts], SamplingParams(**params) if params else None, use_tqdm=False)
    assert not llm.has_unfinished_requests()  # the good prompt of that call was not queued either
    output = llm.generate("still serving", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 3


def _greedy(llm: LLM, prompt: str = "the cat sat on the mat and looked at the moon in the night sky and more") \
        -> tuple[list[int], int]:
    output = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    return list(output.outputs[0].token_ids), output.num_cached_tokens


def _sleep_wake_and_reset(llm: LLM, level: int) -> None:
    """vLLM's LLM.sleep / wake_up / reset_prefix_cache (and is_sleeping) on one engine."""
    assert llm.reset_prefix_cache() is True
    first, cached = _greedy(llm)
    assert cached == 0
    assert _greedy(llm) == (first, 16)  # the same prompt hits the cache (whole blocks of 16)
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert _greedy(llm) == (first, 0)  # nothing left to hit
    assert llm.is_sleeping() is False
    llm.sleep(level=level)
    assert llm.is_sleeping() is True
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() is True  # the KV cache still sleeps
    llm.wake_up()
    assert llm.is_sleeping() is False
    assert _greedy(llm) == (first, 0)  # the same tokens; the KV cache came back empty
    with pytest.raises(ValueError, match="level: must be 0, 1 or 2, got 3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    assert llm.is_sleeping() is False


def test_sleep_wake_up_and_reset_prefix_cache_of_a_process_group(llm: LLM) -> None:
    _sleep_wake_and_reset(llm, level=1)


def test_sleep_wake_up_and_reset_prefix_cache_in_process(tiny_qwen3: Path) -> None:
    with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", seed=0) as engine:
        _sleep_wake_and_reset(engine, level=2)  # level 2 reloads the weights from the checkpoint


def test_engine_arguments_use_vllms_names(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_qwen3), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs the process executor"):
        LLM(str(tiny_qwen3), executor="inprocess", tensor_parallel_size=2)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_qwen3), max_num_seq=4)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_qwen3), dtype="int3")


def test_skip_tokenizer_init_takes_token_ids(tiny_qwen3: Path) -> None:
    with LLM(str(tiny_qwen3), skip_tokenizer_init=True, num_gpu_blocks_override=64) as llm:
        output = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, ignore_eos=True),
                              use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].text == ""
        with pytest.raises(ValueError, match="tokenizer"):
            llm.generate("text", use_tqdm=False)


def test_cli_generate_and_chat(tiny_qwen3: Path) -> None:
    base = [sys.executable, "-m", "vllm_actors"]

    def start(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*base, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    # The three commands are independent (each its own group, or none): they run side by side.
    generating = start("generate", "--model", str(tiny_qwen3), "--max-tokens", "5", "hello there")
    chatting = start("chat", "--model", str(tiny_qwen3), "--max-tokens", "4")
    refusing = start("generate", "--model", str(tiny_qwen3), "--temperature", "-2", "x")
    try:
        generated = generating.communicate("", timeout=300)
        chat = chatting.communicate("hi\nand again\n\n", timeout=300)
        bad = refusing.communicate("", timeout=300)
    finally:
        for process in (generating, chatting, refusing):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert generating.returncode == 0, generated[1]
    assert "hello there" in generated[0] and "5 tokens" in generated[0]
    assert chatting.returncode == 0, chat[1]
    assert chat[0].count("> ") == 3
    assert refusing.returncode == 2 and "temperature" in bad[1]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_prefix_caching_and_policy_flags_reach_the_engine(command: str) -> None:
    from vllm_actors.cli import build_parser, engine_kwargs

    parser = build_parser()
    base = [command, "hello"] if command == "generate" else [command, "some/model"]
    assert engine_kwargs(parser.parse_args(base))["enable_prefix_caching"] is True
    kwargs = engine_kwargs(parser.parse_args([*base, "--no-enable-prefix-caching", "--scheduling-policy", "lpm"]))
    assert (kwargs["enable_prefix_caching"], kwargs["scheduling_policy"]) == (False, "lpm")
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--scheduling-policy", "random"])
    assert engine_kwargs(parser.parse_args(base))["distributed_executor_backend"] == "mp"
    kwargs = engine_kwargs(parser.parse_args([*base, "-dp", "2", "--distributed-executor-backend", "ray"]))
    assert (kwargs["data_parallel_size"], kwargs["distributed_executor_backend"]) == (2, "ray")
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--distributed-executor-backend", "slurm"])
