"""Structured outputs: grammars compiled once and cached, one matcher per constrained request,
token bitmasks filled on the CPU and applied to the logits on the device before the draw.

The library is llguidance: it compiled JSON schemas fastest of those compared (``benchmarks/RESULTS.md``)
and installs with no dependencies.

* ``Grammars`` (one per worker) compiles each (kind, spec) once on a background thread and keeps the
  pristine matchers in an LRU cache; ``start`` returns a ``RowMatcher`` at once, its matcher a
  ``deep_copy`` of the cached one, taken when first needed. The tokenizer comes from the
  ``load_tokenizer`` it is given, called on that thread at the first constrained request (workers
  that never see one pay nothing; ``grammar_tokenizer.py`` builds it from the model's tokenizer).
* A ``RowMatcher`` follows its request's output: it replays the outputs a resumed (preempted)
  request already has, and consumes each token the worker samples, before the next step is
  planned (no round trip). With ``start_after`` (a reasoning model's end-of-reasoning token) it
  stays inactive, masking nothing, until that token is drawn. A request dropped (finished,
  aborted, preempted) drops its matcher; a preempted one comes back as new and replays its
  outputs into a fresh copy.
* ``fill_bitmask`` writes the constrained rows' masks ([rows, ceil(vocab / 32)] int32, bit ``t % 32``
  of word ``t // 32`` allows token ``t``) into a reused (pinned, on a GPU; refilled once its copy has
  run: ``staging.py``) host buffer; ``apply_bitmask``
  copies it to the device once and sets the disallowed logits of those rows to -inf. A matcher at the
  grammar's end (or in error) allows only EOS, which ends the request with finish reason "stop".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock
from typing import TYPE_CHECKING

import torch

from vllm_actors.actors.frontend.structured import cache_key, grammar_text
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.sampling import StructuredOutputs
from vllm_actors.runner.staging import StagingSets

if TYPE_CHECKING:
    import llguidance

_MASK = float("-inf")
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class RowMatcher:
    """One request's matcher: follows its output tokens."""

    def __init__(self, compiled: Future[llguidance.LLMatcher], replay: Sequence[int],
                 start_after: int | None = None) -> None:
        self._compiled = compiled
        self._replay: list[int] = []  # outputs to consume once the matcher exists
        self._matcher: llguidance.LLMatcher | None = None
        self._start_after = start_after
        self.active = start_after is None  # constraining: from the start, or once start_after was drawn
        for token_id in replay:
            self.consume(token_id)

    def ready(self) -> bool:
        return self._matcher is not None or self._compiled.done()

    def matcher(self) -> llguidance.LLMatcher:
        """The matcher, waiting for the compile if it is still running (it started when the request
        was admitted, before its prefill's forward pass)."""
        if self._matcher is None:
            self._matcher = self._compiled.result().deep_copy()
            for token_id in self._replay:
                self._matcher.consume_token(token_id)
            self._replay = []
        return self._matcher

    def consume(self, token_id: int) -> None:
        if not self.active:  # free output (reasoning) until start_after
            self.active = token_id == self._start_after
            return
        if self._matcher is None:
            self._replay.append(token_id)
        else:
            self._matcher.consume_token(token_id)  # a refused token leaves it in error: EOS only from then

    def is_stopped(self) -> bool:
        return self.matcher().is_stopped()

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar takes in turn from its state. Not yet active: those
        before its start token (the rows after it would need the grammar's first mask)."""
        if not self.active:
            return drafts.index(self._start_after) if self._start_after in drafts else len(drafts)
        return int(self.matcher().validate_tokens(list(drafts)))


class Grammars:
    """Compiles and caches grammars for one worker; fills and applies bitmasks."""

    def __init__(self, load_tokenizer: Callable[[], llguidance.LLTokenizer], capacity: int = CACHE_SIZE) -> None:
        self._load_tokenizer = load_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, bytes], Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = Lock()
        self._capacity = capacity
        self._masks: StagingSets[torch.Tensor] | None = None  # one host buffer, refilled once its copy has run
        self._executor: llguidance.LLExecutor | None = None
        self.compiles = 0  # grammars compiled (not found in the cache)

    def start(self, spec: StructuredOutputs, replay: Sequence[int] = ()) -> RowMatcher:
        """A request's grammar: compiled on the background thread unless cached."""
        key = cache_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                self.compiles += 1
                compiled = self._pool.submit(self._compile, spec)
                self._cache[key] = compiled
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return RowMatcher(compiled, replay, spec.start_after)

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        try:
            text = grammar_text(spec)
        except ValueError:  # the frontend checks first; a raw peer's bad spec: a matcher in error (EOS only)
            text = llguidance.LLMatcher.grammar_from_regex("(")
        return llguidance.LLMatcher(self._tokenizer, text, log_level=0)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def mask(self, logits: torch.Tensor, rows: Sequence[RowMatcher], row_index: list[int],
             drafted: Sequence[Sequence[int]] | None = None) -> None:
        """Mask the constrained rows ``row_index`` of ``logits`` in place (``rows``: their grammars;
        ``drafted``: a verification row's drafts before it, which its mask follows)."""
        bitmask = self.fill_bitmask(rows, logits.device, drafted)
        apply_bitmask(logits, bitmask, row_index)
        assert self._masks is not None  # fill_bitmask made it
        self._masks.enqueued()

    def vocab_size(self) -> int:
        """The tokenizer's (the logits') width; loads the tokenizer if no grammar has yet."""
        if self._tokenizer is None:
            self._pool.submit(lambda: None).result()  # after any compile in flight (which loads it)
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
        return int(self._tokenizer.vocab_size)

    def fill_bitmask(self, rows: Sequence[RowMatcher], device: torch.device,
                     drafted: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """[len(rows), ceil(vocab / 32)] int32 on the host (pinned for a GPU ``device``): each row's
        allowed tokens, in a buffer whose previous copy to ``device`` has run. A row with drafts
        before it (``drafted``, taken by ``valid_drafts``) is masked from the state after them: its
        matcher takes them, fills the row, and rolls them back."""
        import llguidance

        matchers = [row.matcher() for row in rows]  # waits for a compile still running
        words = (self.vocab_size() + 31) // 32
        if self._masks is None:
            self._masks = StagingSets(lambda: torch.empty((0, 0), dtype=torch.int32), device, count=1)
        buffer = self._masks.acquire()
        if buffer.shape[0] < len(rows) or buffer.shape[1] != words:
            buffer = self._masks.replace(torch.empty((max(len(rows), 8), words), dtype=torch.int32,
                                                     pin_memory=device.type == "cuda"))
        host = buffer[: len(rows)]
        if drafted is not None and any(drafted):
            for index, (matcher, drafts) in enumerate(zip(matchers, drafted, strict=True)):
                if drafts and not matcher.consume_tokens(list(drafts)):
                    raise RuntimeError(f"a grammar refused drafts it had taken: {list(drafts)}")
                matcher.unsafe_compute_mask_ptr(host[index].data_ptr(), words * 4)
                if drafts:
                    matcher.rollback(len(drafts))
        elif len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(host.data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(matcher, index) for index, matcher in enumerate(matchers)], host.data_ptr(), words * 4, len(rows)
            )
        return host


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, every logit of ``rows`` whose bit in ``bitmask`` (host, int32, one row
    per entry of ``rows``) is 0: one copy to the device, the bits unpacked there (an AND with the 32
    powers of two), the rows masked in place when every row of the batch is constrained."""
    device = logits.device
    num_rows, vocab = logits.shape
    mask = bitmask.to(device, non_blocking=True)
    disallowed = ((mask.unsqueeze(-1) & _powers(device)) == 0).view(mask.shape[0], -1)[:, :vocab]
    if disallowed.shape[1] < vocab:  # a vocabulary wider than the mask: the extra ids are never allowed
        disallowed = torch.nn.functional.pad(disallowed, (0, vocab - disallowed.shape[1]), value=True)
    with torch.inference_mode():  # the model's logits are inference tensors
        if list(rows) == list(range(num_rows)):
            logits.masked_fill_(disallowed, _MASK)
            return
        index = upload(rows, device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(disallowed, _MASK))


_POWERS: dict[torch.device, torch.Tensor] = {}


def _powers(device: torch.device) -> torch.Tensor:
    """[32] int32: bit i of a word (the sign bit as -2**31)."""
    powers = _POWERS.get(device)
    if powers is None:
        values = [1 << i for i in range(31)] + [-(2**31)]
        powers = _POWERS[device] = upload(values, device, torch.int32)
    return powers
