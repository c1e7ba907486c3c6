"""The Responses API's store and background mode through the real app over a fake scheduler (held
mid-generation, so nothing races): a background response is queued, then in progress, then
finished or cancelled (its engine request aborted); a background stream's events are replayed
from any sequence number while it runs and after; the store keeps the most recently used
responses up to VLLM_ACTORS_RESPONSES_STORE_SIZE; with size 0 nothing is kept and background is
refused. And the hooks a reasoning parser feeds: a chat message's ``reasoning`` becomes a reasoning
item, and streamed reasoning deltas their own events; a reasoning item sent back in ``input``
becomes an assistant turn whose reasoning the chat template sees."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.support.fake_served import Env, asgi, env, served_app, tokenizer, wait_until_async  # noqa: F401
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.server.chat import conversation
from vllm_actors.server.errors import OpenAIError
from vllm_actors.server.protocol import ChatMessage
from vllm_actors.server.responses_items import Shell, output_items
from vllm_actors.server.responses_protocol import ResponsesRequest, input_messages
from vllm_actors.server.responses_stream import ResponseEvents

BODY = {"model": "fake", "input": "Hello", "max_output_tokens": 6}


async def _status(http: httpx.AsyncClient, response_id: str) -> str:
    reply = await http.get(f"/v1/responses/{response_id}")
    assert reply.status_code == 200, reply.text
    return str(reply.json()["status"])


@pytest.mark.asyncio
async def test_a_background_response_runs_to_its_end_or_is_cancelled(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    env.scheduler.hold_at(2)
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        reply = await http.post("/v1/responses", json={**BODY, "background": True})
        assert reply.status_code == 200 and reply.json()["status"] == "queued", reply.text
        first = reply.json()["id"]
        await wait_until_async(lambda: env.scheduler.progress(first) == 2)
        # the background task stores "in_progress" when it first runs, which may come after the scheduler's
        # progress; held at 2 tokens, the request cannot get past it
        for _ in range(500):
            if await _status(http, first) != "queued":
                break
            await asyncio.sleep(0.02)
        assert await _status(http, first) == "in_progress"

        cancelled = await http.post(f"/v1/responses/{first}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        await wait_until_async(lambda: first not in env.scheduler.requests)  # the engine request is aborted
        assert await _status(http, first) == "cancelled"
        again = await http.post(f"/v1/responses/{first}/cancel")
        assert again.status_code == 400 and again.json()["error"]["message"] == "Cannot cancel a synchronous response."

        second = (await http.post("/v1/responses", json={**BODY, "background": True})).json()["id"]
        env.scheduler.release()
        for _ in range(500):
            if await _status(http, second) not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.02)
        finished = (await http.get(f"/v1/responses/{second}")).json()
        assert finished["status"] == "incomplete" and finished["usage"]["output_tokens"] == 6  # the fake stops at max
        assert finished["output"][0]["content"][0]["text"]


def _events(reply: httpx.Response) -> list[dict[str, Any]]:
    """The SSE body's events (their ``data:`` payloads), checking each ``event:`` line names its type."""
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream"), reply.text
    events = []
    for block in reply.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {events[-1]['type']}"
    return events


@pytest.mark.asyncio
async def test_a_background_stream_is_replayed_from_any_sequence_number(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    env.scheduler.hold_at(2)
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        body = {**BODY, "background": True, "stream": True, "request_id": "resp_bg"}
        created = asyncio.create_task(http.post("/v1/responses", json=body))
        await wait_until_async(lambda: env.scheduler.progress("resp_bg") == 2)
        assert await _status(http, "resp_bg") == "in_progress"
        follower = asyncio.create_task(http.get("/v1/responses/resp_bg", params={"stream": "true",
                                                                                 "starting_after": "1"}))
        await asyncio.sleep(0.05)
        assert not created.done() and not follower.done()  # both follow the live events
        env.scheduler.release()
        events = _events(await created)
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["id"] == "resp_bg"
        assert _events(await follower) == events[2:]
        again = await http.get("/v1/responses/resp_bg", params={"stream": "true", "starting_after": "4"})
        assert _events(again) == events[5:]  # a finished response's events replayed
        stored = (await http.get("/v1/responses/resp_bg")).json()
        assert stored == events[-1]["response"] and stored["background"] is True

        plain = (await http.post("/v1/responses", json=BODY)).json()["id"]
        refused = await http.get(f"/v1/responses/{plain}", params={"stream": "true"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_id"
        assert refused.json()["error"]["message"].startswith(f"Unknown response_id: {plain}")
        negative = await http.get("/v1/responses/resp_bg", params={"stream": "true", "starting_after": "-2"})
        assert negative.status_code == 400 and negative.json()["error"]["param"] == "starting_after"


@pytest.mark.asyncio
async def test_cancelling_a_background_stream_ends_its_readers(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    env.scheduler.hold_at(2)
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        body = {**BODY, "background": True, "stream": True, "request_id": "resp_cancel"}
        created = asyncio.create_task(http.post("/v1/responses", json=body))
        await wait_until_async(lambda: env.scheduler.progress("resp_cancel") == 2)
        cancelled = await http.post("/v1/responses/resp_cancel/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        events = _events(await asyncio.wait_for(created, 10))
        assert events[0]["type"] == "response.created"
        assert "response.completed" not in [event["type"] for event in events]
        await wait_until_async(lambda: "resp_cancel" not in env.scheduler.requests)  # the engine request is aborted
        assert await _status(http, "resp_cancel") == "cancelled"
        env.scheduler.release()


@pytest.mark.asyncio
async def test_the_store_keeps_the_most_recently_used(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("VLLM_ACTORS_RESPONSES_STORE_SIZE", "2")
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        ids = [(await http.post("/v1/responses", json=BODY)).json()["id"] for _ in range(3)]
        assert (await http.get(f"/v1/responses/{ids[0]}")).status_code == 404
        assert await _status(http, ids[1]) == "incomplete"  # used: now the most recent
        ids.append((await http.post("/v1/responses", json=BODY)).json()["id"])
        assert (await http.get(f"/v1/responses/{ids[2]}")).status_code == 404
        assert [await _status(http, i) for i in (ids[1], ids[3])] == ["incomplete", "incomplete"]
        assert len(app.state.responses) == 2


@pytest.mark.asyncio
async def test_a_store_of_size_0_keeps_nothing(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("VLLM_ACTORS_RESPONSES_STORE_SIZE", "0")
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        reply = await http.post("/v1/responses", json=BODY)
        assert reply.status_code == 200
        assert (await http.get(f"/v1/responses/{reply.json()['id']}")).status_code == 404
        refused = await http.post("/v1/responses", json={**BODY, "background": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"


# --------------------------------------------------------------------------- the reasoning hooks
def _shell() -> Shell:
    params = SamplingParams()
    return Shell("resp_x", 0, "m", ResponsesRequest(input="hi"), params.temperature, params.top_p, 8)


def test_a_chat_message_with_reasoning_becomes_a_reasoning_item_first() -> None:
    items = output_items({"role": "assistant", "content": "42", "reasoning": "6 times 7",
                          "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]})
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "6 times 7"}]
    assert items[2]["call_id"] == "c1"


def test_streamed_reasoning_then_text_are_two_items_each_closed_before_the_next() -> None:
    builder = ResponseEvents(_shell())
    events: list[dict[str, Any]] = builder.start()
    for delta in ({"reasoning": "think"}, {"reasoning": "ing"}, {"content": "an"}, {"content": "swer"}):
        events += builder.feed({"choices": [{"index": 0, "delta": delta}]})
    events += builder.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    closing, response = builder.finish()
    kinds = [event["type"] for event in events + closing]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.reasoning_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["output"][0]["content"][0]["text"] == "thinking"
    assert response["output"][1]["content"][0]["text"] == "answer"
    assert response["status"] == "completed" and response["usage"]["output_tokens"] == 4


def test_reasoning_items_in_input_become_assistant_turns_the_template_sees() -> None:
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "6 times 7"}]}
    summarised = {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "short"}]}
    messages = input_messages([{"role": "user", "content": "q"}, thought, summarised,
                               {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                     "text": "42"}]}])
    assert messages[1:] == [{"role": "assistant", "content": "", "reasoning": "6 times 7"},
                            {"role": "assistant", "content": "", "reasoning": "short"},
                            {"role": "assistant", "content": "42"}]
    with pytest.raises(OpenAIError, match="^Encrypted content is not supported.$"):
        input_messages([{**thought, "encrypted_content": "gAAAA"}])
    # the chat path hands an assistant turn's reasoning to the template under both names (vLLM's)
    chat = conversation([ChatMessage(role="user", content="q", reasoning="ignored"),
                         ChatMessage(role="assistant", content="42", reasoning="6 times 7"),
                         ChatMessage(role="assistant", content="", reasoning_content="older name")])
    assert chat == [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "42", "reasoning": "6 times 7", "reasoning_content": "6 times 7"},
                    {"role": "assistant", "content": "", "reasoning": "older name", "reasoning_content": "older name"}]
