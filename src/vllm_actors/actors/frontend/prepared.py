"""A request tokenised and checked, ready to submit (``PreparedRequest``), and the checks it
passed: each failure a ``ValueError`` whose message starts with the field it blames."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_actors.actors.frontend.controls import check_control_ids
from vllm_actors.actors.frontend.structured import check_structured_outputs
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids, packed_id_range


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    session_key: str | None = None  # sticky sessions in a replica set (AddRequest.session_key)
    # vLLM's priority (lower first) and latency targets relative to arrival; the client stamps
    # ``arrival_time`` (Unix seconds) when it submits, and the scheduler gets absolute deadlines.
    priority: int = 0
    ttft_target_ms: float | None = None
    e2e_target_ms: float | None = None
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    packed_prompt: bytes = b""  # prompt_token_ids packed as check_prompt checked them (b"": not packed)

    def deadline(self, target_ms: float | None) -> float | None:
        if target_ms is None or self.arrival_time is None:
            return None
        return self.arrival_time + target_ms / 1000.0


def check_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                 has_tokenizer: bool, field: str = "prompt") -> bytes:
    """The prompt's token ids and the parameters' token ids against the model. Returns the prompt
    packed (``pack_token_ids``), as the scheduler takes it; b"" if its ids are not all int32s."""
    if not prompt_ids:  # vLLM's words: "The decoder prompt cannot be empty"
        raise ValueError(f"{field}: the decoder prompt cannot be empty")
    packed = _packed(prompt_ids)
    bounds = packed_id_range(packed)  # None where not packed: an id beyond int32 (the list's min/max say which)
    low, high = bounds if bounds is not None else (min(prompt_ids), max(prompt_ids))
    if low < 0 or high >= vocab_size:  # vLLM's words: "Token id 999999 is out of vocabulary"
        bad = low if low < 0 else high
        raise ValueError(f"prompt_token_ids: token id {bad} is out of vocabulary (the vocabulary is [0, {vocab_size}))")
    outside = [token_id for token_id in params.stop_token_ids if token_id >= vocab_size]
    if outside:
        raise ValueError(f"stop_token_ids: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    check_control_ids(params, vocab_size)
    check_structured_outputs(params.structured_outputs, has_tokenizer)
    if len(prompt_ids) > max_model_len:
        raise ValueError(f"{field}: {len(prompt_ids)} tokens is longer than max_model_len ({max_model_len})")
    if not has_tokenizer and params.stop:
        raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init=True)")
    return packed


def _packed(prompt_ids: list[int]) -> bytes:
    """The ids packed in C (one pass), or b"" if one is not an int32 (out of any vocabulary: the checks say which)."""
    try:
        return pack_token_ids(prompt_ids)
    except (OverflowError, TypeError):
        return b""


def check_fits(num_prompt: int, requested: int | None, max_tokens: int, max_model_len: int, field: str) -> None:
    """The prompt plus max_tokens must fit in max_model_len (vLLM's OpenAI server's words)."""
    total = num_prompt + max_tokens
    if total <= max_model_len:
        return
    blame = "max_tokens" if requested is not None and num_prompt < max_model_len else field
    raise ValueError(
        f"{blame}: This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {total} tokens ({num_prompt} in the {field}, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion."
    )
