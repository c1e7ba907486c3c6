"""The embeddable frontend: AsyncEngineClient in an asyncio application, build_app served in
process (httpx's ASGI transport), the bounded queue, the mounted-app example, /health naming a
dead actor and, with a supervisor, serving again once it is restarted (last: it kills one)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from tests.support.server_helpers import free_port, stop_process, tail
from vllm_actors import SamplingParams
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.supervision import supervised
from vllm_actors.server import build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mount_in_fastapi.py"
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_qwen3: Path):
    engine = await AsyncEngineClient.start(str(tiny_qwen3), dtype="float32", max_model_len=256,
                                           num_gpu_blocks_override=256, check_invariants=True)
    try:
        yield engine
    finally:
        await engine.shutdown()
    assert engine.group is not None and not any(engine.group.alive().values())


def asgi(app) -> httpx.AsyncClient:  # noqa: ANN001
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app", timeout=60)


async def timeline_state(client: AsyncEngineClient, request_id: str, wanted: str, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        timeline = await client.get_timeline(request_id)
        if timeline.state == wanted:
            return [entry.type for entry in timeline.events]
        assert time.monotonic() < deadline, (request_id, timeline.state)
        await asyncio.sleep(0.05)


async def test_generate_yields_cumulative_outputs(client: AsyncEngineClient) -> None:
    outputs = [output async for output in client.generate("Hello world", SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True), request_id="cumulative")]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    texts = [o.outputs[0].text for o in outputs]
    ids = [o.outputs[0].token_ids for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and all(
        b[: len(a)] == a for a, b in zip(ids, ids[1:]))
    assert len(ids[-1]) == 12 and outputs[-1].outputs[0].finish_reason == "length"
    assert outputs[-1].request_id == "cumulative" and client.num_unfinished == 0
    # Several requests at once from one asyncio application.
    prompts = [f"Prompt number {i}" for i in range(6)]

    async def final(prompt: str) -> str:
        last = None
        async for output in client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6)):
            last = output
        return last.outputs[0].text

    together = await asyncio.gather(*(final(p) for p in prompts))
    alone = [await final(p) for p in prompts[:2]]
    assert together[:2] == alone


async def test_abort_and_leaving_early_abort_at_the_scheduler(client: AsyncEngineClient) -> None:
    stream = client.add_request("to-abort", "Once upon a time", LONG)
    first = await stream.__anext__()
    assert not first.finished
    client.abort("to-abort")
    rest = [output async for output in stream]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    kinds = await timeline_state(client, "to-abort", "aborted")
    assert "ABORTED" in kinds and "FINISHED" not in kinds

    async for _ in client.generate("Once upon a time", LONG, request_id="left-early", cancel_reason="disconnect"):
        break  # closing the generator aborts the request
    await timeline_state(client, "left-early", "aborted")
    timeline = await client.get_timeline("left-early")
    (aborted,) = [entry.event for entry in timeline.events if entry.type == "ABORTED"]
    assert aborted.reason == "disconnect"
    summary = await client.get_metrics()
    assert summary.aborted_by_reason.get("disconnect", 0) >= 1

    with pytest.raises(ValueError, match="max_model_len"):
        client.add_request("too-long", {"prompt_token_ids": [5] * 300}, LONG)
    assert client.num_unfinished == 0


async def test_build_app_serves_in_process(client: AsyncEngineClient) -> None:
    app = build_app(client, served_model_names=["local", "alias"])
    async with asgi(app) as http:
        models = (await http.get("/v1/models")).json()
        assert [card["id"] for card in models["data"]] == ["local", "alias"]
        assert models["data"][0]["max_model_len"] == 256
        reply = await http.post("/v1/chat/completions", json={
            "model": "alias", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == "local" and body["usage"]["completion_tokens"] == 5
        assert (await http.get("/health")).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="local"} 1.0' in metrics
        assert (await http.get("/version")).json()["version"]


async def test_a_full_queue_answers_503_with_retry_after(client: AsyncEngineClient) -> None:
    app = build_app(client, max_num_seqs=1, max_waiting_requests=1)
    busy = [client.add_request(f"busy-{i}", "Hello", LONG) for i in range(2)]
    try:
        async with asgi(app) as http:
            refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "overloaded" in refused.json()["error"]["message"]
            for stream in busy:
                stream.abort()
            accepted = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert accepted.status_code == 200, accepted.text
    finally:
        for stream in busy:
            stream.abort()


async def test_the_mounted_app_example_runs(client: AsyncEngineClient, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "example.log"
    with open(log_path, "wb") as log_file:
        example = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--attach", client.info.run_dir, "--port", str(port)],
            stdout=log_file, stderr=subprocess.STDOUT, env=dict(os.environ),
        )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            deadline = time.monotonic() + 60
            while True:
                assert example.poll() is None, tail(log_path)
                try:
                    if (await http.get("/llm/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, tail(log_path)
                await asyncio.sleep(0.2)
            assert (await http.get("/")).json()["openai_api"] == "/llm/v1"
            shout = (await http.get("/shout", params={"text": "Hello"})).json()
            assert shout["completion"] == shout["completion"].upper() and shout["prompt"] == "Hello"
            sdk = openai.AsyncOpenAI(base_url=f"{base}/llm/v1", api_key="unused", max_retries=0)
            chat = await sdk.chat.completions.create(model="local-llm", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, temperature=0)
            assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
            chunks = [c async for c in await sdk.completions.create(
                model="local-llm", prompt="Hello", max_tokens=4, temperature=0, stream=True)]
            # how many chunks depends on how fast the engine runs ahead of the stream (outputs that
            # queue up go out together, as in vLLM): the streamed text is the whole completion
            whole = await sdk.completions.create(model="local-llm", prompt="Hello", max_tokens=4, temperature=0)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
            assert chunks[-1].choices[0].finish_reason == "length"
            await sdk.close()
        example.send_signal(signal.SIGTERM)
        assert example.wait(timeout=30) == 0 or example.returncode == -signal.SIGTERM, tail(log_path)
    finally:
        stop_process(example)
    assert await client.check_health() == {}  # an attached client leaves the group running


async def test_health_names_a_dead_actor(client: AsyncEngineClient) -> None:
    app = build_app(client)
    async with asgi(app) as http:
        assert (await http.get("/health")).status_code == 200
        os.kill(client.group.pids()["kv_cache_manager"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (reply := await http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert reply.status_code == 503
        body = reply.json()
        assert "kv_cache_manager" in body["error"]["message"] and "kv_cache_manager" in body["unhealthy"]
        if supervised(client.group):  # restarted: serving again, with the same client
            while (reply := await http.get("/health")).status_code != 200:
                assert time.monotonic() < deadline + 60, reply.text
                await asyncio.sleep(0.1)
            done = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
            assert done.status_code == 200, done.text
