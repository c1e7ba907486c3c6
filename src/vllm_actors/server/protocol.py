"""OpenAI's request and response bodies as msgspec Structs (vLLM's extra sampling fields included).

Requests are decoded strictly (a wrong type is an error naming the field); unknown fields are
ignored, as OpenAI and vLLM do. ``prompt`` and message ``content`` take several shapes and are
checked by hand (``normalize_prompts``). Response fields that OpenAI sends as ``null`` are sent
as ``null``; fields it leaves out are ``UNSET`` (left out of the JSON).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

Number = float


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: Number | None = None
    top_p: Number | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # str, list[str], list[int] or list[list[int]]: see normalize_prompts
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    # vLLM's extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


# --------------------------------------------------------------------------- responses
class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    system_fingerprint: str | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob] | None = None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[Any] = []


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None | UnsetType = UNSET
    system_fingerprint: str | None = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "vllm_actors"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard] = []


def now() -> int:
    return int(time.time())


_encoder = msgspec.json.Encoder()


def encode(body: msgspec.Struct | dict[str, Any]) -> bytes:
    return _encoder.encode(body)


# --------------------------------------------------------------------------- prompt shapes
class PromptShapeError(ValueError):
    pass


def normalize_prompts(prompt: str | list[Any], max_tokens: int | None = None) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of prompts, each text or token ids. A token-id list
    longer than ``max_tokens`` is refused before its items are looked at."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise PromptShapeError("prompt: must not be an empty list")
    if _is_token(prompt[0]):
        _check_count(prompt, max_tokens)
        if all(_is_token(item) for item in prompt):
            return [list(prompt)]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if all(isinstance(item, list) for item in prompt):
        prompts: list[str | list[int]] = []
        for item in prompt:
            _check_count(item, max_tokens)
            if not item or not all(_is_token(token) for token in item):
                raise PromptShapeError("prompt: a list of token-id lists must hold non-empty lists of integers")
            prompts.append(list(item))
        return prompts
    raise PromptShapeError(
        "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists"
    )


def _check_count(ids: list[Any], max_tokens: int | None) -> None:
    if max_tokens is not None and len(ids) > max_tokens:
        raise PromptShapeError(f"prompt: {len(ids)} tokens is longer than max_model_len ({max_tokens})")


def _is_token(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)
