"""Sampling controls through the real server: presence/frequency/repetition penalties, logit_bias,
allowed_token_ids and bad_words honoured on both endpoints; invalid values a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_helpers import served_url
from vllm_actors.actors.frontend.controls import bad_words_token_ids
from vllm_actors.actors.frontend.tokenizer import load_tokenizer

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}]}
COMPLETION = {"prompt": "The quick brown fox"}
ENDPOINTS = [("completions", COMPLETION), ("chat/completions", CHAT)]


@pytest.fixture(scope="module")
def base_url(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_url(tiny_qwen3, tmp_path_factory.mktemp("controls"), "--max-model-len", "256",
                    "--num-gpu-blocks-override", "256") as url:
        yield url


def generate(base_url: str, path: str, body: dict[str, Any]) -> list[int]:
    full = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **body}
    response = httpx.post(f"{base_url}/v1/{path}", json=full, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("path", "base"), ENDPOINTS)
def test_controls_are_honoured(base_url: str, tiny_qwen3: Path, path: str, base: dict[str, Any]) -> None:
    plain = generate(base_url, path, base)
    assert generate(base_url, path, {**base, "logit_bias": {"42": 100}}) == [42] * 8
    assert set(generate(base_url, path, {**base, "temperature": 1.0, "seed": 3,
                                         "allowed_token_ids": [11, 12, 13]})) <= {11, 12, 13}
    banned = generate(base_url, path, {**base, "logit_bias": {str(plain[0]): -100, str(plain[1]): -100}})
    assert not {plain[0], plain[1]} & set(banned)
    tokenizer = load_tokenizer(tiny_qwen3)
    word = tokenizer.decode([plain[0]])
    sequences = bad_words_token_ids(tokenizer, [word])
    ids = generate(base_url, path, {**base, "bad_words": [word]})
    for sequence in sequences:
        assert not any(ids[i:i + len(sequence)] == sequence for i in range(len(ids)))
    # negative penalties reward what was said: the output repeats itself (the plain one does not)
    assert len(set(plain)) == len(plain)
    rewarded = generate(base_url, path, {**base, "presence_penalty": -2.0, "frequency_penalty": -2.0,
                                         "repetition_penalty": 0.05})
    assert len(set(rewarded)) < len(rewarded)


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"allowed_token_ids": [1000000]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [3]}, "bad_words"),
]


@pytest.mark.parametrize(("body", "field"), BAD)
def test_invalid_values_are_a_400_naming_the_field(base_url: str, body: dict[str, Any], field: str) -> None:
    for path, base in ENDPOINTS:
        response = httpx.post(f"{base_url}/v1/{path}", json={**base, "max_tokens": 1, **body}, timeout=60)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == field, response.text
