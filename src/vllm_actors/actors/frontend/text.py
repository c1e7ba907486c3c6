"""The frontend's text work: a prompt (text, token ids, or a chat) to token ids.

Every failure is a ``ValueError`` whose message starts with the request field it is about
("prompt: ...", "messages: ...", "prompt_token_ids: ..."), so that each caller can map it to its
own error (the HTTP server answers 400 naming that field). The checks of the resulting token ids
against the model (vocabulary, max_model_len) are the frontend's: ``Frontend._validate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_actors.actors.frontend.chat_template import ChatTemplateError

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer

PromptInput = str | Mapping[str, Any]
ChatMessages = Sequence[Mapping[str, Any]]


def tokenize_prompt(tokenizer: Tokenizer | None, prompt: PromptInput) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a text prompt or a dict with 'prompt' or 'prompt_token_ids'."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init=True)")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), token_id_list(prompt["prompt_token_ids"])
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return tokenize_prompt(tokenizer, prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")


def tokenize_chat(
    tokenizer: Tokenizer | None,
    messages: ChatMessages,
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """(text, token ids) of a conversation through the model's chat template. The template writes
    the special tokens itself, so the text is encoded without adding any."""
    if tokenizer is None:
        raise ValueError("messages: chat needs a tokenizer (skip_tokenizer_init=True)")
    try:
        text = tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            **dict(chat_template_kwargs or {}),
        )
    except (ChatTemplateError, TypeError) as error:
        raise ValueError(f"messages: the chat template failed: {error}") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


def token_id_list(ids: object) -> list[int]:
    """A copy of ``ids`` as a list of ints (not bools), checked in C by msgspec."""
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise ValueError("prompt_token_ids must be a list of integers")
    try:
        return msgspec.convert(ids if isinstance(ids, list) else list(ids), list[int], strict=True)
    except msgspec.ValidationError as error:
        raise ValueError(f"prompt_token_ids must be a list of integers ({error})") from None
