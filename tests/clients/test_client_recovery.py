"""Recovery on the client side: after a scheduler restart every client sends its
unfinished requests again (resume=True, with the tokens received so far); when the group fails
every open request ends at once with finish reason "error" and new ones are refused.

Covered without processes (the frontend state machine alone is in state_machines/test_frontend_resubmit.py): the
sync client and ``LLM``, the asyncio client (owning a group, or attached and following the
supervisor's events on the bus) and the HTTP server (``/health``, 503, streams ending in an
error). A fake scheduler on a real ROUTER socket stands in for the scheduler process (its
"crash" loses every request and what arrives while it is down); a fake process group stands in
for the supervisor, calling its listeners from a thread of its own as the monitor thread does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import pytest_asyncio
import zmq

from tests.support.fake_scheduler import (
    MAX_MODEL_LEN,
    Env,
    FakeGroup,
    FakeScheduler,
    expected_tokens,
    wait_until,
    wait_until_async,
)
from tests.support.tiny_models import build_tokenizer
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.core import EngineDeadError
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.clients.supervision import Health, SupervisionView, classify, group_states
from vllm_actors.clients.sync_client import EngineClient
from vllm_actors.llm import LLM
from vllm_actors.protocol.events import (
    ActorFailed,
    ActorRestarted,
    ActorStopped,
    Event,
    EventBatch,
    GroupFailed,
    Heartbeat,
)
from vllm_actors.protocol.names import SCHEDULER, SUPERVISOR
from vllm_actors.runtime.run_dir import GroupInfo, make_addresses
from vllm_actors.server import build_app


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return load_tokenizer(path)



@pytest.fixture
def env(tokenizer: Tokenizer) -> Iterator[Env]:
    run_dir = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # IPC paths must stay short
    addresses = make_addresses(run_dir, 1)
    info = GroupInfo(pid=os.getpid(), run_dir=str(run_dir), model="fake", addresses=addresses,
                     worker={"eos_token_ids": [tokenizer.eos_token_id], "vocab_size": tokenizer.vocab_size},
                     max_model_len=MAX_MODEL_LEN, tokenizer=None)
    scheduler = FakeScheduler(addresses.scheduler)
    try:
        yield Env(scheduler, FakeGroup(), info, tokenizer)
    finally:
        scheduler.close()
        shutil.rmtree(run_dir, ignore_errors=True)


PROMPTS = [[310 + i, 320, 330 + i] for i in range(3)]


# =========================================================================== the sync client and LLM
def test_sync_client_resubmits_after_a_scheduler_restart(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    params = SamplingParams(temperature=0.0, max_tokens=60)
    env.scheduler.hold_at(5)
    try:
        for i, prompt in enumerate(PROMPTS):
            client.submit(client.prepare(f"s{i}", {"prompt_token_ids": prompt}, params))
        finals: dict[str, RequestOutput] = {}
        received: dict[str, int] = {}

        def collect() -> None:
            for output in client.poll(10):
                received[output.request_id] = len(output.outputs[0].token_ids)
                if output.finished:
                    finals[output.request_id] = output

        def collected(condition: Callable[[], bool]) -> Callable[[], bool]:
            def check() -> bool:
                collect()
                return condition()
            return check

        wait_until(collected(lambda: all(received.get(f"s{i}", 0) >= 5 for i in range(3))))
        env.scheduler.crash()
        client.submit(client.prepare("late", {"prompt_token_ids": [340]}, params))  # lost: nobody listens
        env.group.restart("kv_cache_manager")  # another actor: nothing for the clients to do
        collect()
        assert env.scheduler.resumed() == {}
        env.scheduler.release()
        env.scheduler.restart()
        env.group.restart(SCHEDULER)  # READY again: the listener fires on the supervisor's thread
        wait_until(collected(lambda: len(finals) == 4))
        resumed = env.scheduler.resumed()
        assert set(resumed) == {"s0", "s1", "s2", "late"} and resumed["late"] == []
        for i, prompt in enumerate(PROMPTS):
            ids = finals[f"s{i}"].outputs[0].token_ids
            assert ids == expected_tokens(prompt, 60), "a token lost or counted twice"
            assert len(resumed[f"s{i}"]) >= 5 and resumed[f"s{i}"] == ids[: len(resumed[f"s{i}"])]
            assert finals[f"s{i}"].outputs[0].text == env.tokenizer.decode(ids)
        assert finals["late"].outputs[0].token_ids == expected_tokens([340], 60)
    finally:
        client.close()


def offline_llm(client: EngineClient, group: FakeGroup) -> LLM:
    """An LLM over a client of the fake group (its constructor would start real processes)."""
    llm = LLM.__new__(LLM)
    llm._client, llm._group, llm._ids = client, group, itertools.count()  # type: ignore[assignment]
    return llm


def in_background(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def test_llm_generate_returns_complete_outputs_across_a_scheduler_restart(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    llm = offline_llm(client, env.group)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    env.scheduler.hold_at(5)

    def chaos() -> None:
        wait_until(lambda: all(env.scheduler.progress(str(i)) >= 5 for i in range(3)))
        env.scheduler.crash()
        time.sleep(0.1)
        env.scheduler.release()
        env.scheduler.restart()
        env.group.restart(SCHEDULER)

    try:
        thread = in_background(chaos)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=80), use_tqdm=False)
        thread.join()
        assert [o.outputs[0].token_ids for o in outputs] == [expected_tokens(p, 80) for p in PROMPTS]
        assert all(o.finished and o.error is None and o.outputs[0].finish_reason == "length" for o in outputs)
        assert set(env.scheduler.resumed()) == {"0", "1", "2"}
    finally:
        client.close()


def test_llm_raises_the_groups_failure_at_once(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    llm = offline_llm(client, env.group)

    env.scheduler.hold_at(3)

    def chaos() -> None:
        wait_until(lambda: env.scheduler.progress("0") >= 3)
        env.scheduler.crash()
        env.group.fail("actor scheduler: 6 restarts within 60 s")

    try:
        thread = in_background(chaos)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="6 restarts within 60 s"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=200),
                         use_tqdm=False)
        thread.join()
        assert time.monotonic() - start < 5
        assert not client.has_unfinished
        with pytest.raises(EngineDeadError, match="6 restarts within 60 s"):
            llm.generate({"prompt_token_ids": [300]}, use_tqdm=False)
    finally:
        client.close()


def test_sync_client_failure_ends_open_requests_with_an_error(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    try:
        env.scheduler.hold_at(2)
        client.submit(client.prepare("f", {"prompt_token_ids": [300]}, SamplingParams(max_tokens=200)))
        wait_until(lambda: bool(client.poll(5)) and env.scheduler.progress("f") >= 2)
        env.group.fail("the model no longer loads")
        (final,) = client.poll(0)
        assert final.finished and final.error == "the model no longer loads"
        assert final.outputs[0].finish_reason == "error" and final.outputs[0].token_ids
        assert client.failure == "the model no longer loads" and client.poll(0) == []
        with pytest.raises(EngineDeadError, match="no longer loads"):
            client.submit(client.prepare("g", {"prompt_token_ids": [300]}, SamplingParams(max_tokens=2)))
    finally:
        client.close()


# =========================================================================== the asyncio client
async def collect(stream: RequestStream) -> list[RequestOutput]:
    return [output async for output in stream]


@pytest.mark.asyncio
async def test_async_client_resubmits_and_fails_with_its_owned_group(env: Env) -> None:
    client = AsyncEngineClient(env.info, env.tokenizer, group=env.group, load_tokenizer=False)
    failures: list[str] = []
    client.add_failure_listener(failures.append)
    params = SamplingParams(temperature=0.0, max_tokens=60)
    try:
        env.scheduler.hold_at(5)
        streams = [client.add_request(f"a{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(collect(stream)) for stream in streams]
        await wait_until_async(lambda: all(env.scheduler.progress(f"a{i}") >= 5 for i in range(3)))
        env.scheduler.crash()
        await asyncio.sleep(0.05)
        env.scheduler.release()
        env.scheduler.restart()
        await asyncio.to_thread(env.group.restart, SCHEDULER)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        for prompt, outputs in zip(PROMPTS, results, strict=True):
            assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected_tokens(prompt, 60)
        assert set(env.scheduler.resumed()) == {"a0", "a1", "a2"}

        # The group fails: every open stream ends with an error output, new requests are refused.
        env.scheduler.hold_at(2)  # no stream can finish first, however slow this machine
        streams = [client.add_request(f"b{i}", {"prompt_token_ids": p}, params.clone(max_tokens=200))
                   for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(collect(stream)) for stream in streams]
        # Wait until the client itself has taken in two tokens of each (the scheduler having sent
        # them is not enough: on a busy machine they may still be in the socket).
        await wait_until_async(lambda: all(stream._last is not None and len(stream._last.outputs[0].token_ids) >= 2
                                           for stream in streams))
        await asyncio.to_thread(env.group.fail, "restart budget spent")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        for outputs in results:
            last = outputs[-1]
            assert last.finished and last.error == "restart budget spent"
            assert last.outputs[0].finish_reason == "error" and len(last.outputs[0].token_ids) >= 2
        assert failures == ["restart budget spent"] and client.num_unfinished == 0
        with pytest.raises(EngineDeadError, match="restart budget spent"):
            client.add_request("c", {"prompt_token_ids": [300]}, params)
        health = await client.health()
        assert health.status == "failed" and not health.serving
    finally:
        await client.shutdown()
    assert env.group.stopped


class FakeBus:
    """The bus's publishing side as clients see it (XPUB bound at bus_out), for supervisor events."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = itertools.count()

    def publish(self, topic: str, events: list[Event], actor: str | None = None) -> None:
        batch = EventBatch(actor=actor or topic, first_seq=next(self._seq), mono=time.monotonic(), wall=time.time(),
                           events=events)
        self.socket.send_multipart([topic.encode(), self._encoder.encode(batch)])

    def close(self) -> None:
        self.socket.close()


@pytest.mark.asyncio
async def test_attached_client_follows_the_supervisors_events_only(env: Env) -> None:
    bus = FakeBus(env.info.addresses.bus_out)
    client = AsyncEngineClient(env.info, env.tokenizer, load_tokenizer=False)  # attached: no group
    params = SamplingParams(temperature=0.0, max_tokens=60)
    try:
        client._ensure_tasks()
        view = client._supervision
        while "metrics" not in view.down:  # the subscription is live once an event comes through
            bus.publish(SUPERVISOR, [ActorFailed(actor="metrics", how="exited", detail="signal 9")])
            await asyncio.sleep(0.02)
        bus.publish(SUPERVISOR, [ActorRestarted(actor="metrics", pid=1, attempt=1, seconds=0.5)])
        await wait_until_async(lambda: "metrics" not in view.down)

        env.scheduler.hold_at(5)
        streams = [client.add_request(f"t{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(collect(stream)) for stream in streams]
        await wait_until_async(lambda: all(env.scheduler.progress(f"t{i}") >= 5 for i in range(3)))
        env.scheduler.crash()
        # Forgeries: supervisor events under another topic, or another actor under the supervisor's topic.
        bus.publish(SCHEDULER, [GroupFailed(reason="forged"), ActorRestarted(actor=SCHEDULER, pid=1, attempt=1,
                                                                            seconds=0.1)], actor=SUPERVISOR)
        bus.publish(SUPERVISOR, [GroupFailed(reason="forged")], actor="worker-0")
        bus.publish(SUPERVISOR, [ActorFailed(actor=SCHEDULER, how="exited", detail="signal 9")])
        await wait_until_async(lambda: SCHEDULER in view.down)
        assert client.failure is None and env.scheduler.resumed() == {}
        assert (await client.health(timeout=0.2)).unhealthy[SCHEDULER].startswith("restarting")
        env.scheduler.release()
        env.scheduler.restart()
        bus.publish(SUPERVISOR, [ActorRestarted(actor=SCHEDULER, pid=2, attempt=1, seconds=1.0)])
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        for prompt, outputs in zip(PROMPTS, results, strict=True):
            assert outputs[-1].outputs[0].token_ids == expected_tokens(prompt, 60)
        assert set(env.scheduler.resumed()) == {"t0", "t1", "t2"}

        env.scheduler.hold_at(2)
        stream = client.add_request("u", {"prompt_token_ids": [300]}, params.clone(max_tokens=200))
        task = asyncio.create_task(collect(stream))
        await wait_until_async(lambda: env.scheduler.progress("u") >= 2)
        bus.publish(SUPERVISOR, [GroupFailed(reason="worker-0 cannot start again")])
        last = (await asyncio.wait_for(task, 5))[-1]
        assert last.error == "worker-0 cannot start again" and last.outputs[0].finish_reason == "error"
        with pytest.raises(EngineDeadError, match="cannot start again"):
            client.add_request("v", {"prompt_token_ids": [300]}, params)
    finally:
        await client.shutdown()
        bus.close()


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
