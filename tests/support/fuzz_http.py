"""The HTTP fuzzer's parts: hypothesis strategies for hostile request bodies and headers of both
OpenAI endpoints, a raw-socket HTTP/1.1 client that can disconnect at any point, and the
classification of what came back into failures (status >= 500 in the head or in-band in a
stream, no answer at all, no answer within the hang bound).

Bodies are built as Python values and written as JSON (NaN and Infinity included, lone
surrogates escaped or raw), or as raw bytes (deep nesting, invalid UTF-8, truncated JSON, binary
junk). Headers are written as bytes, so anything but CR/LF can be sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

MODEL = "fuzz-model"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HANG_SECONDS = 60.0  # an answer later than this is a hang (the engine answers a valid one in well under a second)

INT_BOUNDARIES = [0, 1, -1, 2, 16, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                  -(2**63), -(2**63) - 1, 10**30, -(10**30)]
FLOAT_BOUNDARIES = [0.0, -0.0, 1e-300, 5e-324, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), -1.0, 0.5,
                    1.0, 1.0000001, 2.0]
CLASHING_IDS = ["y", "y#0", "y#1", "y-0", "y-0#1", "y-1", "cmpl-y", "chatcmpl-y", "y#1#1"]
LONG = st.sampled_from([1_000, 10_000, 100_000]).map(lambda k: "x" * k)


def _text(max_size: int = 40) -> st.SearchStrategy[str]:
    """Any unicode, lone surrogates included (hypothesis leaves category Cs out by default)."""
    return st.text(st.characters(codec=None, categories=None), max_size=max_size)


def _ints() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-3, 4), st.sampled_from(INT_BOUNDARIES), st.integers())


def _floats() -> st.SearchStrategy[float]:
    return st.one_of(st.floats(-2.0, 3.0), st.sampled_from(FLOAT_BOUNDARIES), st.floats())


_JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), _ints(), _floats(), _text(12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text(6), inner, max_size=4)),
    max_leaves=8,
)


def _junk() -> st.SearchStrategy[Any]:
    return _JUNK


def _bool() -> st.SearchStrategy[Any]:
    return st.one_of(st.booleans(), st.booleans(), _junk())


def _int_field() -> st.SearchStrategy[Any]:
    return st.one_of(_ints(), _ints(), st.floats(-3, 3), st.sampled_from(["1", "2**64", "", None]), _junk())


def _float_field() -> st.SearchStrategy[Any]:
    return st.one_of(_floats(), _floats(), st.integers(-2, 3), st.sampled_from(["0.5", ""]), _junk())


# max_tokens: anything but null and valid mid-size values (a null fills the context: slow, not hostile).
_CHEAP_LIMIT = st.one_of(st.integers(-3, 4), st.sampled_from(INT_BOUNDARIES), st.integers(min_value=1000),
                         st.floats(-3, 3), st.sampled_from(["1", "2**64", "", [], {}, True]))


def _tokens() -> st.SearchStrategy[list[Any]]:
    return st.lists(st.one_of(st.integers(0, 300), st.integers(0, 300), _ints()), min_size=0, max_size=12)


def _stop() -> st.SearchStrategy[Any]:
    return st.one_of(_text(8), st.lists(_text(8), max_size=4), LONG, _junk())


def _prompt() -> st.SearchStrategy[Any]:
    return st.one_of(
        _text(), _text(), st.lists(_text(20), max_size=3), _tokens(), st.lists(_tokens(), max_size=3),
        st.just(""), st.just([]), LONG, _junk(),
    )


def _content() -> st.SearchStrategy[Any]:
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": _text()}),
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "", "text"])},
                              optional={"text": _junk(), "image_url": _junk()}),
    )
    return st.one_of(_text(), _text(), st.lists(part, max_size=3), st.none(), LONG, _junk())


def _message() -> st.SearchStrategy[Any]:
    role = st.one_of(st.sampled_from(["user", "user", "system", "assistant", "tool", "developer", ""]), _junk())
    return st.one_of(
        st.fixed_dictionaries({"role": role, "content": _content()},
                              optional={"name": _junk(), "tool_calls": _junk(), "tool_call_id": _junk()}),
        _junk(),
    )


def _messages() -> st.SearchStrategy[Any]:
    user = st.fixed_dictionaries({"role": st.just("user"), "content": _text()})
    return st.one_of(st.lists(user, min_size=1, max_size=3), st.lists(_message(), max_size=4), _junk())


SHARED_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.sampled_from([MODEL, "unknown-model", ""]), st.none(), LONG, _junk()),
    "n": st.one_of(st.integers(1, 3), st.sampled_from(INT_BOUNDARIES), st.floats(0, 3), _junk()),
    "temperature": _float_field(), "top_p": _float_field(), "min_p": _float_field(),
    "presence_penalty": _float_field(), "frequency_penalty": _float_field(), "repetition_penalty": _float_field(),
    "seed": _int_field(), "top_k": _int_field(), "min_tokens": _int_field(), "prompt_logprobs": _int_field(),
    "stop": _stop(), "stop_token_ids": st.one_of(_tokens(), _junk()),
    "stream": _bool(), "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": _bool(), "continuous_usage_stats": _bool()}), _junk()),
    "logit_bias": st.one_of(st.dictionaries(_text(4), _float_field(), max_size=3), _junk()),
    "user": st.one_of(_text(), LONG, _junk()),
    "ignore_eos": _bool(), "skip_special_tokens": _bool(), "include_stop_str_in_output": _bool(),
    "max_tokens": st.one_of(st.integers(1, 3), _CHEAP_LIMIT),
}
COMPLETION_FIELDS = {
    **SHARED_FIELDS, "prompt": _prompt(), "logprobs": st.one_of(st.integers(0, 3), _int_field()),
    "echo": _bool(), "best_of": _int_field(), "suffix": st.one_of(_text(), _junk()),
}
CHAT_FIELDS = {
    **SHARED_FIELDS, "messages": _messages(), "max_completion_tokens": st.one_of(st.integers(1, 3), _CHEAP_LIMIT),
    "logprobs": _bool(), "top_logprobs": _int_field(),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}), _junk()),
    "tools": _junk(), "tool_choice": _junk(), "add_generation_prompt": _bool(),
    "chat_template_kwargs": st.one_of(st.dictionaries(_text(8), _junk(), max_size=3), _junk()),
}


_FIELD_CHOICES = {COMPLETIONS: st.lists(st.sampled_from(sorted(COMPLETION_FIELDS)), max_size=4, unique=True),
                  CHAT: st.lists(st.sampled_from(sorted(CHAT_FIELDS)), max_size=4, unique=True)}
_BASES = {
    COMPLETIONS: st.fixed_dictionaries(
        {"model": st.just(MODEL), "prompt": _text(), "max_tokens": st.integers(1, 3)},
        optional={"stream": st.booleans(), "n": st.integers(1, 3), "seed": st.integers(0, 9),
                  "temperature": st.sampled_from([0.0, 0.7])}),
    CHAT: st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
         "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _text()}),
                              min_size=1, max_size=2)},
        optional={"stream": st.booleans(), "n": st.integers(1, 3), "seed": st.integers(0, 9)}),
}
_EXTRA_KEYS = st.dictionaries(_text(8), _JUNK, max_size=1)
_DIGIT = st.integers(0, 9)


def _body(draw: st.DrawFn, path: str) -> Any:
    """A valid cheap request (tiny max_tokens) with up to four fields replaced by hostile values,
    perhaps one left out and an unknown key added; one time in ten not an object at all."""
    fields = COMPLETION_FIELDS if path == COMPLETIONS else CHAT_FIELDS
    body = draw(_BASES[path])
    for name in draw(_FIELD_CHOICES[path]):
        body[name] = draw(fields[name])
    droppable = sorted(set(body) - {"max_tokens", "max_completion_tokens"})
    dropped = draw(_DIGIT)
    if dropped < len(droppable):
        body.pop(droppable[dropped])
    body.update(draw(_EXTRA_KEYS))
    return draw(_JUNK) if draw(_DIGIT) == 0 else body


RAW_BODIES = [
    b"", b"{", b"[", b"null", b"[]", b"1e999", b'"prompt"', b"{}", b'{"prompt": "a", "max_tokens": 1} trailing',
    b"[" * 100_000, b'{"prompt":' * 50_000, b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    b'{"prompt": "\xff\xfe", "max_tokens": 1}', b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "\xc3\x28"}], "max_tokens": 1}', b"\xef\xbb\xbf{}",
    b'{"prompt": "\\ud800", "max_tokens": 1}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"prompt": "a", "max_tokens": 1, "max_tokens": 2}', b'{"prompt": "a", "n": 1e400}',
]


@dataclass
class FuzzRequest:
    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]
    disconnect: str  # "none", "after_send", "mid_body", "after_head", "after_first_chunk"
    shown: str = ""  # a short description of the body, for reports

    def describe(self) -> str:
        headers = {k.decode("latin-1"): _clip(v.decode("latin-1"), 60) for k, v in self.headers}
        return f"POST {self.path} headers={headers} disconnect={self.disconnect} body={self.shown}"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def _encode(value: Any, raw_surrogates: bool) -> bytes:
    if raw_surrogates:  # lone surrogates written as their (invalid) UTF-8 bytes
        return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()


_HEADER_VALUE = st.one_of(
    st.sampled_from(CLASHING_IDS), st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                                         exclude_characters="\x7f"), min_size=1, max_size=30),
    LONG.map(lambda s: s[:60_000]),
).map(lambda s: s.encode("latin-1"))


_PATHS = st.sampled_from([COMPLETIONS, CHAT])
_RAW = st.sampled_from(RAW_BODIES)
_CONTENT_TYPES = st.sampled_from([b"application/json"] * 6 + [b"text/plain", b"application/json; charset=latin-1", b""])
_DISCONNECTS = st.sampled_from(["none"] * 7 + ["after_send", "mid_body", "after_head", "after_first_chunk"])


@st.composite
def fuzz_request(draw: st.DrawFn) -> FuzzRequest:
    path = draw(_PATHS)
    if draw(_DIGIT) == 0:
        body = draw(_RAW)
        shown = _clip(repr(body), 120)
    else:
        value = _body(draw, path)
        body = _encode(value, raw_surrogates=draw(st.booleans()))
        shown = _clip(json.dumps(value), 400)
    headers = [(b"content-type", draw(_CONTENT_TYPES))]
    if draw(_DIGIT) < 3:
        headers.append((b"x-request-id", draw(_HEADER_VALUE)))
    return FuzzRequest(path, body, headers, draw(_DISCONNECTS), shown)


# --------------------------------------------------------------------------- the raw client
@dataclass
class Outcome:
    request: FuzzRequest
    status: int | None = None  # None: no status line read (we left first, or the server closed)
    body: bytes = b""
    problem: str | None = None  # "hang", "no response", "status 500", "in-band 500"
    detail: str = field(default="")
    seconds: float = 0.0


_IN_BAND_5XX = re.compile(rb'(?<!\\)"code":\s*(5\d\d)')


async def send(port: int, request: FuzzRequest, hang_seconds: float = HANG_SECONDS) -> Outcome:
    outcome = Outcome(request)
    started = time.monotonic()
    try:
        await asyncio.wait_for(_exchange(port, request, outcome), hang_seconds)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
        outcome.problem = "hang"
        outcome.detail = f"no complete answer within {hang_seconds:.0f} s (status {outcome.status})"
    except (ConnectionError, OSError) as error:
        if request.disconnect == "none" and outcome.status is None:
            outcome.problem = "no response"
            outcome.detail = f"{type(error).__name__}: {error}"
    outcome.seconds = time.monotonic() - started
    return outcome


async def _exchange(port: int, request: FuzzRequest, outcome: Outcome) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = [b"POST " + request.path.encode() + b" HTTP/1.1", b"host: fuzz", b"connection: close",
                b"content-length: %d" % len(request.body)]
        head += [name + b": " + value for name, value in request.headers]
        payload = b"\r\n".join(head) + b"\r\n\r\n" + request.body
        if request.disconnect == "mid_body":
            payload = payload[: len(payload) - max(1, len(request.body) // 2)]
        writer.write(payload)
        await writer.drain()
        if request.disconnect in ("after_send", "mid_body"):
            return
        received = bytearray()
        while b"\r\n\r\n" not in received:
            chunk = await reader.read(65536)
            if not chunk:
                break
            received += chunk
        if not received.startswith(b"HTTP/1.1 "):
            if request.disconnect == "none":
                outcome.problem, outcome.detail = "no response", f"got {bytes(received[:80])!r}"
            return
        outcome.status = int(received[9:12])
        if request.disconnect == "after_head":
            return
        if request.disconnect == "after_first_chunk":
            await reader.read(65536)
            return
        while chunk := await reader.read(65536):
            if len(received) < 1 << 20:
                received += chunk
        outcome.body = bytes(received.partition(b"\r\n\r\n")[2])
        if outcome.status >= 500:
            outcome.problem, outcome.detail = f"status {outcome.status}", _clip(outcome.body.decode(errors="replace"),
                                                                               300)
        elif match := _IN_BAND_5XX.search(outcome.body):
            outcome.problem = f"in-band {match.group(1).decode()}"
            outcome.detail = _clip(outcome.body.decode(errors="replace"), 300)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def send_batch(port: int, requests: list[FuzzRequest]) -> list[Outcome]:
    """Send the requests all at once and return their outcomes, in order (run in the test's sender process)."""

    async def batch() -> list[Outcome]:
        return list(await asyncio.gather(*(send(port, request) for request in requests)))

    return asyncio.run(batch())


def signature(outcome: Outcome) -> str:
    """What makes two failures the same: endpoint, problem and the error message without its numbers."""
    message = ""
    try:
        message = json.loads(outcome.body.split(b"\n\n")[0].removeprefix(b"data: "))["error"]["message"]
    except (ValueError, KeyError, TypeError, IndexError):
        message = outcome.detail[:80]
    message = re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'...'", message))
    return f"{outcome.request.path} {outcome.problem}: {message[:120]}"
