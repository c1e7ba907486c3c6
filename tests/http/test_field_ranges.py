"""Request fields at the HTTP edge: integers in range before anything touches shared state (seeds over
signed 64 bits, n, logprobs, token counts, top_k, stop token ids against the vocabulary), and
whatever a request reserved released on every path out, errors included. Served in process over a
fake scheduler (fake_served.py): no model, no processes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.fake_served import Env, asgi, env, served_app, tokenizer, wait_until_async  # noqa: F401
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.frontend.tokenizer import Tokenizer
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.messages import AddRequest
from vllm_actors.protocol.sampling import MAX_INT32, MAX_N, MAX_SEED, MIN_SEED
from vllm_actors.server.streaming import EventStreamResponse

TOP = 2**64 - 1  # the seed of the issue: fits msgpack's uint64, its child's seed (+1) does not


# =========================================================================== SamplingParams
@pytest.mark.parametrize("seed", [-1, 0, MIN_SEED, MAX_SEED, 12345])
def test_seeds_over_the_signed_64_bit_range_are_accepted(seed: int) -> None:
    assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize(("field", "value"), [
    ("seed", MAX_SEED + 1), ("seed", MIN_SEED - 1), ("seed", TOP), ("seed", 10**30),
    ("n", 0), ("n", MAX_N + 1), ("n", 2**70),
    ("max_tokens", 0), ("max_tokens", MAX_INT32 + 1), ("max_tokens", 2**64),
    ("min_tokens", -1), ("min_tokens", MAX_INT32 + 1),
    ("top_k", -2), ("top_k", MAX_INT32 + 1),
    ("logprobs", -2), ("logprobs", 2**64), ("prompt_logprobs", MAX_INT32 + 1), ("prompt_logprobs", -5),
])
def test_out_of_range_integers_are_a_value_error_naming_the_field(field: str, value: int) -> None:
    fields: dict[str, Any] = {field: value}
    if field == "min_tokens":
        fields["max_tokens"] = None
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**fields)


def test_stop_token_ids_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="^stop_token_ids must be"):
        SamplingParams(stop_token_ids=[1, 2**64])


def test_every_child_seed_fits_the_wire_and_is_a_valid_seed(tokenizer: Tokenizer) -> None:  # noqa: F811
    params = SamplingParams(seed=MAX_SEED, n=3, max_tokens=4)
    assert [params.child_seed(i) for i in range(3)] == [MAX_SEED, MIN_SEED, MIN_SEED + 1]
    assert SamplingParams(seed=5, n=2).child_seed(1) == 6  # unchanged away from the edge
    frontend = Frontend(tokenizer, [tokenizer.eos_token_id or 0], 256, tokenizer.vocab_size)
    prepared = frontend.prepare("edge", {"prompt_token_ids": [5, 6]}, params)
    codec = MessageCodec()
    adds = [m for _, m in frontend.submit(prepared).messages if isinstance(m, AddRequest)]
    decoded = [codec.decode(codec.encode(add)) for add in adds]  # the scheduler validates on decode
    assert [d.params.seed for d in decoded] == [MAX_SEED, MIN_SEED, MIN_SEED + 1]


def test_stop_token_ids_outside_the_vocabulary_are_refused_by_the_frontend(tokenizer: Tokenizer) -> None:  # noqa: F811
    frontend = Frontend(tokenizer, [tokenizer.eos_token_id or 0], 256, tokenizer.vocab_size)
    params = SamplingParams(stop_token_ids=[tokenizer.vocab_size])
    with pytest.raises(ValueError, match=rf"^stop_token_ids: token id {tokenizer.vocab_size} is outside"):
        frontend.prepare("x", {"prompt_token_ids": [5]}, params)
    assert frontend.num_unfinished == 0


# =========================================================================== HTTP: 400 naming the field
COMPLETION = {"prompt": "Hello there", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"seed": TOP, "n": 2}, "seed"),
    ("/v1/completions", {"seed": 2**63}, "seed"),
    ("/v1/completions", {"seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 10**20}, "n"),
    ("/v1/completions", {"n": 200}, "n"),  # more than the server ever admits at once (max_in_flight 16)
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": 2**64}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 2**63}, "prompt_logprobs"),
    ("/v1/completions", {"max_tokens": 2**64}, "max_tokens"),
    ("/v1/completions", {"max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"min_tokens": 2**40, "max_tokens": None}, "min_tokens"),
    ("/v1/completions", {"top_k": 2**40}, "top_k"),
    ("/v1/completions", {"stop_token_ids": [2**64 - 1]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),  # outside the vocabulary
    ("/v1/chat/completions", {"seed": TOP, "n": 2}, "seed"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 2**40}, "max_tokens"),
    ("/v1/chat/completions", {"n": 10**20}, "n"),
]


@pytest.mark.asyncio
async def test_out_of_range_integers_are_a_400_naming_the_field(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async with served_app(env, monkeypatch, max_num_seqs=8, max_waiting_requests=8) as (client, app):
        async with asgi(app) as http:
            for path, fields, param in BAD_FIELDS:
                base = COMPLETION if path == "/v1/completions" else CHAT
                reply = await http.post(path, json={**base, **fields})
                assert reply.status_code == 400, (path, fields, reply.text)
                error = reply.json()["error"]
                assert error["param"] == param and error["type"] == "BadRequestError", (fields, error)
            assert client.num_unfinished == 0 and client.frontend.num_unfinished == 0


# =========================================================================== slots released
@pytest.mark.asyncio
async def test_700_requests_of_the_issue_leave_nothing_in_flight(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # Before: each got 500 (OverflowError) and left its request in flight; with a small queue the
    # server soon answered every request 503, for good.
    async with served_app(env, monkeypatch, max_num_seqs=4, max_waiting_requests=4) as (client, app):
        async with asgi(app) as http:
            for _ in range(700):
                reply = await http.post("/v1/completions", json={**COMPLETION, "seed": TOP, "n": 2})
                assert reply.status_code == 400, reply.text
            served = await http.post("/v1/completions", json={**COMPLETION, "seed": 7, "n": 2})
            assert served.status_code == 200, served.text
            assert len(served.json()["choices"]) == 2
        assert client.num_unfinished == 0 and client.frontend.num_unfinished == 0


class _FailingSends:
    """The transport's send, failing for every ``every``-th AddRequest (after the first child is out)."""

    def __init__(self, send: Any, every: int = 2) -> None:
        self.send, self.every, self.adds = send, every, 0

    def __call__(self, destination: str, message: Any) -> None:
        if isinstance(message, AddRequest):
            self.adds += 1
            if self.adds % self.every == 0:
                raise RuntimeError("injected send failure\nwith a second line")
        self.send(destination, message)


@pytest.mark.asyncio
async def test_a_failure_part_way_through_submitting_releases_everything(
    env: Env, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    async with served_app(env, monkeypatch, max_num_seqs=4, max_waiting_requests=4) as (client, app):
        monkeypatch.setattr(client.transport, "send", _FailingSends(client.transport.send))
        async with asgi(app) as http:
            bodies = [("/v1/completions", {**COMPLETION, "n": 2, "max_tokens": 50}),  # the 2nd child fails
                      ("/v1/completions", {**COMPLETION, "prompt": ["a b", "c d"], "max_tokens": 50}),  # 2nd prompt
                      ("/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 50, "stream": True})]
            for index in range(700):
                path, body = bodies[index % len(bodies)]
                reply = await http.post(path, json=body)
                assert reply.status_code == 500, reply.text
                assert reply.json()["error"]["type"] == "InternalServerError"
            assert client.num_unfinished == 0 and client.frontend.num_unfinished == 0
            # What reached the scheduler was aborted there too.
            await wait_until_async(lambda: not env.scheduler.requests)
            monkeypatch.undo()  # sends work again (and the store stubs go: not needed below)
            served = await http.post("/v1/completions", json={**COMPLETION, "n": 2})
            assert served.status_code == 200, served.text
        assert client.num_unfinished == 0 and client.frontend.num_unfinished == 0


class _Stream:
    def __init__(self) -> None:
        self.request_id, self.reasons = "s", []  # type: ignore[var-annotated]

    def abort(self, reason: str = "abort") -> None:
        self.reasons.append(reason)


@pytest.mark.asyncio
async def test_a_stream_whose_body_never_started_is_aborted() -> None:
    # A client gone before the first byte: the body generator is closed before its first step, so
    # its own finally (which aborts) never runs; the response aborts the streams itself.
    async def body() -> Any:
        yield b"data: never\n\n"

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        await asyncio.Event().wait()  # the response never gets out

    stream = _Stream()
    response = EventStreamResponse(body(), [stream])  # type: ignore[list-item]
    await response({"type": "http", "method": "POST", "path": "/", "headers": []}, receive, send)
    assert stream.reasons == ["disconnect"]
