"""The frontend's state machine: prompts in, text out.

It owns the client side's text: it tokenises prompts and chats (``text.py``), validates them
(raising ``ValueError`` naming the field before anything is queued), fans a
request with ``n > 1`` out into n engine requests, detokenises the scheduler's token updates
incrementally, applies stop strings (ending the request at the scheduler with an abort of reason
"stop") and assembles vLLM-shaped ``RequestOutput`` objects for the client. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_actors.actors.frontend.controls import bad_words_token_ids, check_control_ids
from vllm_actors.actors.frontend.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from vllm_actors.actors.frontend.structured import check_structured_outputs
from vllm_actors.actors.frontend.text import ChatMessages, PromptInput, tokenize_chat, tokenize_prompt
from vllm_actors.protocol.events import Arrived, Event, Finished
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    Logprobs,
    Message,
    RequestUpdates,
    without_delivered,
)
from vllm_actors.protocol.names import (
    BUS,
    CLIENT,
    SCHEDULER,
    child_request_id,
    describe_request_id,
    request_id_error,
)
from vllm_actors.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.detokenizer import IncrementalDetokenizer
    from vllm_actors.actors.frontend.tokenizer import Tokenizer


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    session_key: str | None = None  # sticky sessions in a replica set (AddRequest.session_key)
    # Scheduling (issue 18): vLLM's priority (lower first) and latency targets relative to
    # arrival; the client stamps ``arrival_time`` (Unix seconds) when it submits, and the
    # scheduler gets absolute deadlines (arrival + target).
    priority: int = 0
    ttft_target_ms: float | None = None
    e2e_target_ms: float | None = None
    arrival_time: float | None = None

    def deadline(self, target_ms: float | None) -> float | None:
        if target_ms is None or self.arrival_time is None:
            return None
        return self.arrival_time + target_ms / 1000.0


@dataclass
class _Child:
    engine_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # the first child's prompt tokens found in the prefix cache
    # (priority, TTFT deadline, end-to-end deadline): sent again with a resubmission
    schedule: tuple[int, float | None, float | None] = (0, None, None)
    session_key: str | None = None

    @property
    def finished(self) -> bool:
        return all(child.finish_reason is not None for child in self.children)


class Frontend:
    name = "frontend"

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._requests: dict[str, _Request] = {}
        self._child_owner: dict[str, tuple[_Request, _Child]] = {}
        self._token_texts: dict[int, str] = {}  # decoded tokens for logprobs (at most the vocabulary)

    # ------------------------------------------------------------------ requests in
    def prepare(
        self, request_id: str, prompt: PromptInput, params: SamplingParams, *, max_tokens_must_fit: bool = False
    ) -> PreparedRequest:
        """Tokenise and validate; raises ValueError naming the field. Queues nothing.

        ``max_tokens_must_fit``: refuse a request whose prompt plus max_tokens exceeds
        max_model_len (the OpenAI server's rule; offline, generation just stops there)."""
        self._check_new(request_id, params)
        text, prompt_ids = tokenize_prompt(self.tokenizer, prompt, max_tokens=self.max_model_len)
        return self._prepare(request_id, text, prompt_ids, params, "prompt", max_tokens_must_fit)

    def prepare_chat(
        self,
        request_id: str,
        messages: ChatMessages,
        params: SamplingParams,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_tokens_must_fit: bool = False,
    ) -> PreparedRequest:
        """``prepare`` for a conversation: rendered through the model's chat template."""
        self._check_new(request_id, params)
        text, prompt_ids = tokenize_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                         chat_template_kwargs=chat_template_kwargs)
        return self._prepare(request_id, text, prompt_ids, params, "messages", max_tokens_must_fit)

    def prepare_tokens(
        self, request_id: str, text: str | None, prompt_ids: list[int], params: SamplingParams, *,
        field: str = "prompt", max_tokens_must_fit: bool = False,
    ) -> PreparedRequest:
        """``prepare`` for a prompt tokenised elsewhere (``text.py``'s functions, on a worker
        thread): the same checks, ``field`` naming the request field they blame."""
        self._check_new(request_id, params)
        return self._prepare(request_id, text, prompt_ids, params, field, max_tokens_must_fit)

    def _check_new(self, request_id: str, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        error = request_id_error(request_id)  # length and characters: no '#', the children's separator
        if error is not None:
            raise ValueError(error)
        if request_id in self._requests or request_id in self._child_owner:
            raise ValueError(f"request_id {describe_request_id(request_id)} is already in use")

    def _prepare(
        self, request_id: str, text: str | None, prompt_ids: list[int], params: SamplingParams, field: str,
        max_tokens_must_fit: bool,
    ) -> PreparedRequest:
        if params.bad_words and not params.bad_words_token_ids:
            params = params.clone(bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))
        self._validate(prompt_ids, params, field)
        requested = params.max_tokens
        if requested is None:
            params = params.clone(max_tokens=max(self.max_model_len - len(prompt_ids), 1))
        if max_tokens_must_fit:
            self._check_fits(len(prompt_ids), requested, params.max_tokens or 0, field)
        return PreparedRequest(request_id, text, prompt_ids, params)

    def submit(self, prepared: PreparedRequest) -> list[tuple[str, Message | Event]]:
        params = prepared.params
        if prepared.request_id in self._requests or prepared.request_id in self._child_owner:
            raise ValueError(f"request_id {describe_request_id(prepared.request_id)} is already in use")
        request = _Request(prepared.request_id, prepared.prompt, prepared.prompt_token_ids, params, children=[],
                           schedule=(prepared.priority, prepared.deadline(prepared.ttft_target_ms),
                                     prepared.deadline(prepared.e2e_target_ms)),
                           session_key=prepared.session_key)
        messages: list[tuple[str, Message | Event]] = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.child_seed(index))
            engine_id = request.request_id if params.n == 1 else child_request_id(request.request_id, index)
            child = _Child(engine_id, index, child_params, self._detokenizer(request.prompt_token_ids, child_params))
            if params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            request.children.append(child)
            self._child_owner[engine_id] = (request, child)
            add = AddRequest(
                request_id=engine_id,
                prompt_token_ids=request.prompt_token_ids,
                params=child_params,
                eos_token_ids=self.eos_token_ids,
                priority=request.schedule[0],
                ttft_deadline=request.schedule[1],
                e2e_deadline=request.schedule[2],
                arrival_time=prepared.arrival_time,
                session_key=request.session_key,
            )
            messages.append((SCHEDULER, add))
            messages.append(
                (BUS, Arrived(request_id=engine_id, num_prompt_tokens=len(request.prompt_token_ids),
                              max_tokens=child_params.max_tokens or 0, priority=add.priority,
                              ttft_deadline=add.ttft_deadline, e2e_deadline=add.e2e_deadline))
            )
        self._requests[request.request_id] = request
        return messages

    def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> list[tuple[str, Message | Event]]:
        return self.submit(self.prepare(request_id, prompt, params))

    def _validate(self, prompt_ids: list[int], params: SamplingParams, field: str = "prompt") -> None:
        if not prompt_ids:
            raise ValueError(f"{field}: the prompt is empty")
        # min/max run in C: a 2,000-token prompt is checked in microseconds, not a Python loop
        low, high = min(prompt_ids), max(prompt_ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        outside = [token_id for token_id in params.stop_token_ids if token_id >= self.vocab_size]
        if outside:
            raise ValueError(
                f"stop_token_ids: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        check_control_ids(params, self.vocab_size)
        check_structured_outputs(params.structured_outputs, self.tokenizer is not None)
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"{field}: {len(prompt_ids)} tokens is longer than max_model_len ({self.max_model_len})"
            )
        if self.tokenizer is None and params.stop:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init=True)")

    def _check_fits(self, num_prompt: int, requested: int | None, max_tokens: int, field: str) -> None:
        """The prompt plus max_tokens must fit in max_model_len (vLLM's OpenAI server's words)."""
        total = num_prompt + max_tokens
        if total <= self.max_model_len:
            return
        blame = "max_tokens" if requested is not None and num_prompt < self.max_model_len else field
        raise ValueError(
            f"{blame}: This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {total} tokens ({num_prompt} in the {field}, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )

    # ------------------------------------------------------------------ text out
    def token_text(self, token_id: int) -> str | None:
        """One token's text (special tokens spelled out); None without a tokenizer."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

    def prompt_text(self, prepared: PreparedRequest) -> str:
        """The prompt's text: as given, else decoded from its token ids ("" without a tokenizer)."""
        if prepared.prompt is not None:
            return prepared.prompt
        return self.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False) if self.tokenizer else ""

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        from vllm_actors.actors.frontend.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def abort(self, request_id: str, reason: str = "abort") -> list[tuple[str, Message]]:
        """End a request here and at the scheduler, which publishes ABORTED(reason) ("abort",
        "disconnect", "shutdown", ...)."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        ids = [child.engine_id for child in request.children if child.finish_reason is None]
        for child in request.children:
            if child.finish_reason is None:
                child.finish_reason = "abort"
        self._forget(request)
        return [(SCHEDULER, AbortRequests(request_ids=ids, reason=reason))] if ids else []

    # ------------------------------------------------------------------ recovery
    def resubmit(self) -> list[tuple[str, Message]]:
        """After the scheduler restarted (its state is gone): every unfinished engine request again,
        as ``AddRequest(resume=True)`` with the output tokens received so far, so that the new
        scheduler resumes it by recompute. Same id, prompt, parameters (an n>1 child keeps its own
        seed) and EOS ids. Children already finished here (a stop string, an error) are left out;
        each detokenizer continues where it was, the scheduler sending only tokens after those.
        No ARRIVED event: the request arrived once."""
        messages: list[tuple[str, Message]] = []
        for request in self._requests.values():
            for child in request.children:
                if child.finish_reason is not None:
                    continue
                messages.append((SCHEDULER, AddRequest(
                    request_id=child.engine_id,
                    prompt_token_ids=request.prompt_token_ids,
                    params=child.params,
                    eos_token_ids=self.eos_token_ids,
                    resume=True,
                    output_token_ids=list(child.token_ids),
                    # its deadlines stand; no arrival time: a resubmission is never refused as late
                    priority=request.schedule[0],
                    ttft_deadline=request.schedule[1],
                    e2e_deadline=request.schedule[2],
                    session_key=request.session_key,
                )))
        return messages

    def fail_all(self, error: str) -> list[tuple[str, Any]]:
        """The engine is gone for good: every open request ends now, its unfinished children with
        finish reason "error" and the request with ``error``. Returns their final outputs (for the
        client); nothing goes to the scheduler."""
        out: list[tuple[str, Any]] = []
        for request in list(self._requests.values()):
            for child in request.children:
                if child.finish_reason is None:
                    child.finish_reason = "error"
            request.error = error
            out.append((CLIENT, self._output(request)))
            self._forget(request)
        return out

    # ------------------------------------------------------------------ updates in
    def handle(self, message: Message) -> list[tuple[str, Any]]:
        if not isinstance(message, RequestUpdates):
            raise TypeError(f"the frontend does not take {type(message).__name__}")
        out: list[tuple[str, Any]] = []
        touched: dict[str, _Request] = {}
        for update in message.updates:
            owner = self._child_owner.get(update.request_id)
            if owner is None:
                continue  # finished or aborted here already
            request, child = owner
            touched[request.request_id] = request
            if update.error is not None:
                request.error = update.error
                child.finish_reason = "error"
                continue
            if update.num_cached_tokens and child.index == 0:
                request.num_cached_tokens = update.num_cached_tokens
            if update.prompt_logprobs is not None and child.index == 0:
                self._add_prompt_logprobs(request, update.prompt_logprobs_start, update.prompt_logprobs)
            # Tokens this child has already (a catch-up overlapping what came before) are left out.
            update = without_delivered(update, len(child.token_ids))
            if update.new_token_ids:
                new_ids = list(update.new_token_ids)
                stopped = None
                if child.detokenizer is not None:
                    step = child.detokenizer.add_tokens(new_ids)
                    child.text += step.text
                    if step.stopped:
                        stopped = step
                        new_ids = new_ids[: step.num_tokens]  # nothing after the stop string
                child.token_ids.extend(new_ids)
                if update.logprobs is not None and child.logprobs is not None:
                    for entry in update.logprobs[: len(new_ids)]:
                        child.logprobs.append(self._position_logprobs(entry))
                        child.cumulative_logprob = (child.cumulative_logprob or 0.0) + entry.logprobs[0]
                if stopped is not None:
                    child.finish_reason, child.stop_reason = "stop", stopped.stop_reason
                    if update.finish_reason is not None:
                        continue  # the scheduler ended it on this very token and said so on the bus
                    out.append((SCHEDULER, AbortRequests(request_ids=[child.engine_id], reason="stop")))
                    out.append(
                        (BUS, Finished(request_id=child.engine_id, reason="stop",
                                       num_prompt_tokens=len(request.prompt_token_ids),
                                       num_output_tokens=len(child.token_ids), stop_reason=stopped.stop_reason))
                    )
                    continue
            if update.finish_reason is not None:
                if child.detokenizer is not None:
                    child.text += child.detokenizer.finish()
                child.finish_reason, child.stop_reason = update.finish_reason, update.stop_reason
        for request in touched.values():
            out.append((CLIENT, self._output(request)))
            if request.finished:
                self._forget(request)
        return out

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        for child in request.children:
            self._child_owner.pop(child.engine_id, None)

    def _add_prompt_logprobs(self, request: _Request, start: int, entries: list[Logprobs]) -> None:
        # entries[i] belongs to prompt position start + i; after a preemption during prefill the
        # same positions may come again, so they are placed by position, not appended.
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
        for offset, entry in enumerate(entries):
            position = start + offset
            if 0 < position < len(request.prompt_logprobs):
                request.prompt_logprobs[position] = self._position_logprobs(entry)

    def _position_logprobs(self, entry: Logprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        texts = self._texts_of(entry.token_ids)
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True):
            if token_id in result:
                continue
            result[token_id] = Logprob(logprob=logprob if math.isfinite(logprob) else -math.inf, rank=rank,
                                       decoded_token=texts.get(token_id))
        return result

    def _texts_of(self, token_ids: Sequence[int]) -> dict[int, str]:
        """Each token's text, decoded once per token id for the frontend's life (at most the
        vocabulary): a position with the whole vocabulary (logprobs -1) then costs lookups. Measured
        on SmolLM2's 49,152 tokens: 0.05 s of decoding per position saved, half of it."""
        if self.tokenizer is None:
            return {}
        cache = self._token_texts
        for token_id in token_ids:
            if token_id not in cache:
                cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return cache

    def _output(self, request: _Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            outputs=[
                CompletionOutput(
                    index=child.index,
                    text=child.text,
                    token_ids=list(child.token_ids),
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=list(child.logprobs) if child.logprobs is not None else None,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
                for child in request.children
            ],
            finished=request.finished,
            error=request.error,
        )

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

