"""The frontend's text work: a prompt (text, token ids, or a chat) to token ids.

Every failure is a ``ValueError`` whose message starts with the request field it is about
("prompt: ...", "messages: ...", "prompt_token_ids: ..."), so that each caller can map it to its
own error (the HTTP server answers 400 naming that field). The checks of the resulting token ids
against the model (vocabulary, max_model_len) are the frontend's: ``prepared.check_prompt``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_actors.actors.frontend.chat_template import ChatTemplateError
from vllm_actors.actors.frontend.errors import TooManyTokens

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer

PromptInput = str | Mapping[str, Any]
ChatMessages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class TextOptions:
    """How a prompt becomes tokens beyond the defaults (vLLM's request fields): the tokenizer's
    special tokens, truncation to ``truncate_prompt_tokens`` (resolved: no -1) from
    ``truncation_side``, and a chat's last message left open."""

    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    continue_final_message: bool = False

    def token_limit(self, max_model_len: int) -> int | None:
        """The most tokens tokenising may produce: none when truncating (the byte limit bounds it)."""
        return None if self.truncate_prompt_tokens is not None else max_model_len

    def truncate(self, text: str | None, ids: list[int]) -> tuple[str | None, list[int]]:
        """(text, ids) truncated; the text becomes None (decoded when needed) once ids are cut."""
        keep = self.truncate_prompt_tokens
        if keep is None or keep >= len(ids):
            return text, ids
        return None, truncate_ids(ids, keep, self.truncation_side)


def tokenize_prompt(
    tokenizer: Tokenizer | None, prompt: PromptInput, *, max_bytes: int | None = None, max_tokens: int | None = None,
    add_special_tokens: bool = True,
) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a text prompt or a dict with 'prompt' or 'prompt_token_ids'.
    A text over ``max_bytes`` (UTF-8) is refused before it is tokenised, a token-id list over
    ``max_tokens`` before it is converted."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init=True)")
        check_text_size(prompt, "prompt", max_bytes)
        return prompt, encode(tokenizer, prompt, "prompt", max_tokens, add_special_tokens=add_special_tokens)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if max_tokens is not None and isinstance(ids, Sequence) and len(ids) > max_tokens:
                raise ValueError(f"prompt: {len(ids)} tokens is longer than max_model_len ({max_tokens})")
            return prompt.get("prompt"), token_id_list(ids)
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return tokenize_prompt(tokenizer, prompt["prompt"], max_bytes=max_bytes, max_tokens=max_tokens,
                                   add_special_tokens=add_special_tokens)
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")


def tokenize_chat(
    tokenizer: Tokenizer | None,
    messages: ChatMessages,
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_bytes: int | None = None,
    max_tokens: int | None = None,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> tuple[str, list[int]]:
    """(text, token ids) of a conversation through the model's chat template. The template writes
    the special tokens itself, so the text is encoded without adding any. ``max_bytes`` bounds the
    rendered text; messages whose text content alone is over it are refused before rendering;
    more than ``max_tokens`` are refused before the ids become a list. ``continue_final_message``:
    the text ends right after the last message's content (the model continues it, vLLM's and
    transformers' rule); ``add_special_tokens`` adds the tokenizer's own (BOS) on top."""
    if tokenizer is None:
        raise ValueError("messages: chat needs a tokenizer (skip_tokenizer_init=True)")
    if max_bytes is not None:
        contents = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        if contents > max_bytes:
            raise ValueError(f"messages: the message contents are {contents} characters, more than the "
                             f"{max_bytes} bytes a prompt may have")
    try:
        text = tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            **dict(chat_template_kwargs or {}),
        )
    except (ChatTemplateError, TypeError) as error:
        raise ValueError(f"messages: the chat template failed: {error}") from None
    if continue_final_message:
        text = open_final_message(text, messages)
    check_text_size(text, "messages", max_bytes)
    return text, encode(tokenizer, text, "messages", max_tokens, add_special_tokens=add_special_tokens)


def open_final_message(text: str, messages: ChatMessages) -> str:
    """``text`` (rendered without a generation prompt) cut right after the last message's content,
    as transformers' ``continue_final_message`` does: what the template closes it with (an
    end-of-turn token, a newline) is dropped."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message: the last message must have text content")
    where = text.rfind(final.strip())
    if where < 0:
        raise ValueError("continue_final_message: the last message does not appear in the rendered chat template")
    if text[where:where + len(final.lstrip())] == final.lstrip():
        return text[:where + len(final.lstrip())]  # the template kept the content's spacing
    return text[:where + len(final.strip())]


def truncate_ids(ids: list[int], keep: int, side: str = "left") -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep ``keep`` tokens, the last ones ("left": truncate at
    the start) or the first ("right")."""
    if keep >= len(ids):
        return ids
    return ids[len(ids) - keep:] if side == "left" else ids[:keep]


def encode(tokenizer: Tokenizer, text: str, field: str, max_tokens: int | None,
           add_special_tokens: bool = True) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=max_tokens)
    except TooManyTokens as error:
        raise ValueError(f"{field}: {error.count} tokens is longer than max_model_len ({error.limit})") from None


def check_text_size(text: str, field: str, max_bytes: int | None) -> None:
    """Refuse a text of more than ``max_bytes`` UTF-8 bytes (its length in characters settles a
    huge one without encoding it)."""
    if max_bytes is None:
        return
    size = len(text) if len(text) > max_bytes else len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        unit = "characters" if len(text) > max_bytes else "bytes"
        raise ValueError(f"{field}: the prompt is longer than the {max_bytes} bytes a prompt may have "
                         f"({size} {unit})")


def token_id_list(ids: object) -> list[int]:
    """A copy of ``ids`` as a list of ints (not bools), checked in C by msgspec."""
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise ValueError("prompt_token_ids must be a list of integers")
    try:
        return msgspec.convert(ids if isinstance(ids, list) else list(ids), list[int], strict=True)
    except msgspec.ValidationError as error:
        raise ValueError(f"prompt_token_ids must be a list of integers ({error})") from None
