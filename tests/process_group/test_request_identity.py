"""Request identity and validation at the socket edge: request-id rules in one place
(``protocol/names.py``), applied by the frontend and again by the scheduler; every AddRequest from
the scheduler's socket checked before it touches state (token ids against the vocabulary, lengths,
sampling values); each client connection owns its request ids (``actors/scheduler/owners.py``).
Unit tests of the rules and the state machines, then raw-socket peers against a real group on the
tiny model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from tests.support.outputs import pairs
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.cumulative import CumulativeOutputs
from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import Aborted, Queued
from vllm_actors.protocol.messages import AbortRequests, AddRequest, RequestUpdate, RequestUpdates, StepPlan
from vllm_actors.protocol.names import (
    CLIENT,
    FRONTEND,
    MAX_REQUEST_ID_LENGTH,
    engine_request_id_error,
    request_id_error,
)
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.server import build_app

VOCAB = 97


# --------------------------------------------------------------------------- the id rules
@pytest.mark.parametrize("request_id", ["r", "cmpl-3f2a", "chatcmpl-0a1B.2_c~d:e", "a" * MAX_REQUEST_ID_LENGTH])
def test_good_request_ids(request_id: str) -> None:
    assert request_id_error(request_id) is None
    assert engine_request_id_error(request_id) is None
    assert engine_request_id_error(f"{request_id}#0") is None and engine_request_id_error(f"{request_id}#17") is None


@pytest.mark.parametrize(
    ("request_id", "why"),
    [
        ("", "must not be empty"),
        ("y#1", "may hold only"),  # '#' separates an n>1 request's children
        ("a b", "may hold only"),
        ("a\nb", "may hold only"),
        ("é", "may hold only"),
        ("a" * (MAX_REQUEST_ID_LENGTH + 1), "at most 128 characters"),
        ("x" * 60_000, "got 60000"),
    ],
)
def test_bad_request_ids(request_id: str, why: str) -> None:
    error = request_id_error(request_id)
    assert error is not None and why in error
    assert len(error) < 300  # a 60 KB id is never copied into the error
    assert engine_request_id_error(request_id if "#" not in request_id else "y#a") is not None


def test_engine_ids_take_one_numeric_child_index() -> None:
    for bad in ("y#", "y#a", "y#1#2", "#1", "y#1234567890", "a b#1"):
        assert engine_request_id_error(bad) is not None, bad


# --------------------------------------------------------------------------- the frontend
def frontend() -> Frontend:
    return Frontend(None, [0], max_model_len=64, vocab_size=VOCAB)


def only_output(cumulative: CumulativeOutputs, out: Outputs) -> RequestOutput:
    """The one thing the frontend produced, a delta for its client, assembled as the client does."""
    assert len(out.messages) == 1 and not out.events, out
    (output,) = cumulative.add_all(out.to(CLIENT))
    return output


def test_the_frontend_refuses_bad_ids_before_anything_is_queued() -> None:
    front = frontend()
    for bad in ("y#1", "x" * 10_000, "", "a b"):
        with pytest.raises(ValueError, match="^request_id"):
            front.prepare(bad, {"prompt_token_ids": [1, 2]}, SamplingParams())
    assert front.num_unfinished == 0


def test_the_frontend_takes_each_token_once_by_its_position() -> None:
    """Updates that carry their output position (``output_index``): a catch-up overlapping the
    tokens a request has already gives only the new ones."""
    front, cumulative = frontend(), CumulativeOutputs()
    front.submit(front.prepare("p", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=8)))
    for tokens, index in (([5, 6], 0), ([6, 7], 1), ([5, 6, 7, 8], 0), ([9], -1)):
        cumulative.add_all(front.handle(RequestUpdates(step_id=0, updates=[
            RequestUpdate(request_id="p", new_token_ids=tokens, output_index=index)])).to(CLIENT))
    output = only_output(cumulative, front.handle(RequestUpdates(step_id=0, updates=[
        RequestUpdate(request_id="p", new_token_ids=[10], output_index=5, finish_reason="length")])))
    assert output.outputs[0].token_ids == [5, 6, 7, 8, 9, 10]


def test_a_child_id_is_never_taken_by_another_request() -> None:
    """The finding: ``y#1`` while ``y`` with n=2 runs took over y's second child, which then hung."""
    front = frontend()
    sent = front.submit(front.prepare("y", {"prompt_token_ids": [1, 2]}, SamplingParams(n=2, max_tokens=4)))
    assert [m.request_id for _, m in sent.messages if isinstance(m, AddRequest)] == ["y#0", "y#1"]
    with pytest.raises(ValueError, match="^request_id"):
        front.prepare("y#1", {"prompt_token_ids": [3]}, SamplingParams())
    # y's second child still gets its tokens and finishes
    out = front.handle(RequestUpdates(step_id=0, updates=[
        RequestUpdate(request_id="y#0", new_token_ids=[5], finish_reason="length"),
        RequestUpdate(request_id="y#1", new_token_ids=[6], finish_reason="length"),
    ]))
    output = only_output(CumulativeOutputs(), out)
    assert output.finished and [c.token_ids for c in output.outputs] == [[5], [6]]
    assert front.num_unfinished == 0


# --------------------------------------------------------------------------- the scheduler
def scheduler(vocab_size: int | None = VOCAB) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                                     enable_chunked_prefill=True, block_size=4, num_blocks=100,
                                     vocab_size=vocab_size))


def add(request_id: str, prompt: list[int], eos: list[int] | None = None, **params: Any) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=prompt, eos_token_ids=[0] if eos is None else eos,
                      params=SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}))


def with_seed(message: AddRequest, seed: int) -> AddRequest:
    """A seed set after construction (as in process; over the wire decoding refuses it already)."""
    message.params.seed = seed
    return message


def only_error(out: Outputs) -> str:
    updates = [u for d, m in pairs(out) if d == FRONTEND and isinstance(m, RequestUpdates) for u in m.updates]
    assert len(updates) == 1 and updates[0].finish_reason == "error", out
    assert not [m for _, m in pairs(out) if isinstance(m, Queued) or (isinstance(m, StepPlan) and m.req_ids)], out
    return updates[0].error or ""


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (add("a", [1, VOCAB]), f"prompt token ids must lie in [0, {VOCAB - 1}]"),
        (add("a", [1, 100_000]), "prompt token ids must lie in"),
        (add("a", [1, -1]), "prompt token ids must lie in"),
        (add("a", [1], eos=[-(10**12)]), "eos_token_ids must lie in"),  # the sampler indexes with these
        (add("a", [1], eos=[VOCAB]), "eos_token_ids must lie in"),
        (add("a", [1] * 65), "more than max_model_len (64)"),
        (add("a", []), "the prompt is empty"),
        (with_seed(add("a", [1]), 2**63), "seed must be <= 9223372036854775807"),
        (add("a#x", [1]), "a child's index"),
        (add("x" * 1000, [1]), "at most 128 characters"),
    ],
)
def test_the_scheduler_refuses_what_its_socket_may_bring(message: AddRequest, error: str) -> None:
    s = scheduler()
    out = s.handle(message)
    assert error in only_error(out)
    assert not s.requests and not s.waiting and not s.running


def test_sampling_values_are_checked_again() -> None:
    """A field set after construction skipped SamplingParams' checks: the scheduler runs them."""
    bad = add("a", [1, 2])
    bad.params.top_p = 7.0
    assert "top_p" in only_error(scheduler().handle(bad))


def test_without_a_known_vocabulary_ids_are_checked_against_int32() -> None:
    s = scheduler(vocab_size=None)
    assert "must lie in [0, 2147483647]" in only_error(s.handle(add("a", [2**31])))
    assert s.handle(add("b", [100_000]))  # planned


def test_a_refused_duplicate_leaves_no_event_in_the_holders_timeline() -> None:
    s = scheduler()
    s.handle(add("a", [1, 2, 3]))
    out = s.handle(add("a", [4, 5]))
    (update,) = [u for d, m in pairs(out) if d == FRONTEND and isinstance(m, RequestUpdates) for u in m.updates]
    assert update.finish_reason == "error" and "already in use" in (update.error or "")
    assert not [e for _, e in pairs(out) if isinstance(e, (Aborted, Queued))]
    assert s.requests["a"].prompt_token_ids == [1, 2, 3]
    # a refusal of a fresh, well-formed id does say why in its own timeline
    out = s.handle(add("b", [1, VOCAB]))
    assert [e.request_id for _, e in pairs(out) if isinstance(e, Aborted)] == ["b"]


def test_a_long_abort_reason_is_cut_before_it_reaches_the_bus() -> None:
    s = scheduler()
    s.handle(add("a", [1, 2, 3]))
    out = s.handle(AbortRequests(request_ids=["a"], reason="x" * 100_000))
    (aborted,) = [e for _, e in pairs(out) if isinstance(e, Aborted)]
    assert len(aborted.reason) <= 64 and not s.requests


# --------------------------------------------------------------------------- ownership, pure
A, B = b"client-a", b"client-b"


def test_ownership_add_abort_and_updates() -> None:
    owners = RequestOwners()
    message, refusal = owners.screen(A, add("r", [1]))
    assert refusal is None and message is not None
    owners.observe(A, message)
    assert owners.owner("r") == A
    # another connection: refused, answered to it alone, the owner unchanged
    for newcomer in (add("r", [2]), msgspec.structs.replace(add("r", [2]), resume=True, output_token_ids=[3])):
        message, refusal = owners.screen(B, newcomer)
        assert message is None and refusal is not None and "another client's request" in refusal.error
        assert refusal.reply is not None and refusal.reply.updates[0].finish_reason == "error"
    # the owner itself: a resubmission passes, a plain duplicate does not
    assert owners.screen(A, msgspec.structs.replace(add("r", [1]), resume=True))[1] is None
    assert owners.screen(A, add("r", [1]))[1] is not None
    # aborts: only the sender's own ids go on; unknown ids quietly left out
    owners.observe(B, owners.screen(B, add("s", [1]))[0])
    message, refusal = owners.screen(B, AbortRequests(request_ids=["r", "s", "gone"], reason="abort"))
    assert message == AbortRequests(request_ids=["s"], reason="abort")
    assert refusal is not None and "'r'" in refusal.error and refusal.reply is None
    message, refusal = owners.screen(B, AbortRequests(request_ids=["r"]))
    assert message is None and refusal is not None
    assert owners.screen(A, AbortRequests(request_ids=["r", "gone"])) == (AbortRequests(request_ids=["r"]), None)
    # updates go to their owner; a finished request is forgotten
    split = owners.split(RequestUpdates(step_id=1, updates=[RequestUpdate(request_id="r", new_token_ids=[1]),
                                                            RequestUpdate(request_id="s", finish_reason="stop")],
                                        step_finished_at=5.0, sent_at=6.0))
    assert {owner: [u.request_id for u in m.updates] for owner, m in split.items()} == {A: ["r"], B: ["s"]}
    assert all((m.step_finished_at, m.sent_at) == (5.0, 6.0) for m in split.values())  # the stamps go along
    assert owners.owner("s") is None and owners.owner("r") == A


def test_ownership_is_taken_again_by_the_resubmission_after_a_restart() -> None:
    """A restarted scheduler's shell starts empty: each client's resubmission makes it the owner."""
    owners = RequestOwners()
    resume = msgspec.structs.replace(add("r", [1]), resume=True, output_token_ids=[4])
    message, refusal = owners.screen(A, resume)
    assert refusal is None
    owners.observe(A, message)
    assert owners.screen(B, resume)[1] is not None
    assert owners.screen(B, AbortRequests(request_ids=["r"]))[0] is None


def test_an_abort_of_all_of_the_senders_requests_takes_its_own_only() -> None:
    """A client restarted under a dead one's routing id drops what that one left (an API process
    of --api-server-count): every id the connection owns, none of another's."""
    owners = RequestOwners()
    for sender, request_id in ((A, "a1"), (A, "a2"), (B, "b1")):
        owners.observe(sender, owners.screen(sender, add(request_id, [1]))[0])
    message, refusal = owners.screen(A, AbortRequests(request_ids=[], reason="client restarted", all_of_sender=True))
    assert refusal is None
    assert message == AbortRequests(request_ids=["a1", "a2"], reason="client restarted")
    owners.observe(A, message)
    assert owners.owner("a1") is None and owners.owner("b1") == B
    assert owners.screen(A, AbortRequests(request_ids=[], all_of_sender=True)) == (None, None)  # nothing left


# --------------------------------------------------------------------------- over real sockets
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


def test_the_shells_stamp_departures_once() -> None:
    """A worker's result and a scheduler's updates get the sending shell's monotonic time; a
    controller forwarding a replica's updates keeps the replica's stamp."""
    from vllm_actors.protocol.messages import StepResult
    from vllm_actors.runtime.loop import stamp_departure

    result = StepResult(step_id=0, req_ids=[], token_ids=[])
    before = time.monotonic()
    stamp_departure(result)
    assert before <= result.finished_at <= time.monotonic()
    updates = RequestUpdates(step_id=0, updates=[], step_finished_at=result.finished_at)
    stamp_departure(updates)
    sent = updates.sent_at
    assert sent >= result.finished_at
    stamp_departure(updates)  # forwarded: unchanged
    assert updates.sent_at == sent
