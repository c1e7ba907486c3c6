"""Request identity at the socket edge, against a real group on the tiny model: raw-socket peers
(another connection than the client's) get their malformed, out-of-vocabulary or foreign requests
refused, their aborts of another's requests ignored, and disturb nobody; any X-Request-Id is served.
The rules and the state machines alone: state_machines/test_request_ids.py and test_request_owners.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from tests.state_machines.test_request_ids import add
from vllm_actors import SamplingParams
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.messages import AbortRequests, AddRequest, RequestUpdates
from vllm_actors.server import build_app

pytestmark_sockets = pytest.mark.asyncio(loop_scope="module")
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
REPLY_TIMEOUT = 60.0  # seconds; only ever reached when the behaviour is wrong


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_qwen3: Path) -> AsyncIterator[AsyncEngineClient]:
    engine = await AsyncEngineClient.start(str(tiny_qwen3), dtype="float32", max_model_len=256,
                                           num_gpu_blocks_override=256, check_invariants=True)
    try:
        yield engine
    finally:
        await engine.shutdown()
    assert engine.group is not None and not any(engine.group.alive().values())


class RawPeer:
    """A process that reached the scheduler's socket: one DEALER, messages encoded by hand."""

    def __init__(self, address: str, identity: bytes = b"intruder") -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.codec = MessageCodec()

    async def send(self, message: Any) -> None:
        await self.socket.send(self.codec.encode(message))

    async def reply(self) -> RequestUpdates:
        assert await self.socket.poll(int(REPLY_TIMEOUT * 1000)), "no reply from the scheduler"
        message = self.codec.decode(await self.socket.recv())
        assert isinstance(message, RequestUpdates)
        return message

    async def refused(self, message: AddRequest) -> str:
        """Send ``message`` and return the error it is answered with."""
        await self.send(message)
        reply = await self.reply()
        (update,) = reply.updates
        assert update.request_id == message.request_id and update.finish_reason == "error", reply
        return update.error or ""

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest_asyncio.fixture(loop_scope="module")
async def intruder(client: AsyncEngineClient) -> AsyncIterator[RawPeer]:
    peer = RawPeer(client.info.addresses.scheduler)
    try:
        yield peer
    finally:
        peer.close()


async def first_output_then_rest(client: AsyncEngineClient, request_id: str) -> tuple[Any, asyncio.Task[Any]]:
    """Start a long greedy request; return once its first tokens are out, with a task for its end."""
    stream = client.generate("Tell me a story", LONG, request_id=request_id)
    first = await asyncio.wait_for(anext(stream), REPLY_TIMEOUT)

    async def rest() -> Any:
        last = first
        async for output in stream:
            last = output
        return last

    return first, asyncio.create_task(asyncio.wait_for(rest(), REPLY_TIMEOUT))


def finished_whole(output: Any) -> None:
    assert output.finished and output.error is None, output
    (completion,) = output.outputs
    assert completion.finish_reason == "length" and len(completion.token_ids) == LONG.max_tokens


@pytestmark_sockets
async def test_an_out_of_vocabulary_token_is_refused_and_the_engine_keeps_serving(
    client: AsyncEngineClient, intruder: RawPeer
) -> None:
    vocab = client.vocab_size
    error = await intruder.refused(add("oov", [1, 100_000]))
    assert f"must lie in [0, {vocab - 1}]" in error
    error = await intruder.refused(add("oov2", [1, 2], eos=[-(10**12)]))
    assert "eos_token_ids" in error
    outputs = [o async for o in client.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True))]
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4


@pytestmark_sockets
async def test_a_duplicate_id_from_another_connection_is_refused_for_the_newcomer_only(
    client: AsyncEngineClient, intruder: RawPeer
) -> None:
    first, rest = await first_output_then_rest(client, "victim-dup")
    error = await intruder.refused(add("victim-dup", [1, 2, 3]))
    assert "already in use" in error
    assert not rest.done(), "the victim finished before the intruder's request was handled"
    finished_whole(await rest)  # before: the victim's stream hung (its updates went to the intruder)
    assert "another client's request" in error


@pytestmark_sockets
async def test_a_resubmission_of_another_connections_id_is_refused(client: AsyncEngineClient,
                                                                   intruder: RawPeer) -> None:
    first, rest = await first_output_then_rest(client, "victim-resume")
    resume = msgspec.structs.replace(add("victim-resume", [1, 2, 3]), resume=True, output_token_ids=[5])
    assert "another client's request" in await intruder.refused(resume)  # nor extend it
    assert not rest.done(), "the victim finished before the intruder's request was handled"
    finished_whole(await rest)


@pytestmark_sockets
async def test_an_abort_of_another_connections_request_is_ignored(client: AsyncEngineClient,
                                                                  intruder: RawPeer) -> None:
    first, rest = await first_output_then_rest(client, "victim-abort")
    await intruder.send(AbortRequests(request_ids=["victim-abort"], reason="abort"))
    # One connection's messages are handled in order: once this is answered, the abort was seen.
    await intruder.refused(add("probe", []))
    assert not rest.done(), "the victim finished before the intruder's abort was handled"
    finished_whole(await rest)


@pytestmark_sockets
async def test_http_ids_with_a_hash_or_too_long_are_served_and_disturb_nobody(client: AsyncEngineClient) -> None:
    """vLLM takes any X-Request-Id: one that is no valid engine id (a '#', 10 KB, 60 KB) is served under
    an id derived from it, quoted back as sent, and never taken for another request's child."""
    app = build_app(client)
    body = {"model": client.model, "messages": [{"role": "user", "content": "Tell me a story"}],
            "n": 2, "max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app",
                                 timeout=REPLY_TIMEOUT) as http:
        running = asyncio.create_task(http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "y"}))
        while client.num_unfinished == 0:  # y's children are on their way to the scheduler, ahead of the rest
            assert not running.done(), running.result().text
            await asyncio.sleep(0.01)
        small = {**body, "n": 1, "max_tokens": 2}
        for header in ("y#1", "x" * 10_000, "x" * 60_000):
            response = await http.post("/v1/chat/completions", json=small, headers={"X-Request-Id": header})
            assert response.status_code == 200, response.text[:300]
            assert response.json()["id"] == f"chatcmpl-{header}"
        assert not running.done(), "y finished before the other ids were tried"
        response = await asyncio.wait_for(running, REPLY_TIMEOUT)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert client.num_unfinished == 0


@pytestmark_sockets
async def test_long_or_malformed_ids_from_the_socket_are_refused(client: AsyncEngineClient,
                                                                 intruder: RawPeer) -> None:
    for bad in ("x" * 60_000, "a b", "y#z", ""):
        error = await intruder.refused(add(bad, [1, 2]))
        assert error.startswith("request_id") and len(error) < 300, error
    outputs = [o async for o in client.generate("Hello", SamplingParams(temperature=0.0, max_tokens=2))]
    assert outputs[-1].finished

