"""Health and recovery at the HTTP edge: the verdicts from the actors' states, ``/health`` following
the group's state (not the bus), requests waiting through a scheduler restart, streams ending in an
error and new requests refused with 503 once the group failed; serve's supervision flags. The app
runs over an AsyncEngineClient and a fake scheduler on a real socket (no processes, no model)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import pytest_asyncio

from tests.support.fake_env import PROMPTS, FakeBus
from tests.support.fake_scheduler import Env, FakeGroup, expected_tokens, wait_until_async
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.supervision import Health, SupervisionView, classify, group_states
from vllm_actors.protocol.events import ActorFailed, ActorRestarted, ActorStopped, EventBatch, GroupFailed, Heartbeat
from vllm_actors.protocol.names import SCHEDULER, SUPERVISOR
from vllm_actors.server import build_app


# =========================================================================== health verdicts
def test_health_verdicts_and_the_supervision_view() -> None:
    ready = dict.fromkeys(FakeGroup.ACTORS, "ready")
    assert classify(ready) == Health("ok")
    assert classify({**ready, "metrics": "restarting"}) == Health("degraded", {}, {"metrics": "restarting"})
    verdict = classify({**ready, "bus": "restarting", "worker-0": "restarting"})
    assert verdict.status == "unavailable" and verdict.unhealthy == {"worker-0": "restarting"}
    assert verdict.degraded == {"bus": "restarting"} and not verdict.serving
    assert classify(ready, failure="budget").unhealthy == {"group": "failed: budget"}

    group = FakeGroup()
    group.processes["kv_cache_manager"] = False  # exited; the supervisor has not noticed yet
    assert group_states(group)["kv_cache_manager"] == "exited"

    view = SupervisionView()
    batch = EventBatch(actor=SUPERVISOR, first_seq=0, mono=0.0, wall=0.0,
                       events=[ActorFailed(actor=SCHEDULER, how="hung", detail="silent for 5.0 s")])
    assert view.on_batch(SUPERVISOR, batch) == ([], None) and view.down[SCHEDULER].startswith("restarting")
    forged = EventBatch(actor="worker-0", first_seq=0, mono=0.0, wall=0.0,
                        events=[ActorRestarted(actor=SCHEDULER, pid=1, attempt=1, seconds=1.0),
                                GroupFailed(reason="x")])
    assert view.on_batch(SUPERVISOR, forged) == ([], None) and view.on_batch("worker-0", forged) == ([], None)
    genuine = EventBatch(actor=SUPERVISOR, first_seq=1, mono=0.0, wall=0.0,
                         events=[ActorRestarted(actor=SCHEDULER, pid=1, attempt=1, seconds=1.0)])
    assert view.on_batch(SUPERVISOR, genuine) == ([SCHEDULER], None) and view.down == {}


# =========================================================================== the HTTP server
def asgi(app) -> httpx.AsyncClient:  # noqa: ANN001
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app", timeout=30)


@pytest_asyncio.fixture
async def served(env: Env, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    client = AsyncEngineClient(env.info, env.tokenizer, group=env.group, load_tokenizer=False)

    async def store_reachable(timeout: float) -> dict[str, str]:
        return {}  # no metrics store here: the bus round trip would time out

    monkeypatch.setattr(client._health, "store_reachable", store_reachable)
    try:
        yield client, build_app(client, served_model_names=["fake"])
    finally:
        await client.shutdown()


@pytest.mark.asyncio
async def test_health_follows_the_groups_state_not_the_bus(env: Env, served) -> None:  # noqa: ANN001
    client, app = served
    async with asgi(app) as http:
        reply = await http.get("/health")
        assert reply.status_code == 200 and reply.content == b""
        # A forged STOPPED on the bus cannot reach the verdict: an owned group's state is the supervisor's.
        bus = FakeBus(env.info.addresses.bus_out)
        bus.publish(SCHEDULER, [ActorStopped(reason="forged"), Heartbeat(pid=1)])
        bus.close()
        assert (await http.get("/health")).status_code == 200

        env.group.states["metrics"] = "restarting"
        reply = await http.get("/health")
        assert reply.status_code == 200
        assert reply.json() == {"status": "degraded", "degraded": {"metrics": "restarting"}}

        env.group.states["kv_cache_manager"] = "restarting"
        reply = await http.get("/health")
        body = reply.json()
        assert reply.status_code == 503 and body["status"] == "unavailable"
        assert body["unhealthy"] == {"kv_cache_manager": "restarting"} and body["degraded"] == {"metrics": "restarting"}
        assert "kv_cache_manager" in body["error"]["message"] and body["error"]["code"] == 503

        env.group.states.update(kv_cache_manager="ready", metrics="ready")
        env.group.processes["worker-0"] = False  # exited, not noticed yet
        reply = await http.get("/health")
        assert reply.status_code == 503 and reply.json()["unhealthy"] == {"worker-0": "exited"}
        env.group.processes["worker-0"] = True
        assert (await http.get("/health")).status_code == 200


@pytest.mark.asyncio
async def test_requests_wait_through_a_restart(env: Env, served) -> None:  # noqa: ANN001
    client, app = served
    async with asgi(app) as http:
        env.scheduler.crash()
        env.group.states[SCHEDULER] = "restarting"
        assert (await http.get("/health")).json()["unhealthy"] == {SCHEDULER: "restarting"}
        request = asyncio.create_task(http.post("/v1/completions", json={
            "model": "fake", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}))
        await wait_until_async(lambda: client.num_unfinished == 1)  # taken, not refused
        await asyncio.sleep(0.05)
        env.scheduler.restart()
        await asyncio.to_thread(env.group.restart, SCHEDULER)
        reply = await asyncio.wait_for(request, 20)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["text"] == env.tokenizer.decode(
            expected_tokens(PROMPTS[0], 12))


def sse_payloads(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.asyncio
async def test_a_failed_group_ends_streams_with_an_error_and_refuses_requests(
    env: Env, served, path: str,  # noqa: ANN001
) -> None:
    client, app = served
    body: dict[str, object] = {"model": "fake", "max_tokens": 200, "temperature": 0, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = PROMPTS[0]
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    async with asgi(app) as http:
        stream = asyncio.create_task(http.post(path, json=body))
        plain = asyncio.create_task(http.post(path, json={**body, "stream": False}))
        await wait_until_async(lambda: len(env.scheduler.requests) == 2
                               and all(r.outputs for r in env.scheduler.requests.values()))
        await asyncio.to_thread(env.group.fail, "actor worker-0: 6 restarts within 60 s")
        streamed, in_flight = await asyncio.wait_for(stream, 10), await asyncio.wait_for(plain, 10)

        payloads = sse_payloads(streamed.text)
        assert streamed.status_code == 200 and payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["code"] == 503 and "6 restarts within 60 s" in error["message"]
        chunks = [json.loads(p) for p in payloads[:-2]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "error"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])

        assert in_flight.status_code == 503
        assert "6 restarts within 60 s" in in_flight.json()["error"]["message"]
        assert in_flight.json()["error"]["type"] == "ServiceUnavailableError"

        start = time.monotonic()
        refused = await http.post(path, json=body)
        assert refused.status_code == 503 and "The engine failed" in refused.json()["error"]["message"]
        assert time.monotonic() - start < 1.0
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert health.json()["unhealthy"] == {"group": "failed: actor worker-0: 6 restarts within 60 s"}


def test_serve_supervision_flags_reach_the_process_group() -> None:
    from vllm_actors.cli import build_parser
    from vllm_actors.server.args import supervision_kwargs

    parser = build_parser()
    assert supervision_kwargs(parser.parse_args(["serve", "some/model"])) == {}  # the supervisor's defaults
    args = parser.parse_args(["serve", "some/model", "--max-restarts", "0", "--restart-window", "30",
                              "--liveness-timeout", "2.5", "--max-busy-seconds", "600"])
    assert supervision_kwargs(args) == {"max_restarts": 0, "restart_window": 30.0, "liveness_timeout": 2.5,
                                        "max_busy_seconds": 600.0}
    with pytest.raises(ValueError, match="--liveness-timeout must be > 0"):
        supervision_kwargs(parser.parse_args(["serve", "m", "--liveness-timeout", "0"]))
