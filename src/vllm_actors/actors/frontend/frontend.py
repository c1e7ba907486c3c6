"""The frontend's state machine: prompts in, text out.

It owns the client side's text: it tokenises prompts and chats (``text.py``), validates them
(raising ``ValueError`` naming the field before anything is queued, ``prepared.py``), fans a
request with ``n > 1`` out into n engine requests, detokenises the scheduler's token updates
incrementally, applies stop strings (ending the request at the scheduler with an abort of reason
"stop") and sends its client, per update, what is new for each request (``OutputDelta``; the
client assembles vLLM's cumulative ``RequestOutput`` from them, ``cumulative.py``). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_actors.actors.frontend.controls import bad_words_token_ids
from vllm_actors.actors.frontend.logprobs import LogprobTexts
from vllm_actors.actors.frontend.outputs import CompletionDelta, OutputDelta, PositionLogprobs, PromptPart
from vllm_actors.actors.frontend.prepared import PreparedRequest, check_fits, check_prompt
from vllm_actors.actors.frontend.text import ChatMessages, PromptInput, tokenize_chat, tokenize_prompt
from vllm_actors.protocol.events import Arrived, Finished
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    Logprobs,
    Message,
    RequestUpdates,
    without_delivered,
)
from vllm_actors.protocol.names import (
    CLIENT,
    SCHEDULER,
    child_request_id,
    describe_request_id,
    request_id_error,
)
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.detokenizer import IncrementalDetokenizer
    from vllm_actors.actors.frontend.tokenizer import Tokenizer

__all__ = ["Frontend", "PreparedRequest"]


@dataclass
class _Child:
    engine_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)  # every token so far (a resubmission sends them)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What the next delta carries: tokens from ``num_sent`` on, and the text and logprobs since then.
    num_sent: int = 0
    new_text: str = ""
    new_logprobs: list[PositionLogprobs] | None = None  # None: logprobs not asked for

    def delta(self) -> CompletionDelta:
        """What is new since the last delta; taking it marks it sent."""
        change = CompletionDelta(self.index, self.new_text, self.token_ids[self.num_sent:], self.new_logprobs,
                                 self.cumulative_logprob, self.finish_reason, self.stop_reason)
        self.num_sent, self.new_text = len(self.token_ids), ""
        if self.new_logprobs is not None:
            self.new_logprobs = []
        return change


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    error: str | None = None
    num_cached_tokens: int = 0  # the first child's prompt tokens found in the prefix cache
    # (priority, TTFT deadline, end-to-end deadline): sent again with a resubmission
    schedule: tuple[int, float | None, float | None] = (0, None, None)
    session_key: str | None = None
    lora_request: LoRARequest | None = None
    prompt_sent: bool = False  # the first delta (with the prompt) has gone to the client
    # The prompt as AddRequest carries it when it could be packed (the scheduler reads it in place,
    # where a list costs it a Python int per id to decode); b"": as the list.
    packed_prompt: bytes = b""
    new_prompt_logprobs: list[tuple[int, PositionLogprobs]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(child.finish_reason is not None for child in self.children)

    @property
    def listed_prompt(self) -> list[int]:
        """AddRequest's prompt_token_ids: empty when the prompt goes packed."""
        return [] if self.packed_prompt else self.prompt_token_ids

    def delta(self) -> OutputDelta:
        """What is new for the client since the last delta (the prompt with the first)."""
        prompt = None if self.prompt_sent else PromptPart(self.prompt, self.prompt_token_ids)
        self.prompt_sent = True
        prompt_logprobs, self.new_prompt_logprobs = self.new_prompt_logprobs or None, []
        return OutputDelta(self.request_id, [child.delta() for child in self.children], self.finished,
                           self.num_cached_tokens, self.error, prompt, prompt_logprobs)


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
        self._logprobs = LogprobTexts(tokenizer)

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
        packed = check_prompt(prompt_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                              has_tokenizer=self.tokenizer is not None, field=field)
        requested = params.max_tokens
        if requested is None:
            params = params.clone(max_tokens=max(self.max_model_len - len(prompt_ids), 1))
        if max_tokens_must_fit:
            check_fits(len(prompt_ids), requested, params.max_tokens or 0, self.max_model_len, field)
        return PreparedRequest(request_id, text, prompt_ids, params, packed_prompt=packed)

    def submit(self, prepared: PreparedRequest) -> Outputs:
        params = prepared.params
        if prepared.request_id in self._requests or prepared.request_id in self._child_owner:
            raise ValueError(f"request_id {describe_request_id(prepared.request_id)} is already in use")
        request = _Request(prepared.request_id, prepared.prompt, prepared.prompt_token_ids, params, children=[],
                           schedule=(prepared.priority, prepared.deadline(prepared.ttft_target_ms),
                                     prepared.deadline(prepared.e2e_target_ms)),
                           session_key=prepared.session_key, lora_request=prepared.lora_request,
                           packed_prompt=prepared.packed_prompt)
        out = Outputs()
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.child_seed(index))
            engine_id = request.request_id if params.n == 1 else child_request_id(request.request_id, index)
            child = _Child(engine_id, index, child_params, self._detokenizer(request.prompt_token_ids, child_params))
            if params.logprobs is not None:
                child.new_logprobs, child.cumulative_logprob = [], 0.0
            request.children.append(child)
            self._child_owner[engine_id] = (request, child)
            add = AddRequest(
                request_id=engine_id,
                prompt_token_ids=request.listed_prompt,
                packed_prompt=request.packed_prompt,
                params=child_params,
                eos_token_ids=self.eos_token_ids,
                priority=request.schedule[0],
                ttft_deadline=request.schedule[1],
                e2e_deadline=request.schedule[2],
                arrival_time=prepared.arrival_time,
                session_key=request.session_key,
                lora_request=request.lora_request,
            )
            out.send(SCHEDULER, add)
            out.emit(Arrived(request_id=engine_id, num_prompt_tokens=len(request.prompt_token_ids),
                             max_tokens=child_params.max_tokens or 0, priority=add.priority,
                             ttft_deadline=add.ttft_deadline, e2e_deadline=add.e2e_deadline))
        self._requests[request.request_id] = request
        return out

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> Outputs:
        return self.submit(self.prepare(request_id, prompt, params))

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

    def abort(self, request_id: str, reason: str = "abort") -> Outputs:
        """End a request here and at the scheduler, which publishes ABORTED(reason) ("abort",
        "disconnect", "shutdown", ...)."""
        out = Outputs()
        request = self._requests.get(request_id)
        if request is None:
            return out
        ids = [child.engine_id for child in request.children if child.finish_reason is None]
        for child in request.children:
            if child.finish_reason is None:
                child.finish_reason = "abort"
        self._forget(request)
        if ids:
            out.send(SCHEDULER, AbortRequests(request_ids=ids, reason=reason))
        return out

    # ------------------------------------------------------------------ recovery
    def resubmit(self) -> Outputs:
        """After the scheduler restarted (its state is gone): every unfinished engine request again,
        as ``AddRequest(resume=True)`` with the output tokens received so far, so that the new
        scheduler resumes it by recompute. Same id, prompt, parameters (an n>1 child keeps its own
        seed) and EOS ids. Children already finished here (a stop string, an error) are left out;
        each detokenizer continues where it was, the scheduler sending only tokens after those.
        No ARRIVED event: the request arrived once."""
        out = Outputs()
        for request in self._requests.values():
            for child in request.children:
                if child.finish_reason is not None:
                    continue
                out.send(SCHEDULER, AddRequest(
                    request_id=child.engine_id,
                    prompt_token_ids=request.listed_prompt,
                    packed_prompt=request.packed_prompt,
                    params=child.params,
                    eos_token_ids=self.eos_token_ids,
                    resume=True,
                    output_token_ids=list(child.token_ids),
                    # its deadlines stand; no arrival time: a resubmission is never refused as late
                    priority=request.schedule[0],
                    ttft_deadline=request.schedule[1],
                    e2e_deadline=request.schedule[2],
                    session_key=request.session_key,
                    lora_request=request.lora_request,
                ))
        return out

    def fail_all(self, error: str) -> Outputs:
        """The engine is gone for good: every open request ends now, its unfinished children with
        finish reason "error" and the request with ``error``. Returns their final deltas (for the
        client); nothing goes to the scheduler."""
        out = Outputs()
        for request in list(self._requests.values()):
            for child in request.children:
                if child.finish_reason is None:
                    child.finish_reason = "error"
            request.error = error
            out.send(CLIENT, request.delta())
            self._forget(request)
        return out

    # ------------------------------------------------------------------ updates in
    def handle(self, message: Message) -> Outputs:
        """The scheduler's updates: one ``OutputDelta`` per request they touch (to ``CLIENT``), and
        for a child ended here by a stop string its abort (to the scheduler) and FINISHED event."""
        if not isinstance(message, RequestUpdates):
            raise TypeError(f"the frontend does not take {type(message).__name__}")
        out = Outputs()
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
                    child.new_text += step.text
                    if step.stopped:
                        stopped = step
                        new_ids = new_ids[: step.num_tokens]  # nothing after the stop string
                child.token_ids.extend(new_ids)
                if update.logprobs is not None and child.new_logprobs is not None:
                    for entry in update.logprobs[: len(new_ids)]:
                        child.new_logprobs.append(self._logprobs.position(entry))
                        child.cumulative_logprob = (child.cumulative_logprob or 0.0) + entry.logprobs[0]
                if stopped is not None:
                    child.finish_reason, child.stop_reason = "stop", stopped.stop_reason
                    if update.finish_reason is not None:
                        continue  # the scheduler ended it on this very token and said so on the bus
                    out.send(SCHEDULER, AbortRequests(request_ids=[child.engine_id], reason="stop"))
                    out.emit(Finished(request_id=child.engine_id, reason="stop",
                                      num_prompt_tokens=len(request.prompt_token_ids),
                                      num_output_tokens=len(child.token_ids), stop_reason=stopped.stop_reason))
                    continue
            if update.finish_reason is not None:
                if child.detokenizer is not None:
                    child.new_text += child.detokenizer.finish()
                child.finish_reason, child.stop_reason = update.finish_reason, update.stop_reason
        for request in touched.values():
            out.send(CLIENT, request.delta())
            if request.finished:
                self._forget(request)
        return out

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        for child in request.children:
            self._child_owner.pop(child.engine_id, None)

    def _add_prompt_logprobs(self, request: _Request, start: int, entries: list[Logprobs]) -> None:
        # entries[i] belongs to prompt position start + i; after a preemption during prefill the
        # same positions may come again: the client places them by position.
        for offset, entry in enumerate(entries):
            position = start + offset
            if 0 < position < len(request.prompt_token_ids):
                request.new_prompt_logprobs.append((position, self._logprobs.position(entry)))

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

