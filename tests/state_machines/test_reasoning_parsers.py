"""The reasoning parsers (server/reasoning.py) on vLLM 0.26's cases (tests/reasoning/ there): whole
outputs and the same outputs a token at a time, as a stream sees them, on the tiny tokenizer with
<think> and </think> tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import THINK_TOKENS, build_tokenizer
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer
from vllm_actors.server.reasoning import ReasoningParser


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("think_tokenizer")
    build_tokenizer(path, THINK_TOKENS)
    return load_tokenizer(path)


def parser(tokenizer: Tokenizer, name: str) -> ReasoningParser:
    return ReasoningParser.create(name, tokenizer.token_to_id)


def streamed(tokenizer: Tokenizer, name: str, text: str, prompt: list[int] | None = None,
             **template: object) -> tuple[str | None, str | None, int]:
    """(reasoning, content, steps without a chunk) rebuilt from one-token steps, as a client does."""
    request = parser(tokenizer, name).for_request(prompt or [], template)
    stream = request.stream()
    ids = tokenizer.encode(text, add_special_tokens=False)
    reasoning: list[str] = []
    content: list[str] = []
    silent = 0
    for end in range(1, len(ids) + 1):
        delta = tokenizer.decode(ids[:end])[len(tokenizer.decode(ids[:end - 1])):]
        thought, said = stream.feed(delta, ids[end - 1:end])
        silent += thought is None and said is None
        reasoning += [thought] if thought is not None else []
        content += [said] if said is not None else []
    return ("".join(reasoning) if reasoning else None), ("".join(content) if content else None), silent


CASES = [  # output, reasoning, content: both parsers alike
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat", "This is a reasoning\nsection",
     "This is the rest\nThat"),
    ("This is the rest", "This is the rest", None),  # no </think>: cut short while thinking
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("output,reasoning,content", CASES)
def test_whole_and_streamed_outputs_split_as_vllms(tokenizer: Tokenizer, name: str, output: str,
                                                   reasoning: str | None, content: str | None) -> None:
    assert parser(tokenizer, name).for_request([], {}).split(output) == (reasoning, content)
    assert streamed(tokenizer, name, output)[:2] == (reasoning, content)


def test_a_step_of_a_tag_alone_sends_no_chunk(tokenizer: Tokenizer) -> None:
    assert streamed(tokenizer, "deepseek_r1", "<think>ab</think>cd")[2] == 2  # <think>, </think>
    assert streamed(tokenizer, "qwen3", "ab</think>cd")[2] == 1


def test_qwen3_without_thinking_is_all_content(tokenizer: Tokenizer) -> None:
    request = parser(tokenizer, "qwen3").for_request([], {"enable_thinking": False})
    assert request.split("This is plain content") == (None, "This is plain content")
    assert request.grammar_start is None  # structured outputs from the first token
    assert streamed(tokenizer, "qwen3", "plain text", enable_thinking=False)[:2] == (None, "plain text")
    # deepseek_r1 has no such switch
    request = parser(tokenizer, "deepseek_r1").for_request([], {"enable_thinking": False})
    assert request.split("plain") == ("plain", None) and request.grammar_start == tokenizer.token_to_id("</think>")


def test_a_prompt_that_closed_the_reasoning_makes_the_output_content(tokenizer: Tokenizer) -> None:
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    for name in ("qwen3", "deepseek_r1"):
        request = parser(tokenizer, name).for_request(closed, {})
        assert request.split("just text") == (None, "just text") and request.grammar_start is None
        assert streamed(tokenizer, name, "just text", prompt=closed)[:2] == (None, "just text")
        request = parser(tokenizer, name).for_request(opened, {})
        assert request.split("a</think>b") == ("a", "b") and request.grammar_start == tokenizer.token_to_id("</think>")


def test_the_tags_must_be_tokens_and_the_name_known(tokenizer: Tokenizer, tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    plain = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no <think> and </think> tokens"):
        ReasoningParser.create("qwen3", plain.token_to_id)
    with pytest.raises(ValueError, match="unknown parser 'granite'.*deepseek_r1, qwen3"):
        ReasoningParser.create("granite", tokenizer.token_to_id)
