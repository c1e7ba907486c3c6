"""Who gets in: the checks of an arriving request (its id, then every value a worker would index
with or compute from), and admission itself, with its prefix-cache lookup."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.messages import AddRequest
from vllm_actors.protocol.names import describe_request_id, engine_request_id_error
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import packed_id_range

MAX_TOKEN_ID = 2**31 - 1  # token ids travel packed as int32: the bound when the vocabulary is not known
MAX_SEED = 2**63 - 1  # seeds are signed 64-bit, as in vLLM (torch.long)


def identity_error(message: AddRequest, requests: Mapping[str, object]) -> str | None:
    """Why the request's id cannot be taken (well formed, not in use), or None. Such a rejection
    leaves no event: the id may be another request's, whose timeline it must not touch."""
    error = engine_request_id_error(message.request_id)
    if error is not None:
        return error
    if message.request_id in requests:
        return f"request_id {describe_request_id(message.request_id)} is already in use"
    return None


def admission_error(message: AddRequest, config: SchedulerConfig) -> str | None:
    """Why the scheduler cannot take this request (the frontend gets it as an error), or None.
    Anything may arrive on the scheduler's socket: every value a worker would index with or
    compute from is checked here, against this engine's vocabulary and context length."""
    max_model_len = config.max_model_len
    token_limit = config.vocab_size if config.vocab_size is not None else MAX_TOKEN_ID + 1
    error = message.prompt_form_error()
    if error is not None:
        return error
    num_prompt = message.num_prompt_tokens
    if num_prompt == 0:
        return "the prompt is empty"
    if num_prompt > max_model_len:
        return f"the prompt has {num_prompt} tokens, more than max_model_len ({max_model_len})"
    if message.packed_prompt:
        error = _packed_ids_error("prompt token ids", message.packed_prompt, token_limit)
    else:
        error = _token_ids_error("prompt token ids", message.prompt_token_ids, token_limit)
    error = error or _token_ids_error("eos_token_ids", message.eos_token_ids, token_limit)
    error = error or sampling_error(message.params) or lora_error(message, config)
    if error is not None:
        return error
    outputs = message.output_token_ids
    if not outputs:
        return None
    if not message.resume:
        return "output_token_ids are only taken with resume=True (a resubmission)"
    error = _token_ids_error("output token ids", outputs, token_limit)
    if error is not None:
        return error
    if num_prompt + len(outputs) > max_model_len:
        return (
            f"the prompt ({num_prompt} tokens) and the outputs so far ({len(outputs)}) are more than "
            f"max_model_len ({max_model_len})"
        )
    max_tokens = message.params.max_tokens
    if max_tokens is not None and len(outputs) > max_tokens:
        return f"{len(outputs)} output tokens resubmitted, more than max_tokens ({max_tokens})"
    return None


def pool_error(message: AddRequest, config: SchedulerConfig) -> str | None:
    """A request not placed with borrowed KV must fit this replica's pool (with ``kv_borrowing``,
    max_model_len is the model's limit, which may exceed the pool)."""
    pool = config.num_blocks * config.block_size
    num_tokens = message.num_prompt_tokens + len(message.output_token_ids)
    if num_tokens > pool:
        return (f"the request has {num_tokens} tokens, more than this replica's KV pool holds ({pool}); with "
                "kv_borrowing the controller places it with borrowed blocks once it knows every replica's pool")
    return None


def _token_ids_error(what: str, token_ids: Sequence[int], limit: int) -> str | None:
    # min/max run in C: a short list is checked in microseconds (a million ids take 35 ms: send them packed)
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= limit):
        return f"{what} must lie in [0, {limit - 1}]"
    return None


def _packed_ids_error(what: str, packed: bytes, limit: int) -> str | None:
    """``_token_ids_error`` over packed ids (``pack_token_ids``), read in place by numpy."""
    bounds = packed_id_range(packed)
    if bounds is not None and (bounds[0] < 0 or bounds[1] >= limit):
        return f"{what} must lie in [0, {limit - 1}]"
    return None


def sampling_error(params: SamplingParams) -> str | None:
    """The sampling parameters' own checks (``protocol/sampling.py``), run again (decoding ran them,
    but a field set after construction, in process, skipped them), then the bounds the worker
    relies on whatever those checks allow."""
    try:
        params.__post_init__()
    except (ValueError, TypeError) as error:
        return str(error)
    if params.seed is not None and params.seed > MAX_SEED:
        return f"seed must be <= {MAX_SEED}, got {params.seed}"
    return None


def lora_error(message: AddRequest, config: SchedulerConfig) -> str | None:
    if message.lora_request is not None and config.max_loras == 0:
        return f"LoRA adapter {message.lora_request.lora_name!r} asked for, but LoRA is not enabled (enable_lora)"
    return None


def running_adapters(running: Iterable[ScheduledRequest]) -> set[int]:
    """The LoRA adapters of the running requests (a step uses each of them at most)."""
    return {request.lora_int_id for request in running if request.lora_int_id}


def adapter_fits(request: ScheduledRequest, adapters: set[int], max_loras: int) -> bool:
    """Whether the request may join the running ones: its adapter is theirs, or one more fits
    in the worker's ``max_loras`` device slots."""
    return not request.lora_int_id or request.lora_int_id in adapters or len(adapters) < max_loras


def looks_up(request: ScheduledRequest, ledger: BlockLedger) -> bool:
    """Whether admission looks the request up in the prefix cache: not when it wants prompt
    logprobs, which need every prompt position computed."""
    return ledger.cache is not None and request.params.prompt_logprobs is None and not request.borrowed


def admit(request: ScheduledRequest, ledger: BlockLedger) -> tuple[int, int, int]:
    """The request starts holding blocks and takes its cache hit (it then computes from there):
    (tokens looked up, tokens hit, hash of the hit's last block)."""
    if not looks_up(request, ledger):
        ledger.admit(request.request_id, None, lent_front=sum(blocks for _, blocks in request.borrowed))
        request.cache_check_at = ledger.next_cache_check(request.request_id)
        return 0, 0, 0
    tokens = request.all_token_ids
    num_blocks, last_hash = ledger.admit(request.request_id, tokens, request.lora_int_id)
    request.num_computed_tokens = num_blocks * ledger.block_size
    request.cache_check_at = ledger.next_cache_check(request.request_id)
    return len(tokens), request.num_computed_tokens, last_hash
