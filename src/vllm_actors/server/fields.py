"""Every request field of vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` (vLLM 0.26.0):
honoured, or refused with a 400 naming it - none silently ignored. ``FIELDS`` is the table (the
one in docs/requests.md is rendered from it: ``markdown_table``); ``check_fields`` refuses what the engine cannot
honour. Fields outside vLLM's models are ignored, as vLLM does.

Also here: ``text_options`` (add_special_tokens, truncate_prompt_tokens, truncation_side as the
frontend's TextOptions), the body's media type (415 for anything but JSON) and pydantic's lax coercion, which
vLLM's request models get from pydantic and clients rely on (``"true"`` for a boolean, ``"3"`` for
an integer): ``lax_decode`` applies it to the fields of the request model only when the strict
decode fails, so well-typed bodies pay nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import msgspec

from vllm_actors.actors.frontend.text import TextOptions
from vllm_actors.server.errors import OpenAIError, bad_request

S = TypeVar("S", bound=msgspec.Struct)
Endpoint = Literal["both", "completions", "chat"]


@dataclass(frozen=True)
class Field:
    name: str
    endpoint: Endpoint
    status: str  # "honoured" or "rejected" (400 unless the value is neutral)
    note: str
    neutral: Callable[[Any], bool] | None = None  # for "rejected": the values that mean "not used"


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


FIELDS: list[Field] = [
    # OpenAI's own
    Field("model", "both", "honoured", "one of --served-model-name, else 404"),
    Field("prompt", "completions", "honoured", "a string, strings, token ids or lists of token ids"),
    Field("messages", "chat", "honoured", "text content (string or text parts); other parts 400"),
    Field("echo", "both", "honoured", "completions: the prompt (and its logprobs) before the text; chat: the last "
          "message's content before the reply when it has the reply's role"),
    Field("frequency_penalty", "both", "honoured", "[-2, 2], over output tokens (vLLM's order and formula)"),
    Field("presence_penalty", "both", "honoured", "[-2, 2], over output tokens"),
    Field("logit_bias", "both", "honoured", "token id (string key) -> bias, clamped to [-100, 100]; ids outside "
          "the vocabulary 400"),
    Field("logprobs", "both", "honoured", "completions: top-N (<= --max-logprobs, -1 the whole vocabulary); chat: "
          "a bool"),
    Field("top_logprobs", "chat", "honoured", "top-N per token (<= --max-logprobs, -1 the whole vocabulary), "
          "streamed too"),
    Field("max_tokens", "both", "honoured", "completions: 0 with echo returns the prompt only, as vLLM"),
    Field("max_completion_tokens", "chat", "honoured", "wins over max_tokens"),
    Field("n", "both", "honoured", ""),
    Field("best_of", "completions", "honoured", "equal to n only (not in vLLM 0.26's model; OpenAI's)"),
    Field("seed", "both", "honoured", "any signed 64-bit integer; outside it 400"),
    Field("stop", "both", "honoured", ""),
    Field("stream", "both", "honoured", ""),
    Field("stream_options", "both", "honoured", "include_usage, continuous_usage_stats"),
    Field("suffix", "completions", "rejected", "400 (vLLM too)", _unset),
    Field("temperature", "both", "honoured", ""),
    Field("top_p", "both", "honoured", ""),
    Field("user", "both", "honoured", "no effect on generation (as OpenAI, vLLM); with data_parallel_size > 1 "
          "the sticky-session key unless an X-Session-Id header is sent"),
    Field("response_format", "both", "honoured", "text, json_object, json_schema ({name, schema, strict}): the "
          "output held to it (llguidance; compact JSON); a bad schema 400"),
    Field("tools", "chat", "honoured", "function definitions, passed to the chat template; an empty list 400"),
    Field("tool_choice", "chat", "honoured", "\"none\" (content only), \"auto\" (the default with tools; needs "
          "--enable-auto-tool-choice --tool-call-parser hermes, else 400), \"required\" and a named function "
          "(through structured outputs); an unknown function 400"),
    Field("parallel_tool_calls", "chat", "honoured", "false: only the first tool call is returned (as vLLM)"),
    Field("reasoning_effort", "chat", "honoured", "passed to the chat template, with enable_thinking = effort != "
          "\"none\" unless chat_template_kwargs sets it (as vLLM)"),
    Field("include_reasoning", "chat", "honoured", "false: the reasoning is left out (with --reasoning-parser; "
          "without one the thinking stays in the content, as vLLM)"),
    # vLLM's sampling extras
    Field("use_beam_search", "both", "rejected", "true: 400 (no beam search)", _is(False)),
    Field("length_penalty", "both", "rejected", "other than 1.0: 400 (beam search only)", _is(1.0, 1)),
    Field("top_k", "both", "honoured", ""),
    Field("min_p", "both", "honoured", ""),
    Field("repetition_penalty", "both", "honoured", "> 0, over prompt and output tokens"),
    Field("stop_token_ids", "both", "honoured", ""),
    Field("include_stop_str_in_output", "both", "honoured", ""),
    Field("ignore_eos", "both", "honoured", ""),
    Field("min_tokens", "both", "honoured", ""),
    Field("skip_special_tokens", "both", "honoured", ""),
    Field("spaces_between_special_tokens", "both", "honoured", "accepted; no effect with the fast (tokenizers) "
          "tokenizers used here, as in vLLM's fast detokenizer"),
    Field("truncate_prompt_tokens", "both", "honoured", "keep k prompt tokens (-1: max_model_len - max_tokens); "
          "over that 400"),
    Field("truncation_side", "both", "honoured", "\"left\" (default: keep the last k) or \"right\""),
    Field("allowed_token_ids", "both", "honoured", "non-empty; ids outside the vocabulary 400"),
    Field("bad_words", "both", "honoured", "tokenised with and without a leading space (as vLLM); the last "
          "token of a word is banned after its other tokens"),
    Field("prompt_logprobs", "both", "honoured", "vLLM's list per prompt token (null for the first), -1 the "
          "whole vocabulary; not with stream (400, as vLLM)"),
    Field("logprob_token_ids", "both", "rejected", "400 (logprobs of chosen ids not supported)", _unset),
    Field("thinking_token_budget", "both", "rejected", "400 unless null or -1 (no reasoning budget)", _is(-1)),
    Field("repetition_detection", "both", "rejected", "400 (no repetition detection)", _unset),
    # vLLM's other extras
    Field("prompt_embeds", "completions", "rejected", "400 (token prompts only)", _unset),
    Field("add_special_tokens", "both", "honoured", "completions default true, chat false (as vLLM)"),
    Field("add_generation_prompt", "chat", "honoured", ""),
    Field("continue_final_message", "chat", "honoured", "the last message left open; with add_generation_prompt "
          "400 (as vLLM)"),
    Field("documents", "chat", "honoured", "passed to the chat template"),
    Field("chat_template", "chat", "honoured", "a template name or text, with --trust-request-chat-template "
          "(else 400, as vLLM)"),
    Field("chat_template_kwargs", "chat", "honoured", ""),
    Field("media_io_kwargs", "chat", "rejected", "400 (text models only)", _unset),
    Field("mm_processor_kwargs", "chat", "rejected", "400 (text models only)", _unset),
    Field("structured_outputs", "both", "honoured", "one of json (a schema), regex, choice, grammar (Lark or "
          "GBNF), json_object; a bad spec 400 naming it; two kinds 400 (as vLLM)"),
    Field("guided_json", "both", "honoured", "older spelling of structured_outputs.json (vLLM before 0.12)"),
    Field("guided_regex", "both", "honoured", "older spelling of structured_outputs.regex"),
    Field("guided_choice", "both", "honoured", "older spelling of structured_outputs.choice"),
    Field("guided_grammar", "both", "honoured", "older spelling of structured_outputs.grammar"),
    Field("priority", "both", "honoured", "lower runs first with --scheduling-policy priority (vLLM's), "
          "preempting higher values; ignored by the other policies"),
    Field("ttft_target_ms", "both", "honoured", "time-to-first-token target from arrival (not vLLM's): edf/lrs "
          "order by the deadline; --reject-unmeetable answers 503 when it cannot be met"),
    Field("e2e_target_ms", "both", "honoured", "end-to-end target from arrival (not vLLM's), as ttft_target_ms"),
    Field("request_id", "both", "honoured", "the response id's suffix when no X-Request-Id header"),
    Field("return_tokens_as_token_ids", "both", "honoured", "tokens as \"token_id:<id>\" (and the server flag "
          "--return-tokens-as-token-ids)"),
    Field("return_token_ids", "both", "honoured", "prompt_token_ids and token_ids (per chunk: the new ones)"),
    Field("return_token_offsets", "both", "rejected", "true: 400 (vLLM: render endpoints only)", _unset),
    Field("return_prompt_text", "chat", "honoured", "prompt_text: the rendered template"),
    Field("return_assistant_tokens_mask", "chat", "rejected", "true: 400 (vLLM: render endpoint only)", _unset),
    Field("cache_salt", "both", "rejected", "400 (no prefix-cache salting)", _unset),
    Field("kv_transfer_params", "both", "rejected", "400 (no disaggregated serving)", _unset),
    Field("ec_transfer_params", "both", "rejected", "400 (no disaggregated serving)", _unset),
    Field("vllm_xargs", "both", "rejected", "400 (no custom extensions)", _unset),
]
BY_NAME = {field.name: field for field in FIELDS}


def check_fields(body: msgspec.Struct, endpoint: Literal["completions", "chat"]) -> None:
    """400 naming the first field set to a value the engine cannot honour."""
    for field in FIELDS:
        if field.neutral is None or field.endpoint not in ("both", endpoint):
            continue
        value = getattr(body, field.name)
        if not field.neutral(value):
            raise bad_request(f"{field.name}: not supported by this server ({field.note}); got {value!r}"[:500],
                              field.name)


def markdown_table() -> str:
    """The table of request fields in docs/requests.md."""
    lines = ["| field | endpoint | | what this server does |", "| --- | --- | --- | --- |"]
    for field in sorted(FIELDS, key=lambda f: f.name):
        lines.append(f"| `{field.name}` | {field.endpoint} | {field.status} | {field.note} |")
    return "\n".join(lines)


def text_options(body: Any, max_model_len: int, max_tokens: int | None, *,
                 continue_final_message: bool = False) -> TextOptions:
    """The body's add_special_tokens, truncate_prompt_tokens (-1: max_model_len - max_tokens, and
    no more than that: vLLM's rule) and truncation_side as TextOptions."""
    keep = body.truncate_prompt_tokens
    if keep is not None:
        room = max_model_len - (max_tokens or 0)
        if keep < -1:
            raise bad_request(f"truncate_prompt_tokens: must be >= -1, got {keep}", "truncate_prompt_tokens")
        if keep == -1:
            keep = room
        elif keep > room:
            raise bad_request(f"truncate_prompt_tokens: {keep} cannot be greater than max_model_len - max_tokens "
                              f"= {room}", "truncate_prompt_tokens")
    side = body.truncation_side if body.truncation_side is not None else "left"
    if side not in ("left", "right"):
        raise bad_request(f"truncation_side: must be 'left' or 'right', got {side!r}", "truncation_side")
    return TextOptions(add_special_tokens=body.add_special_tokens, truncate_prompt_tokens=keep,
                       truncation_side=side, continue_final_message=continue_final_message)


# --------------------------------------------------------------------------- media type
def check_media_type(content_type: str | None) -> None:
    """415 for a body declared as anything but JSON (a form, text); none declared is read as JSON."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise OpenAIError(f"Unsupported Media Type: the request body must be JSON (Content-Type: "
                          f"application/json), got {media_type[:100]!r}", 415)


# --------------------------------------------------------------------------- pydantic's lax mode
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
_INT = re.compile(r"^\s*[+-]?[0-9]+(_[0-9]+)*(\.0+)?\s*$", re.ASCII)


def lax_decode(body: bytes, kind: type[S]) -> S:
    """``kind`` from JSON ``body`` with pydantic's lax coercions of the scalar fields, top-level and
    in nested objects such as stream_options (what vLLM's models accept): booleans from
    "true"/"false"/"yes"/"no"/"on"/"off"/"1"/"0"... and 0/1, integers from integral strings, floats
    and booleans, floats from numeric strings and booleans. Raises msgspec's errors (naming the
    field) for what is still wrong."""
    raw = msgspec.json.decode(body)
    _coerce_fields(raw, kind)
    return msgspec.convert(raw, kind, strict=True)


def _coerce_fields(raw: Any, kind: type) -> None:
    if not isinstance(raw, dict):
        return
    for name, hint in get_type_hints(kind).items():
        if name not in raw:
            continue
        options = get_args(hint) if get_origin(hint) is Union or type(hint).__name__ == "UnionType" else (hint,)
        scalar = next((option for option in (bool, int, float) if option in options), None)
        if scalar is not None:
            raw[name] = _coerce(raw[name], scalar)
            continue
        for option in options:
            if isinstance(option, type) and issubclass(option, msgspec.Struct):
                _coerce_fields(raw[name], option)


def _coerce(value: Any, wanted: type) -> Any:
    if wanted is bool:
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)
    elif wanted is int:
        if isinstance(value, str) and _INT.match(value):
            return int(value.replace("_", "").strip().split(".")[0])
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif wanted is float:
        if isinstance(value, str) and value.isascii():
            try:
                return float(value.strip())
            except ValueError:
                return value
        if isinstance(value, bool):
            return float(value)
    return value
