"""How large a request the server takes: the body in bytes, and each prompt in bytes (checked
before it is tokenised, so that a huge text costs no tokenising) and in tokens (max_model_len,
the frontend's check; a token-id list is counted before it is converted).

Without them a huge text prompt costs seconds of tokenising and gigabytes of memory (HF
tokenizers' per-token encoding) for a prompt that could never fit in max_model_len. The byte limit
defaults to ``max_model_len * DEFAULT_PROMPT_BYTES_PER_TOKEN``: real text averages 2-5 bytes per
token (English and code about 4, CJK about 2, long whitespace or repeated runs up to about 16), so
a prompt over 32 bytes per token of the context would not fit anyway, and tokenising the largest
allowed prompt stays bounded (on a worker thread).
``--max-prompt-bytes`` raises it for odd tokenizers; nothing in vLLM has this flag.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROMPT_BYTES_PER_TOKEN = 32
MAX_BODY_BYTES = 32 * 1024 * 1024  # the default body cap's ceiling (and the cap before these limits)
MIN_BODY_BYTES = 1024 * 1024  # the default body cap's floor: room for many messages and parameters
JSON_ESCAPE_FACTOR = 6  # ensure_ascii JSON spells a control character as \u0000: 6 bytes for 1


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_bytes: int | None = None  # None: no byte limit (the token limit still applies)

    @classmethod
    def for_model(cls, max_model_len: int, *, max_prompt_bytes: int | None = None,
                  max_body_bytes: int | None = None) -> RequestLimits:
        """The defaults for a context of ``max_model_len`` tokens, where not given: the prompt
        limit as above; the body cap room for one prompt at that limit, JSON-escaped
        (``JSON_ESCAPE_FACTOR``), within [``MIN_BODY_BYTES``, ``MAX_BODY_BYTES``]."""
        if max_prompt_bytes is None:
            max_prompt_bytes = max_model_len * DEFAULT_PROMPT_BYTES_PER_TOKEN
        if max_body_bytes is None:
            max_body_bytes = min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, JSON_ESCAPE_FACTOR * max_prompt_bytes))
        if max_prompt_bytes <= 0 or max_body_bytes <= 0:
            raise ValueError(f"request limits must be positive, got max_prompt_bytes={max_prompt_bytes}, "
                             f"max_body_bytes={max_body_bytes}")
        return cls(max_body_bytes=max_body_bytes, max_prompt_bytes=max_prompt_bytes)
