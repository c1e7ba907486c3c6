"""Incremental detokenization with stop strings.

Token ids arrive a few at a time; text must stream out so that the concatenation of every delta
equals ``tokenizer.decode(output ids)``. Decoding each token alone is wrong (byte-level BPE
splits multi-byte characters over tokens, sentencepiece decoders drop a leading space at the start
of a decode call), and decoding everything every step is quadratic. So we keep a small window of
ids: ``window[:read]`` is already-emitted context, and each step decodes the whole window and
emits what lies beyond the context's text. Once the window's text ends cleanly the context moves
up to the end. Text ending in U+FFFD (an incomplete UTF-8 character) is not emitted until the
next token completes it, or until `finish`.

Stop strings are searched only in newly exposed text (plus the len(stop)-1 characters before
it). Streamed deltas hold back any tail of the text that could still begin a stop string, so a
stop string is never streamed out and then "taken back".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_actors.actors.frontend.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token (enough for any decoder to
# settle on its leading-space handling; more only costs time).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    text: str  # the new text delta
    stopped: bool = False
    stop_reason: str | None = None  # the stop string that matched
    num_tokens: int = 0  # how many of the ids passed to add_tokens were used (fewer after a stop)


class IncrementalDetokenizer:
    """Turns a request's output ids into streamed text, applying stop strings.

    ``output_text`` is the concatenation of all deltas returned so far (``add_tokens`` and
    ``finish``); ``token_ids`` the output ids consumed (the last one completes a stop string, if
    any matched).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self.token_ids: list[int] = []

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # A prompt ending inside a character would glue its bytes to the first output token.
            context, context_text = [], ""
        self._window: list[int] = context
        self._read = len(context)  # window[:read] decodes to self._context_text, already accounted for
        self._context_text = context_text
        self._window_taken = 0  # chars of the window's text beyond the context already decoded

        # Decoded text is either released (returned as deltas) or pending: held back because it
        # could begin a stop string, or decoded in the current add_tokens call. A stop string
        # therefore always starts inside the pending text, which stays short.
        self._released: list[str] = []
        self._pending = ""
        self._stopped = False
        self._stop_reason: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ public
    @property
    def output_text(self) -> str:
        return "".join(self._released)

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def add_tokens(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        if self._stopped or self._finished:
            return DetokenizerUpdate("", self._stopped, self._stop_reason, 0)
        used = 0
        for token_id in new_token_ids:
            used += 1
            self.token_ids.append(token_id)
            start = len(self._pending)
            self._pending += self._step(token_id)
            if len(self.token_ids) >= self._min_tokens and len(self._pending) > start and self._check_stop(start):
                break
        return DetokenizerUpdate(self._release(), self._stopped, self._stop_reason, used)

    def finish(self) -> str:
        """The request ended without a stop string: flush held-back and incomplete text."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        window_text = self._decode(self._window)
        self._pending += window_text[len(self._context_text) + self._window_taken :]
        return self._release(flush=True)

    # ------------------------------------------------------------------ internals
    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _step(self, token_id: int) -> str:
        """Append one id to the window; return the newly stable text."""
        self._window.append(token_id)
        text = self._decode(self._window)
        stable_end = len(text.rstrip(_REPLACEMENT))
        begin = len(self._context_text) + self._window_taken
        new = text[begin:stable_end] if stable_end > begin else ""
        if stable_end == len(text):
            # Clean end: the window's ids are all accounted for; they become the next context.
            self._window = self._window[self._read :]
            self._read = len(self._window)
            self._context_text = self._decode(self._window)
            self._window_taken = 0
        else:
            # Only the part before the trailing U+FFFD run is final; keep the window.
            self._window_taken += len(new)
        return new

    def _check_stop(self, start: int) -> bool:
        """Look for stop strings in the pending text from ``start`` on (with len(stop)-1
        characters of overlap); keep the pending text up to the earliest match."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._pending.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self._pending = self._pending[: index + len(stop) if self._include_stop else index]
        self._stopped, self._stop_reason = True, stop
        return True

    def _release(self, flush: bool = False) -> str:
        """Release the pending text that can no longer be the start of a stop string."""
        pending = self._pending
        hold = 0 if flush or self._stopped or not self._stops else self._held_suffix_length(pending)
        delta, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        if delta:
            self._released.append(delta)
        return delta

    def _held_suffix_length(self, pending: str) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of a stop string.
        Released text need not be considered: no suffix starting there was a stop prefix when it
        was released, and a longer text cannot make one."""
        for length in range(min(self._max_hold, len(pending)), 0, -1):
            tail = pending[len(pending) - length :]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
