"""Error texts as vLLM 0.26 words them where its tests read them: the seed's bounds (pydantic's
message through vLLM's validation handler), every bad logit_bias key named, "out of vocabulary",
"decoder prompt cannot be empty". Served in process over a fake scheduler (no model, no processes)."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from tests.support.fake_served import Env, asgi, env, served_app, tokenizer  # noqa: F401
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.frontend.tokenizer import Tokenizer
from vllm_actors.protocol.sampling import MAX_SEED, MIN_SEED


class _VllmSeed(pydantic.BaseModel):
    """vLLM's field (openai/completion/protocol.py): the oracle of its message."""

    seed: int | None = pydantic.Field(None, ge=MIN_SEED, le=MAX_SEED)


def vllm_seed_message(seed: int) -> str:
    """What vLLM's validation_exception_handler prints for the seed's one error."""
    with pytest.raises(pydantic.ValidationError) as caught:
        _VllmSeed(seed=seed)
    (error,) = caught.value.errors(include_url=False)
    error = dict(error, loc=("body", *error["loc"]))
    return f"1 validation error:\n  {error}"


async def error_of(http: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await http.post(path, json={"model": "fake", "max_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    return dict(reply.json()["error"])


@pytest.mark.asyncio
async def test_http_error_texts_are_vllms(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    vocab = env.tokenizer.vocab_size
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        for path, prompt in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", chat)):
            for seed in (MAX_SEED + 1, MIN_SEED - 1):
                error = await error_of(http, path, {**prompt, "seed": seed})
                assert error["message"] == vllm_seed_message(seed) and error["param"] == "seed"
            error = await error_of(http, path, {**prompt, "logit_bias": {"a": 1, "5": 2, "b c": 3}})
            assert error["message"] == ("logit_bias contains key(s) that cannot be converted to integer token IDs: "
                                        "['a', 'b c']") and error["param"] == "logit_bias"
            error = await error_of(http, path, {**prompt, "logit_bias": {"5": 1, str(vocab): 2, "-1": 3}})
            assert error["message"] == (f"token_id(s) [{vocab}, -1] in logit_bias contain out-of-vocab token ids. "
                                        f"Vocabulary size: {vocab}") and error["param"] == "logit_bias"
        error = await error_of(http, "/v1/completions", {"prompt": [5, 999999]})
        assert "Token id 999999 is out of vocabulary".lower() in error["message"].lower()
        assert error["param"] == "prompt_token_ids"
        error = await error_of(http, "/v1/completions", {"prompt": ""})
        assert error["message"] == "Either prompt or prompt_embeds must be provided and non-empty."


def test_offline_error_texts_are_vllms(tokenizer: Tokenizer) -> None:  # noqa: F811
    """vLLM's tests/v1/engine/test_llm_engine (``LLM.generate``): ``match=`` on these words."""
    frontend = Frontend(tokenizer, [tokenizer.eos_token_id or 0], 256, tokenizer.vocab_size)
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        frontend.prepare("a", "", SamplingParams())
    with pytest.raises(ValueError, match="out of vocabulary"):
        frontend.prepare("b", {"prompt_token_ids": [999999]}, SamplingParams())
    with pytest.raises(ValueError, match=r"token_id\(s\) \[999999\] in logit_bias contain out-of-vocab"):
        frontend.prepare("c", {"prompt_token_ids": [5]}, SamplingParams(logit_bias={999999: 1.0}))
