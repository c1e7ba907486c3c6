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
    # vLLM's other request fields: each honoured, or refused with a 400 naming it
    # (server/fields.py's table says which)
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    request_id: str | None = None
    use_beam_search: bool = False
    length_penalty: Number = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    logprob_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    # the older spellings of structured_outputs (vLLM before 0.12), still sent by many clients
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = 0  # vLLM's: lower runs first (--scheduling-policy priority)
    ttft_target_ms: Number | None = None  # latency targets from arrival (edf, lrs, --reject-unmeetable)
    e2e_target_ms: Number | None = None
    return_token_offsets: bool | None = False
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # str, list[str], list[int] or list[list[int]]: see normalize_prompts
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # defined below (helper 2's)
    add_special_tokens: bool = True
    prompt_embeds: Any = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # an assistant turn's thinking, shown to the chat template (vLLM's)
    reasoning_content: str | None = None  # the older name, read when reasoning is not given


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # "text", "json_object" or "json_schema" (server/structured.py)
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


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
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    echo: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None
    return_assistant_tokens_mask: bool = False


# --------------------------------------------------------------------------- responses
class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # with --enable-prompt-tokens-details (vLLM's flag); left out otherwise
    prompt_tokens_details: PromptTokensDetails | None | UnsetType = UNSET


def usage(prompt: int, completion: int, cached: int | None = None) -> Usage:
    """Token counts; ``cached`` (prompt tokens found in the prefix cache) when details are on."""
    body = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    if cached is not None:
        body.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
    return body


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(msgspec.Struct, kw_only=True):
    """One entry of vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # None for the first prompt token


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: set (maybe to null) in a response; in a stream chunk only when asked for
    token_ids: list[int] | None | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    prompt_token_ids: list[int] | None | UnsetType = UNSET


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


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str  # vLLM's "chatcmpl-tool-<hex>"
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of a tool call: the first has id, type and name, the rest arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = []
    reasoning: str | None = None  # vLLM's: the thinking, with --reasoning-parser


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None | UnsetType = UNSET
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # the first chunk's, with return_token_ids
    prompt_text: str | UnsetType = UNSET  # the first chunk's, with return_prompt_text


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
