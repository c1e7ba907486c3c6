"""The OpenAI-compatible server for real: one ``vllm-actors serve`` process group per module,
driven by the official ``openai`` package and raw HTTP, compared with the offline ``LLM``.

The last test stops the shared server with SIGTERM (drain, then every process gone)."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.openai_server import (  # noqa: F401 (the module's served group: fixtures)
    CHATS,
    INVALID,
    MAX_TOKENS,
    MODEL_NAME,
    PROMPTS,
    STREAM_MAX_TOKENS,
    STREAM_PROMPTS,
    Reference,
    Served,
    reference_fixture,
    served_fixture,
    server_process_fixture,
)
from tests.support.server_helpers import BusRecorder, child_pids, gone, tail
from vllm_actors.observe.tap import query_metrics
from vllm_actors.observe.tap_format import EVENT_GROUPS
from vllm_actors.protocol.metrics import SummaryQuery, TimelineQuery


# --------------------------------------------------------------------------- the openai package
def test_openai_client_gets_the_offline_greedy_text(served: Served, reference: Reference) -> None:
    client = served.openai()
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    for prompt in PROMPTS:
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert completion.choices[0].text == reference.completions[prompt]
        assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
        assert completion.usage.completion_tokens <= MAX_TOKENS and completion.usage.prompt_tokens > 0
    # Several prompts in one request: one choice each, in order.
    batch = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [choice.index for choice in batch.choices] == list(range(len(PROMPTS)))
    assert [choice.text for choice in batch.choices] == [reference.completions[p] for p in PROMPTS]
    for messages, expected in zip(CHATS, reference.chats, strict=True):
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0)
        assert chat.choices[0].message.content == expected
        assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
        assert chat.choices[0].finish_reason in ("stop", "length")
    # max_completion_tokens is the newer spelling of max_tokens.
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], max_completion_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def test_streams_arrive_in_chunks_that_add_up_to_the_text(served: Served, reference: Reference) -> None:
    """How many chunks depends on whether the engine outruns this client (a slow client gets several
    steps in one chunk, as from vLLM); that each step is sent as it comes is test_stream_chunks'."""
    client = served.openai()
    prompt = PROMPTS[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert texts, chunks
    assert "".join(texts) == reference.completions[prompt]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert all(c.usage is None for c in chunks[:-1])

    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream]
    assert deltas[0].role == "assistant"
    content = [delta.content for delta in deltas if delta.content]
    assert "".join(content) == reference.chats[0]


def test_logprobs_echo_n_and_stop_token_ids(served: Served, reference: Reference) -> None:
    client = served.openai()
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=4, temperature=0,
                                           logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.text.startswith("Hello world")
    logprobs = choice.logprobs
    num_prompt = completion.usage.prompt_tokens
    assert len(logprobs.tokens) == num_prompt + 4 == len(logprobs.token_logprobs) == len(logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text

    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHATS[0], max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content

    sampled = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=6, n=3, seed=7,
                                        temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(choice.index for choice in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens == 18
    again = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=6, n=3, seed=7,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded: reproducible
    third = reference.first_ids[2]
    stop = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [third]})
    assert stop.choices[0].finish_reason == "stop" and stop.choices[0].stop_reason == third
    assert stop.usage.completion_tokens == reference.first_ids.index(third) + 1




async def _send_invalid(client: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return await client.post(path, content=body, headers={"content-type": "application/json"})
    return await client.post(path, json=body)


def test_invalid_requests_get_4xx_and_disturb_nobody(served: Served, reference: Reference) -> None:
    assert len(INVALID) >= 15

    async def run() -> tuple[str, list[tuple[str, httpx.Response]]]:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=60) as client:
            # A good request streams while the bad ones come in.
            body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "stream": True}

            async def good() -> str:
                text = []
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
                return "".join(text)

            good_task = asyncio.create_task(good())
            replies = [(case[0], await _send_invalid(client, case[1], case[2])) for case in INVALID]
            others = [("unknown path", await client.get("/v1/nothing-here")),
                      ("wrong method", await client.get("/v1/completions"))]
            return await good_task, replies + others

    good_text, replies = asyncio.run(run())
    assert good_text == reference.completions[PROMPTS[1]]
    expected = {case[0]: case for case in INVALID}
    for name, response in replies:
        body = response.json()
        assert 400 <= response.status_code < 500, (name, response.status_code, body)
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], (name, body)
        assert set(error) == {"message", "type", "param", "code"}, (name, body)
        if name in expected:
            _, _, _, status, param = expected[name]
            assert response.status_code == status, (name, body)
            assert error["code"] == status
            if param is not None:
                assert error["param"] == param, (name, body)
    # The server answers as before.
    client = served.openai()
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == reference.completions[PROMPTS[2]]
    assert httpx.get(f"{served.base_url}/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="a")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="a", temperature=-2)


# --------------------------------------------------------------------------- concurrency
def test_64_concurrent_streams_all_complete_correctly(served: Served, reference: Reference) -> None:
    async def run() -> dict[str, tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(prompt: str) -> tuple[str, tuple[str, int]]:
            stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=STREAM_MAX_TOKENS,
                                                     temperature=0, stream=True)
            parts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
            return prompt, ("".join(parts), len(parts))

        try:
            return dict(await asyncio.gather(*(one(prompt) for prompt in STREAM_PROMPTS)))
        finally:
            await client.close()

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    wrong = {p: (text, reference.streams[p]) for p, (text, _) in results.items() if text != reference.streams[p]}
    assert not wrong, wrong
    # how many chunks each stream got depends on whether the engine outran this client (test_stream_chunks)
    assert all(count >= 1 for _, count in results.values())
    print(f"64 concurrent streams of {STREAM_MAX_TOKENS} tokens: {elapsed:.1f} s")


# --------------------------------------------------------------------------- disconnects
def _metrics(served: Served, query):  # noqa: ANN001, ANN202
    return query_metrics(served.info.addresses.metrics, query)


def _settled_blocks(served: Served, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        summary = _metrics(served, SummaryQuery())
        if summary.kv_blocks_in_use == 0 or time.monotonic() > deadline:
            return summary.kv_blocks_in_use
        time.sleep(0.05)


def _check_aborted_by_disconnect(served: Served, recorder: BusRecorder, request_id: str) -> None:
    aborted = recorder.wait_for("ABORTED", request_id)
    assert aborted.reason == "disconnect"
    assert _settled_blocks(served) == 0
    recorder.wait_for("FREED", request_id)
    timeline = _metrics(served, TimelineQuery(request_id=request_id))
    assert timeline.found and timeline.state == "aborted", timeline.state
    kinds = [entry.type for entry in timeline.events]
    assert kinds[0] == "ARRIVED" and "ABORTED" in kinds
    # Only the KV-cache manager's events may follow: a plan sent before the abort still allocates
    # or caches blocks for it, and that actor's events are not ordered against the scheduler's.
    assert set(kinds[kinds.index("ABORTED") + 1:]) <= EVENT_GROUPS["KV"], kinds


def test_a_client_that_disconnects_mid_stream_aborts_its_request(served: Served) -> None:
    recorder = BusRecorder(served.info.addresses.bus_out, bus_in=served.info.addresses.bus_in)
    try:
        body = {"model": MODEL_NAME, "messages": CHATS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=served.base_url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
                request_id = first["id"]
                next(line for line in lines if line.startswith("data: "))
                recorder.wait_for("FIRST_TOKEN", request_id)
            # leaving the block closes the connection mid-stream
        left = time.monotonic()
        _check_aborted_by_disconnect(served, recorder, request_id)
        finished = recorder.events("FINISHED", request_id)
        assert not finished
        tokens = [e for e in recorder.events("TOKENS") if request_id in e.request_ids]
        assert tokens and max(e.num_output_tokens[e.request_ids.index(request_id)] for e in tokens) < 200
        assert time.monotonic() - left < 15

        # Not streaming: a client that gives up waiting aborts its request too. It hangs up as soon as
        # its request's first token is on the bus, long before the 200th (no timing guess involved).
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        connection = http.client.HTTPConnection("127.0.0.1", int(served.base_url.rsplit(":", 1)[1]), timeout=60)
        try:
            connection.request("POST", "/v1/completions", body=json.dumps(body),
                               headers={"Content-Type": "application/json", "X-Request-Id": "impatient"})
            recorder.wait_for("FIRST_TOKEN", "cmpl-impatient-0")
        finally:
            connection.close()  # without reading the response: the client is gone
        _check_aborted_by_disconnect(served, recorder, "cmpl-impatient-0")
    finally:
        recorder.close()


# --------------------------------------------------------------------------- metrics
def test_prometheus_metrics_use_vllm_names(served: Served) -> None:
    text = httpx.get(f"{served.base_url}/metrics").text
    label = f'engine="0",model_name="{MODEL_NAME}"'  # prometheus_client writes labels sorted
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert f"{name}{{{label}}}" in text, name
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert values[f"vllm:prompt_tokens_total{{{label}}}"] > 0
    assert values[f"vllm:generation_tokens_total{{{label}}}"] > 0
    # Prefix caching is on by default; this module's requests repeat prompts ("Hello" and the like).
    queries = values[f"vllm:prefix_cache_queries_total{{{label}}}"]
    hits = values[f"vllm:prefix_cache_hits_total{{{label}}}"]
    assert queries > 0 and 0 < hits < queries
    success = f'vllm:request_success_total{{engine="0",finished_reason="%s",model_name="{MODEL_NAME}"}}'
    assert values[success % "length"] > 0
    assert values[success % "abort"] >= 2  # the disconnects
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert values[f"{histogram}_count{{{label}}}"] > 0, histogram
        assert f'{histogram}_bucket{{engine="0",le="+Inf",model_name="{MODEL_NAME}"}}' in text


def test_vllm_request_histograms_and_cache_config_info(served: Served) -> None:
    """The request-level families vLLM's dashboard reads, with vLLM's types and buckets, and their
    values right for requests of known size (the histograms count every finished request)."""
    from vllm_actors.server.metrics import N_BUCKETS, REQUEST_LATENCY_BUCKETS, build_1_2_5_buckets

    label = f'engine="0",model_name="{MODEL_NAME}"'

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{served.base_url}/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    before = scrape()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for _ in range(2):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "n": 2, "ignore_eos": True}
        assert httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=120).status_code == 200
    after = scrape()
    text = httpx.get(f"{served.base_url}/metrics").text

    def grew(name: str) -> float:
        return after[f"{name}{{{label}}}"] - before.get(f"{name}{{{label}}}", 0.0)

    # two requests of n = 2, as in vLLM four engine requests: 7 prompt tokens and 3 generated each
    assert grew("vllm:request_prompt_tokens_count") == 4 and grew("vllm:request_prompt_tokens_sum") == 28
    assert grew("vllm:request_generation_tokens_sum") == 12
    assert grew("vllm:request_params_n_sum") == 4 and grew("vllm:request_params_max_tokens_sum") == 12
    for name in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds"):
        assert grew(f"{name}_count") == 4 and grew(f"{name}_sum") >= 0
    def buckets(name: str) -> list[float]:
        return [float(line.split('le="')[1].split('"')[0]) for line in text.splitlines()
                if line.startswith(f"{name}_bucket{{") and 'le="+Inf"' not in line]

    tokens = list(build_1_2_5_buckets(served.info.max_model_len))
    assert tokens[:6] == [1, 2, 5, 10, 20, 50]
    assert buckets("vllm:request_prompt_tokens") == tokens == buckets("vllm:request_params_max_tokens")
    assert buckets("vllm:request_params_n") == list(N_BUCKETS)
    assert buckets("vllm:request_inference_time_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert "# TYPE vllm:request_prompt_tokens histogram" in text
    assert "# TYPE vllm:cache_config_info gauge" in text
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert f'num_gpu_blocks="{served.info.worker["num_blocks"]}"' in info and info.endswith(" 1.0")
    assert 'engine="0"' in info


# --------------------------------------------------------------------------- shutdown (last)
def test_sigterm_lets_running_requests_finish_refuses_new_ones_and_stops_every_process(served: Served) -> None:
    children = child_pids(served.process.pid)
    assert len(children) == 5, children
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.Client(base_url=served.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            served.process.send_signal(signal.SIGTERM)
            # Until the server has taken the signal in, a new request may still be served; from then
            # on it is refused: wait for that (not for a guessed time), then check how.
            deadline = time.monotonic() + 60
            while True:
                try:
                    refused = httpx.post(f"{served.base_url}/v1/completions",
                                         json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 2}, timeout=10)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    break  # the listening socket is closed (a connection it had accepted is reset)
                if refused.status_code != 200:
                    assert refused.status_code == 503, refused.text  # or refused with 503 while draining
                    break
                assert time.monotonic() < deadline, "new requests were still served 60 s after SIGTERM"
            events.extend(line for line in lines if line.startswith("data: "))
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert served.process.wait(timeout=60) == 0, tail(served.log_path)
    deadline = time.monotonic() + 15
    while not all(gone(pid) for pid in children):
        assert time.monotonic() < deadline, [pid for pid in children if not gone(pid)]
        time.sleep(0.1)
    assert not Path(served.info.run_dir).exists()
