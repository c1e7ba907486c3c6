"""vLLM's request fields through the real server (``vllm-actors serve`` on the
tiny checkpoint, float32, CPU): prompt_logprobs against transformers' log-softmax, -1 logprobs,
return_token_ids, return_tokens_as_token_ids, chat echo and continue_final_message,
truncate_prompt_tokens, every field of vLLM's request models honoured or a 400 naming it, 415,
lax booleans, and the official ``openai`` client's typed models over every response and chunk."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import torch

from tests.support.server_helpers import served_url
from vllm_actors.server.errors import OpenAIError as OpenAIErrorType
from vllm_actors.server.fields import BY_NAME, FIELDS, markdown_table
from vllm_actors.server.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "tiny"
MAX_MODEL_LEN = 256
README = Path(__file__).resolve().parents[2] / "README.md"

# vLLM 0.26.0's CompletionRequest and ChatCompletionRequest fields
# (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py).
VLLM_COMMON = (
    "model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream stream_options "
    "temperature top_p user use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids "
    "include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens "
    "truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs logprob_token_ids bad_words "
    "add_special_tokens response_format structured_outputs priority request_id return_tokens_as_token_ids "
    "return_token_ids return_token_offsets cache_salt kv_transfer_params ec_transfer_params vllm_xargs "
    "repetition_detection thinking_token_budget echo").split()
VLLM_COMPLETION = [*VLLM_COMMON, "prompt", "suffix", "prompt_embeds"]
VLLM_CHAT = [*VLLM_COMMON, "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
             "reasoning_effort", "include_reasoning", "parallel_tool_calls", "add_generation_prompt",
             "continue_final_message", "documents", "chat_template", "chat_template_kwargs", "media_io_kwargs",
             "mm_processor_kwargs", "return_prompt_text", "return_assistant_tokens_mask"]


@pytest.fixture(scope="module")
def base_url(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_url(tiny_qwen3, tmp_path_factory.mktemp("fields"), "--served-model-name", MODEL, "--max-model-len",
                    str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "256", "--max-logprobs", "-1",
                    "--enable-prompt-tokens-details") as url:
        yield url


def post(base_url: str, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/{path}", json=body, timeout=60, **kwargs)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path):  # noqa: ANN201
    """transformers' float32 log-softmax over a token list: [positions, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    model.eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax


def check_prompt_logprobs(entries: list[Any], ids: list[int], reference: torch.Tensor, top: int) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for position in range(1, len(ids)):
        row = reference[position - 1]
        entry = {int(key): value for key, value in entries[position].items()}
        actual = ids[position]
        assert abs(entry[actual]["logprob"] - row[actual].item()) < 1e-4, position
        assert entry[actual]["rank"] == int((row > row[actual]).sum()) + 1
        expected_top = row.topk(top).indices.tolist() if top > 0 else []
        assert set(entry) == {actual, *expected_top}
        for token_id, value in entry.items():
            assert abs(value["logprob"] - row[token_id].item()) < 1e-4
            assert isinstance(value["decoded_token"], str)


def test_prompt_logprobs_match_transformers_on_both_endpoints(base_url: str, reference) -> None:  # noqa: ANN001
    body = ok(post(base_url, "completions", {"prompt": "The quick brown fox jumps", "max_tokens": 2,
                                             "prompt_logprobs": 3, "return_token_ids": True}))
    choice = body["choices"][0]
    ids = choice["prompt_token_ids"]
    check_prompt_logprobs(choice["prompt_logprobs"], ids, reference(ids), 3)
    # -1: the whole vocabulary at every position.
    body = ok(post(base_url, "completions", {"prompt": "Hello there", "max_tokens": 1, "prompt_logprobs": -1,
                                             "return_token_ids": True}))
    ids = body["choices"][0]["prompt_token_ids"]
    expected = reference(ids)
    check_prompt_logprobs(body["choices"][0]["prompt_logprobs"], ids, expected, expected.shape[1])
    # Chat: one list for the response.
    chat = ok(post(base_url, "chat/completions", {"messages": [{"role": "user", "content": "Count to three"}],
                                                  "max_tokens": 2, "prompt_logprobs": 0, "return_token_ids": True}))
    ids = chat["prompt_token_ids"]
    check_prompt_logprobs(chat["prompt_logprobs"], ids, reference(ids), 0)
    # Not asked: null, as vLLM.
    plain = ok(post(base_url, "completions", {"prompt": "Hello", "max_tokens": 1}))
    assert plain["choices"][0]["prompt_logprobs"] is None and plain["choices"][0]["token_ids"] is None
    assert ok(post(base_url, "chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 1}))["prompt_logprobs"] is None


def test_logprobs_of_the_whole_vocabulary_and_tokens_as_ids(base_url: str, reference) -> None:  # noqa: ANN001
    body = ok(post(base_url, "completions", {"prompt": "Hello there", "max_tokens": 2, "temperature": 0,
                                             "logprobs": -1, "return_token_ids": True,
                                             "return_tokens_as_token_ids": True}))
    choice = body["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    expected = reference(ids)
    vocab = expected.shape[1]
    first = len(choice["prompt_token_ids"]) - 1
    for step, token_id in enumerate(choice["token_ids"]):
        tops = choice["logprobs"]["top_logprobs"][step]
        assert len(tops) == vocab and choice["logprobs"]["tokens"][step] == f"token_id:{token_id}"
        assert abs(tops[f"token_id:{token_id}"] - expected[first + step, token_id].item()) < 1e-4
    chat = ok(post(base_url, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                  "logprobs": True, "top_logprobs": -1,
                                                  "return_tokens_as_token_ids": True}))
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(entry["top_logprobs"]) == vocab for entry in content)
    assert all(re.fullmatch(r"token_id:\d+", entry["token"]) for entry in content)


def test_echo_truncation_and_continue_final_message(base_url: str) -> None:
    long = "one two three four five six seven eight nine ten"
    full = ok(post(base_url, "completions", {"prompt": long, "max_tokens": 1, "return_token_ids": True}))
    ids = full["choices"][0]["prompt_token_ids"]
    cut = ok(post(base_url, "completions", {"prompt": long, "max_tokens": 1, "return_token_ids": True,
                                            "truncate_prompt_tokens": 3}))
    assert cut["choices"][0]["prompt_token_ids"] == ids[-3:] and cut["usage"]["prompt_tokens"] == 3
    right = ok(post(base_url, "completions", {"prompt": long, "max_tokens": 1, "return_token_ids": True,
                                              "truncate_prompt_tokens": 3, "truncation_side": "right"}))
    assert right["choices"][0]["prompt_token_ids"] == ids[:3]
    over = post(base_url, "completions", {"prompt": long, "max_tokens": 10, "truncate_prompt_tokens": 250})
    assert over.status_code == 400 and over.json()["error"]["param"] == "truncate_prompt_tokens"
    huge = " ".join(["word"] * 400)  # longer than max_model_len: fits once truncated (-1: 256 - max_tokens)
    fitted = ok(post(base_url, "completions", {"prompt": huge, "max_tokens": 6, "truncate_prompt_tokens": -1}))
    assert fitted["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 6
    # echo with max_tokens 0: the prompt and its logprobs only (vLLM's scoring request).
    echo = ok(post(base_url, "completions", {"prompt": long, "max_tokens": 0, "echo": True, "logprobs": 0}))
    assert echo["choices"][0]["text"] == long
    assert len(echo["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert echo["choices"][0]["logprobs"]["token_logprobs"][0] is None
    # chat: continue the assistant's last message, echoing it.
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}]
    chat = ok(post(base_url, "chat/completions", {"messages": messages, "max_tokens": 2, "echo": True,
                                                  "continue_final_message": True, "add_generation_prompt": False,
                                                  "return_prompt_text": True}))
    assert chat["prompt_text"].endswith("<|im_start|>assistant\nHi the")  # left open: no <|im_end|>
    assert chat["choices"][0]["message"]["content"].startswith("Hi the")
    both = post(base_url, "chat/completions", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]
    own = post(base_url, "chat/completions", {"messages": messages, "chat_template": "{{ messages[0].content }}"})
    assert own.status_code == 400 and "--trust-request-chat-template" in own.json()["error"]["message"]
    bos = [ok(post(base_url, "chat/completions", {"messages": messages[:1], "max_tokens": 1, "return_token_ids": True,
                                                  "add_special_tokens": flag}))["prompt_token_ids"]
           for flag in (False, True)]
    assert len(bos[1]) >= len(bos[0]) and bos[1][-len(bos[0]):] == bos[0]
    # echo when the reply's role differs from the last message's: nothing prepended.
    plain = ok(post(base_url, "chat/completions", {"messages": messages[:1], "max_tokens": 2, "echo": True,
                                                   "temperature": 0}))
    again = ok(post(base_url, "chat/completions", {"messages": messages[:1], "max_tokens": 2, "temperature": 0}))
    assert plain["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]


REJECTED_VALUES: dict[str, Any] = {
    "suffix": "x", "use_beam_search": True, "length_penalty": 0.5,
    "logprob_token_ids": [1], "thinking_token_budget": 5, "repetition_detection": {"max_pattern_size": 3},
    "prompt_embeds": "AAAA", "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"a": 1},
    "return_token_offsets": True, "return_assistant_tokens_mask": True, "cache_salt": "salt",
    "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
}


@pytest.mark.parametrize("name", sorted(REJECTED_VALUES))
def test_fields_the_engine_cannot_honour_are_a_400_naming_them(base_url: str, name: str) -> None:
    field = BY_NAME[name]
    for path, base in (("completions", {"prompt": "Hi", "max_tokens": 1}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})):
        if field.endpoint not in ("both", path.split("/")[0]):
            continue
        response = post(base_url, path, {**base, name: REJECTED_VALUES[name]})
        assert response.status_code == 400, (name, path, response.text)
        assert response.json()["error"]["param"] == name
        kind = CompletionRequest if path == "completions" else ChatCompletionRequest
        (default,) = [f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
                      for f in msgspec.structs.fields(kind) if f.name == name]
        neutral = post(base_url, path, {**base, name: default})  # the default: "not used"
        assert neutral.status_code == 200, (name, path, neutral.text)


def test_every_vllm_field_is_in_the_models_the_table_and_the_readme() -> None:
    completion = set(CompletionRequest.__struct_fields__)
    chat = set(ChatCompletionRequest.__struct_fields__)
    assert set(VLLM_COMPLETION) <= completion, set(VLLM_COMPLETION) - completion
    assert set(VLLM_CHAT) <= chat, set(VLLM_CHAT) - chat
    assert set(VLLM_COMPLETION) | set(VLLM_CHAT) <= set(BY_NAME)
    for field in FIELDS:
        assert field.status in ("honoured", "rejected"), field
        assert (field.status == "rejected") == (field.neutral is not None), field
        models = {"both": [completion, chat], "completions": [completion], "chat": [chat]}[field.endpoint]
        assert all(field.name in model for model in models), field
    fields_page = README.parent / "docs" / "requests.md"
    assert markdown_table() in fields_page.read_text(), "docs/requests.md's table is stale: paste markdown_table()"


def test_lax_booleans_and_numbers_and_415(base_url: str) -> None:
    body = ok(post(base_url, "completions", {"prompt": "Hi", "max_tokens": "3", "ignore_eos": "true",
                                             "echo": "false", "n": 2.0, "temperature": "0"}))
    streamed = post(base_url, "completions", {"prompt": "Hi", "max_tokens": 2, "stream": "1",
                                              "stream_options": {"include_usage": "yes"}})
    assert streamed.status_code == 200 and '"usage":{"prompt_tokens"' in streamed.text
    assert [c["text"] for c in body["choices"]][0] == body["choices"][1]["text"]
    assert body["usage"]["completion_tokens"] == 6
    for bad, param in (({"ignore_eos": "maybe"}, "ignore_eos"), ({"max_tokens": "3.5"}, "max_tokens"),
                       ({"user": 5}, "user")):
        response = post(base_url, "completions", {"prompt": "Hi", **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    form = httpx.post(f"{base_url}/v1/completions", content=b"prompt=hi&max_tokens=2", timeout=30,
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and form.json()["error"]["code"] == 415
    text = httpx.post(f"{base_url}/v1/chat/completions", content=json.dumps({"messages": []}), timeout=30,
                      headers={"content-type": "text/plain"})
    assert text.status_code == 415
    for seed in (-(2**63), 2**63 - 1, -1):
        ok(post(base_url, "completions", {"prompt": "Hi", "max_tokens": 1, "seed": seed}))
    for seed in (2**63, -(2**63) - 1, 2**64):
        assert post(base_url, "completions", {"prompt": "Hi", "max_tokens": 1, "seed": seed}).status_code == 400


def test_the_openai_client_parses_every_response_and_chunk(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=MODEL, prompt=["Hello", "The fox"], max_tokens=4, logprobs=2,
                                           echo=True, n=2, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    assert len(completion.choices) == 4 and completion.usage is not None
    for choice in completion.choices:
        assert choice.logprobs is not None and choice.logprobs.tokens and choice.logprobs.top_logprobs
        extra = choice.model_extra or {}
        assert extra["prompt_logprobs"][0] is None and extra["prompt_token_ids"] and extra["token_ids"]
        # echo: the prompt's tokens (first without a logprob) then the generated ones
        assert len(choice.logprobs.tokens) == len(extra["prompt_token_ids"]) + len(extra["token_ids"])
        assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=1, stream=True,
                                            echo=True, extra_body={"return_token_ids": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices
    assert sum(len((c.choices[0].model_extra or {}).get("token_ids", [])) for c in chunks if c.choices) == 4
    prompt_ids = (chunks[0].choices[0].model_extra or {})["prompt_token_ids"]
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert len(streamed) == len(prompt_ids) + 4 and "".join(c.choices[0].text for c in chunks if c.choices
                                                            ).startswith("Hello")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, n=2,
                                          extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 6
    assert all(c.logprobs and c.logprobs.content and len(c.logprobs.content[0].top_logprobs) == 2
               for c in chat.choices)
    assert (chat.model_extra or {})["prompt_logprobs"][0] is None
    stream = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True, top_logprobs=3,
        stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert (stream[0].model_extra or {})["prompt_token_ids"]
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert len(tokens) == 3 and all(len(t.top_logprobs) == 3 for t in tokens)
    assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == 3


LAX_VALUES: list[Any] = ["true", "True", "TRUE", " yes ", "on", "off", "No", "t", "f", "y", "n", "1", "0", "2",
                         "maybe", "null", "", "12", " 12 ", "-3", "+4", "1_000", "1__0", "3.0", "3.", "3.00", "3.5",
                         " -7.0 ", "1e3", "1.5e2", "0x10", "\u0661\u0662", "inf", "-Infinity", "nan", 0, 1, 2, 3.0,
                         3.5, True, False, -1, None, [1], {"a": 1}]


@pytest.mark.parametrize("name", ["ignore_eos", "max_tokens", "temperature"])  # a bool, an int, a float field
def test_lax_coercion_matches_pydantics(name: str) -> None:
    """What vLLM's pydantic models accept for a scalar field, and as what: the same here."""
    import pydantic

    from vllm_actors.server.fields import lax_decode

    kind = {"ignore_eos": bool, "max_tokens": int | None, "temperature": float | None}[name]
    model = pydantic.create_model("Reference", **{name: (kind, None)})  # type: ignore[call-overload]
    for value in LAX_VALUES:
        body = json.dumps({"prompt": "x", name: value}, allow_nan=True).encode()
        try:
            expected: Any = getattr(model.model_validate({name: value}), name)
        except pydantic.ValidationError:
            expected = "error"
        try:
            actual: Any = getattr(lax_decode(body, CompletionRequest), name)
        except msgspec.ValidationError:
            actual = "error"
        if isinstance(expected, float) and expected != expected:  # nan
            assert isinstance(actual, float) and actual != actual, (name, value)
            continue
        assert (actual, type(actual)) == (expected, type(expected)), (name, value, actual, expected)


def test_the_server_flag_spells_tokens_as_ids_unless_the_request_says_otherwise() -> None:
    import argparse
    from types import SimpleNamespace

    from vllm_actors.server.args import add_server_arguments
    from vllm_actors.server.serving import ServerOptions, ServerState

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = parser.parse_args(["--return-tokens-as-token-ids", "--max-logprobs", "-1", "--trust-request-chat-template"])
    assert (args.return_tokens_as_token_ids, args.max_logprobs, args.trust_request_chat_template) == (True, -1, True)
    defaults = parser.parse_args([])
    assert (defaults.return_tokens_as_token_ids, defaults.max_logprobs) == (False, 20)
    frontend = SimpleNamespace(token_text=lambda token_id: f"<{token_id}>", vocab_size=100)
    for flag, request, expected in ((True, None, "token_id:7"), (True, False, "<7>"), (False, None, "<7>"),
                                    (False, True, "token_id:7")):
        state = ServerState(client=SimpleNamespace(frontend=frontend), served_model_names=["m"],  # type: ignore[arg-type]
                            max_num_seqs=1, max_waiting_requests=None, metrics=None,  # type: ignore[arg-type]
                            options=ServerOptions(return_tokens_as_token_ids=flag))
        assert state.token_text(7, request) == expected
    capped = ServerState(client=SimpleNamespace(frontend=frontend), served_model_names=["m"],  # type: ignore[arg-type]
                         max_num_seqs=1, max_waiting_requests=None, metrics=None)  # type: ignore[arg-type]
    capped.check_logprobs("logprobs", 20)
    for value in (21, -1, -2):  # -1 is the vocabulary (100): over the default cap of 20
        with pytest.raises(OpenAIErrorType) as raised:
            capped.check_logprobs("logprobs", value)
        assert raised.value.param == "logprobs"


def test_continuous_usage_stats_put_usage_on_every_chat_chunk(base_url: str) -> None:
    """The role chunk included (it said ``usage: null``, which clients reading every chunk's usage
    crashed on); the counts grow with the generated tokens, and the last chunk has the totals."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.usage is not None for chunk in chunks)
    prompt = chunks[0].usage.prompt_tokens  # type: ignore[union-attr]
    assert prompt > 0 and chunks[0].usage.completion_tokens == 0  # type: ignore[union-attr]
    completions = [chunk.usage.completion_tokens for chunk in chunks]  # type: ignore[union-attr]
    assert completions == sorted(completions) and completions[-1] == 4
    assert all(chunk.usage.prompt_tokens == prompt for chunk in chunks)  # type: ignore[union-attr]
    # without continuous stats: null on every chunk but the last (OpenAI's rule)
    plain = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    assert all(chunk.usage is None for chunk in plain[:-1]) and plain[-1].usage is not None


def test_cached_tokens_in_usage_count_the_prompt_found_in_the_prefix_cache(base_url: str) -> None:
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, streamed and not.
    The second request with the same long prompt finds its whole blocks cached (block size 16)."""
    prompt = [(7 * i) % 400 + 5 for i in range(70)]  # 70 tokens: four whole blocks of 16 can be cached
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = ok(post(base_url, "completions", body))["usage"]
    assert first["prompt_tokens"] == 70
    again = ok(post(base_url, "completions", body))["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == 64
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    details = chunks[-1].usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.cached_tokens == 64
    fresh = [(11 * i) % 400 + 3 for i in range(40)]
    chat = ok(post(base_url, "chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "a story about a cat " * 8}], "max_tokens": 2}))
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] in range(0, chat["usage"]["prompt_tokens"] + 1)
    assert ok(post(base_url, "completions", {**body, "prompt": fresh}))["usage"][
        "prompt_tokens_details"] == {"cached_tokens": 0}
