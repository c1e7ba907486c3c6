"""A request as the scheduler keeps it: its tokens, its progress, where it is."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.messages import AddRequest, NewRequest
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids, token_id_array


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ScheduledRequest:
    request_id: str
    # An int32 array (a list given is converted): a million-token prompt stays 4 MB read in place,
    # where a list costs 30 ms of Python ints to build from the packed form it arrives in.
    prompt_token_ids: array[int]
    params: SamplingParams
    eos_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    in_worker: bool = False  # the worker holds its state (a NewRequest was sent, no finish yet)
    num_preemptions: int = 0
    num_pending: int = 0  # tokens that steps in flight will sample for it (not yet reported)
    num_pending_drafts: int = 0  # drafts of its steps in flight: tokens they may add beyond num_pending
    last_chunk: int = 0  # prompt tokens its last prefill step took (``PrefillSizer``'s trust region)
    # its latest chunk measured beside decodes: its tokens, and its seconds (the step's wall share less the
    # cost model's prediction of the step without it; ``prefill_sizing.note_chunk_times``)
    timed_chunk: int = 0
    chunk_seconds: float = 0.0
    packed_prompt: bytes = b""  # the prompt as NewRequest carries it, packed once on arrival
    num_cached_prompt_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    # Computed tokens at which its next full block could be cached: below it, a step asks the
    # ledger nothing (most decode steps complete no block).
    cache_check_at: int = 0
    priority: int = 0  # lower runs first under the "priority" policy (vLLM's)
    ttft_deadline: float | None = None  # absolute (the sender's clock), None: no target
    e2e_deadline: float | None = None
    arrival: int = 0  # arrival sequence number: the tie-break of every policy's order
    queued_at_step: int = 0  # the scheduler's step count when it last joined the waiting queue (aging)
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for it, and accepted
    num_accepted_tokens: int = 0
    borrowed: list[list[int]] = field(default_factory=list)  # [lender replica, blocks]: its table's front

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, array):
            self.prompt_token_ids = array("i", self.prompt_token_ids)

    @classmethod
    def arriving(cls, message: AddRequest, arrival: int, queued_at_step: int) -> ScheduledRequest:
        """A request the scheduler takes (``message`` passed admission)."""
        packed = packed_prompt(message)
        return cls(
            request_id=message.request_id,
            prompt_token_ids=token_id_array(packed),
            params=message.params,
            eos_token_ids=list(message.eos_token_ids),
            packed_prompt=packed,
            output_token_ids=list(message.output_token_ids),
            # A resubmission with outputs resumes as after a preemption (RESUMED, recompute).
            num_preemptions=1 if message.output_token_ids else 0,
            priority=message.priority,
            ttft_deadline=message.ttft_deadline,
            e2e_deadline=message.e2e_deadline,
            arrival=arrival,
            queued_at_step=queued_at_step,
            lora_request=message.lora_request,
        )

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def deadline(self) -> float | None:
        """The deadline it is working to now: the earliest of its TTFT and end-to-end deadlines
        until its first token, then the end-to-end one (a TTFT deadline is met or missed once the
        first token is out: holding on to it would make a request that has streamed for seconds
        look as urgent as one still waiting for its first token)."""
        if self.output_token_ids:
            return self.e2e_deadline
        known = [d for d in (self.ttft_deadline, self.e2e_deadline) if d is not None]
        return min(known) if known else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Every known token id, prompt then outputs (the prompt itself, uncopied, while there are none)."""
        if not self.output_token_ids:
            return self.prompt_token_ids
        return self.prompt_token_ids + array("i", self.output_token_ids)

    def token_slice(self, start: int, end: int) -> Sequence[int]:
        """Known token ids ``start:end`` (prompt then outputs) without joining the two."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:].tolist() + self.output_token_ids[: end - num_prompt]

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the worker will hold once the steps in flight are done: what can be computed."""
        return self.num_tokens + self.num_pending + self.num_pending_drafts

    def wants_more(self, max_model_len: int) -> bool:
        """False once the tokens in flight already take it to max_tokens or max_model_len."""
        max_tokens = self.params.max_tokens
        in_flight = self.num_pending + self.num_pending_drafts
        if self.num_pending and max_tokens is not None and len(self.output_token_ids) + in_flight >= max_tokens:
            return False
        return not (self.num_pending and self.num_tokens_with_pending >= max_model_len)

    def new_request(self, num_cached_tokens: int, cached_block_hash: int) -> NewRequest:
        """The ``NewRequest`` that gives the worker its state (from now on it holds it)."""
        self.in_worker = True
        return NewRequest(
            request_id=self.request_id,
            token_ids=self.packed_prompt + pack_token_ids(self.output_token_ids) if self.output_token_ids
            else self.packed_prompt,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=len(self.output_token_ids),
            params=self.params,
            eos_token_ids=self.eos_token_ids,
            num_cached_tokens=num_cached_tokens,
            cached_block_hash=cached_block_hash,
            lora_request=self.lora_request,
            borrowed=self.borrowed,
        )


def packed_prompt(message: AddRequest) -> bytes:
    """The prompt of an admitted ``AddRequest``, packed: as it came, or its list packed (one conversion)."""
    return message.packed_prompt or pack_token_ids(message.prompt_token_ids)


def check_stop(request: ScheduledRequest, token_id: int, max_model_len: int) -> tuple[str | None, int | None]:
    """(finish reason, stop reason) when ``token_id``, just appended, ends the request."""
    params = request.params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return "length", None
    if request.num_tokens >= max_model_len:
        return "length", None
    return None, None
