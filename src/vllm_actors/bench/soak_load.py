"""The soak's load: what each client sends (a weighted mix of valid, invalid and abusive
requests) and how it judges the answer. Pure request building plus one ``fire`` coroutine.

Kinds: ``completion`` / ``chat`` (valid; streamed or not, ``n`` 1-2), ``invalid`` (bad values:
a 4xx is the right answer), ``long_id`` (10 KB or 60 KB ``X-Request-Id``), ``deep_json``,
``bad_utf8``, ``huge`` (a ~30 MB body, at most one at a time and ``huge_every`` seconds apart),
``disconnect`` (a stream the client leaves after its first chunk) and ``clash`` (a chat with
``X-Request-Id: <id>`` and n=2, then one with ``<id>#1`` while it runs: the first is
``clash_owner``, a valid request that must be answered; the newcomer may be refused).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass, field

import httpx

WEIGHTS = {"completion": 30, "chat": 30, "invalid": 10, "long_id": 5, "deep_json": 3, "bad_utf8": 3,
           "disconnect": 15, "clash": 3, "huge": 1}
WORDS = "river stone light window garden morning paper engine silver orange quiet north city field".split()
INVALID: list[dict[str, object]] = [
    {"temperature": -1}, {"top_p": 2.0}, {"n": 0}, {"seed": 2**64 - 1, "n": 2}, {"logprobs": 99},
    {"max_tokens": -5}, {"model": "no-such-model"}, {"prompt": [10**6, 3]}, {"stop": [""]}, {"top_k": -7},
    {"n": 2**31}, {"temperature": "hot"}, {"prompt": {"nested": [[{"x": None}]]}}, {"stream_options": {"x": 1}},
]
_IN_BAND_5XX = re.compile(rb'(?<!\\)"code":\s*5\d\d')


@dataclass
class Shot:
    kind: str
    path: str
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    leave_after_first_chunk: bool = False


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))


def _valid(rng: random.Random, chat: bool, model: str, max_tokens: int,
           stream: bool | None = None) -> dict[str, object]:
    body: dict[str, object] = {"model": model, "max_tokens": rng.randint(1, max_tokens),
                               "n": rng.choice([1, 1, 2]), "temperature": rng.choice([0.0, 0.8]),
                               "stream": rng.random() < 0.5 if stream is None else stream}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    return body


def make_shot(kind: str, rng: random.Random, model: str, max_tokens: int) -> Shot:
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if kind in ("completion", "chat"):
        chat = kind == "chat"
        body = _valid(rng, chat, model, max_tokens)
        return Shot(kind, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode(),
                    stream=bool(body["stream"]))
    if kind == "invalid":
        body = {**_valid(rng, chat, model, max_tokens, stream=False), **rng.choice(INVALID)}
        return Shot(kind, path, json.dumps(body).encode())
    if kind == "long_id":
        body = _valid(rng, chat, model, max_tokens, stream=False)
        header = f"{rng.getrandbits(32):08x}" + "x" * rng.choice([10_000, 60_000])
        return Shot(kind, path, json.dumps(body).encode(), {"X-Request-Id": header})
    if kind == "deep_json":
        return Shot(kind, path, b"[" * 100_000)
    if kind == "bad_utf8":
        return Shot(kind, path, b'{"prompt": "\xff\xfe\xed\xa0\x80", "messages": [], "max_tokens": 1}')
    if kind == "huge":
        filler = " ".join(rng.choice(WORDS) for _ in range(5_000_000))[: 30 * 1024 * 1024 - 100]
        body = {"model": model, "max_tokens": 1, ("messages" if chat else "prompt"):
                [{"role": "user", "content": filler}] if chat else filler}
        return Shot(kind, path, json.dumps(body).encode())
    if kind == "disconnect":
        body = {**_valid(rng, chat, model, max_tokens, stream=True), "max_tokens": max(max_tokens, 32)}
        return Shot(kind, path, json.dumps(body).encode(), stream=True, leave_after_first_chunk=True)
    raise ValueError(f"unknown kind {kind!r}")


@dataclass
class Result:
    kind: str
    status: int | None
    complete: bool
    problem: str | None  # None, "hang", "transport", "status 5xx", "in-band 5xx"
    detail: str = ""


async def fire(http: httpx.AsyncClient, shot: Shot, hang_seconds: float) -> Result:
    """Send one request and judge the answer; a ``hang`` is no whole answer within ``hang_seconds``."""
    seen: list[int] = []  # the status, once the head has come
    try:
        body = await asyncio.wait_for(_exchange(http, shot, seen), hang_seconds)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
        return Result(shot.kind, seen[0] if seen else None, False, "hang", f"no answer in {hang_seconds:.0f} s")
    except httpx.HTTPError as error:
        detail = f"{type(error).__name__}: {error}"[:200]
        return Result(shot.kind, seen[0] if seen else None, False, "transport", detail)
    status = seen[0]
    if status >= 500:
        return Result(shot.kind, status, False, f"status {status}", body[:200].decode(errors="replace"))
    if _IN_BAND_5XX.search(body):
        return Result(shot.kind, status, False, "in-band 5xx", body[-300:].decode(errors="replace"))
    if shot.leave_after_first_chunk:
        return Result(shot.kind, status, False, None)
    complete = status == 200 and (not shot.stream or body.rstrip().endswith(b"data: [DONE]"))
    return Result(shot.kind, status, complete, None)


async def _exchange(http: httpx.AsyncClient, shot: Shot, seen: list[int]) -> bytes:
    headers = {"Content-Type": "application/json", **shot.headers}
    async with http.stream("POST", shot.path, content=shot.content, headers=headers) as response:
        seen.append(response.status_code)
        if shot.leave_after_first_chunk:
            async for chunk in response.aiter_raw():
                return chunk  # leaving the block closes the connection mid-stream
            return b""
        return await response.aread()


async def fire_clash(http: httpx.AsyncClient, rng: random.Random, model: str, max_tokens: int,
                     hang_seconds: float) -> list[Result]:
    """A chat with ``X-Request-Id: <id>`` and n=2, and while it runs another with ``<id>#1``."""
    ident = f"clash{rng.getrandbits(40):010x}"
    owner_body = {**_valid(rng, True, model, max_tokens, stream=True), "n": 2, "max_tokens": max(max_tokens, 16)}
    owner = Shot("clash_owner", "/v1/chat/completions", json.dumps(owner_body).encode(), {"X-Request-Id": ident},
                 stream=True)
    newcomer = Shot("clash", "/v1/chat/completions", json.dumps(_valid(rng, True, model, max_tokens, False)).encode(),
                    {"X-Request-Id": f"{ident}#1"})
    first = asyncio.ensure_future(fire(http, owner, hang_seconds))
    await asyncio.sleep(0.05)  # let the owner's request reach the engine first (pacing only)
    second = await fire(http, newcomer, hang_seconds)
    return [await first, second]
